"""osdp.describe.recompute: a checkpointed unit recomputes its forward in backward, with gradients equal to the plain
module's, keeps its state-dict keys and type, survives a deep copy independently, and is undone exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from osdp.describe.recompute import checkpoint_policy, checkpoint_unit, is_checkpointed, undo_checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.fc2(torch.tanh(self.fc1(x))) * scale


def grads(module, x):
    module.zero_grad(set_to_none=True)
    module(x, scale=2.0).square().sum().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def test_a_checkpointed_unit_recomputes_and_gives_the_same_gradients():
    torch.manual_seed(0)
    plain, x = Block(), torch.randn(4, 8)
    checkpointed = copy.deepcopy(plain)
    checkpoint_unit(checkpointed)
    checkpoint_unit(checkpointed)  # twice: still one checkpoint
    assert isinstance(checkpointed, Block) and is_checkpointed(checkpointed) and not is_checkpointed(plain)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    expected, got = grads(plain, x), grads(checkpointed, x)
    assert plain.calls == 1 and checkpointed.calls == 2  # forward, then its recomputation in backward
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


class Named(nn.Module):
    """A unit whose forward takes keywords checkpoint() has too, and a tensor by keyword."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, *, bias, debug=False, use_reentrant=True, context_fn=None):
        y = torch.tanh(self.fc(x)) + bias
        return (y, debug, use_reentrant, context_fn) if debug else y


def test_a_checkpointed_units_keyword_arguments_are_its_own():
    torch.manual_seed(0)
    for policy in ("full", "selective"):
        plain, x, bias = Named(), torch.randn(4, 8), torch.randn(8, requires_grad=True)
        checkpointed = copy.deepcopy(plain)
        checkpoint_unit(checkpointed, policy)
        assert checkpointed(x, bias=bias, debug=True, use_reentrant="mine", context_fn="mine")[1:] == (
            True, "mine", "mine")
        outs = [m(x, bias=bias).square().sum() for m in (plain, checkpointed)]
        grads = [torch.autograd.grad(o, [*m.parameters(), bias]) for o, m in zip(outs, (plain, checkpointed))]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_deep_copy_stays_checkpointed_and_independent_and_undo_restores_the_class():
    torch.manual_seed(0)
    block = Block()
    checkpoint_unit(block)
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin.fc1.weight.zero_()
    x = torch.randn(4, 8)
    grads(twin, x)
    assert twin.calls == 2 and block.calls == 0  # the copy runs its own forward, checkpointed
    undo_checkpoint(block)
    assert type(block) is Block and not is_checkpointed(block)
    grads(block, x)
    assert block.calls == 1


def test_a_selectively_checkpointed_unit_keeps_its_matmuls_and_gives_the_same_gradients():
    """Selective: the matmuls' outputs are kept (fc1's and fc2's are not recomputed), tanh is recomputed; the
    gradients are the plain module's, bitwise. Switching policy and undoing go back to the class."""
    torch.manual_seed(0)
    plain, x = Block(), torch.randn(4, 8)
    selective = copy.deepcopy(plain)
    checkpoint_unit(selective, "selective")
    assert checkpoint_policy(selective) == "selective"
    assert (type(selective).__name__, type(selective).__qualname__) == ("Block", "Block")  # the plan does not show
    expected = grads(plain, x)
    addmm = []
    with _Ops(addmm):
        got = grads(selective, x)
    assert selective.calls == 2  # its forward ran again in backward, for what was not kept
    assert addmm.count("addmm") == 2  # fc1's and fc2's, in forward only: the recompute took them from the cache
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    checkpoint_unit(selective, "full")
    assert checkpoint_policy(selective) == "full" and isinstance(selective, Block)
    addmm.clear()
    with _Ops(addmm):
        grads(selective, x)
    # full: fc1's done again in the recompute (which stops once backward has what it needs: not fc2's output)
    assert addmm.count("addmm") == 3
    undo_checkpoint(selective)
    assert type(selective) is Block and checkpoint_policy(selective) == "none"


class _Ops:
    """Records the name of every addmm and mm dispatched."""

    def __init__(self, out):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
                    out.append(func.__name__.split(".")[0])
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


class _Scale(torch.autograd.Function):
    """A user's own autograd function: a matmul and a pointwise op the selective policy sees only as ops."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        y = torch.tanh(x @ w)
        g = grad * (1 - y * y)
        return g @ w.t(), x.t() @ g


class CustomBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.fc(_Scale.apply(x, self.w)) * scale


def test_a_custom_autograd_function_inside_a_selectively_checkpointed_unit_trains_as_plain():
    """Ops the policy does not know are recomputed, as under full checkpointing: same gradients, bitwise."""
    torch.manual_seed(0)
    plain, x = CustomBlock(), torch.randn(4, 8)
    selective = copy.deepcopy(plain)
    checkpoint_unit(selective, "selective")
    expected, got = grads(plain, x), grads(selective, x)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


class ConvBN(nn.Module):
    """A ResNet stem: its BatchNorm updates its running statistics (and counts the batches) at every training
    forward."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_a_checkpointed_unit_updates_its_batchnorm_statistics_once_per_step():
    torch.manual_seed(0)
    plain = ConvBN()
    checkpointed = {policy: copy.deepcopy(plain) for policy in ("full", "selective")}
    for policy, module in checkpointed.items():
        checkpoint_unit(module, policy)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8)
        expected = grads_of(plain, x)
        for policy, module in checkpointed.items():
            got = grads_of(module, x)
            assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in expected), policy
            for name, buffer in plain.named_buffers():  # the recompute in backward left them as the forward did
                assert torch.equal(module.get_buffer(name), buffer), (policy, step, name)
    assert int(plain.bn.num_batches_tracked) == 3


def grads_of(module, x):
    module.zero_grad(set_to_none=True)
    module(x).square().sum().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


class _Mixed(nn.Module):
    """A unit whose forward advances a buffer it reads (spectral_norm's power iteration), one with BatchNorm (its
    running statistics are not read in training), and a plain one."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm

        self.spectral = nn.Sequential(spectral_norm(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 16))
        self.normed = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
        self.plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x):
        return self.plain(self.normed(self.spectral(x))).square().mean()


def test_a_unit_whose_forward_advances_a_buffer_it_reads_is_offered_no_checkpoint():
    """Recomputed, spectral_norm's forward would run another power iteration from the ``_u`` it wrote, and the
    backward would differentiate another weight (its gradient about 8% off): the search does not choose that, and
    a hand-written plan that does is refused in the first forward."""
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    layer = spectral_norm(nn.Linear(16, 32))
    recomputed = copy.deepcopy(layer)
    checkpoint_unit(recomputed)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="writes its buffer.*cannot be checkpointed"):  # a hand-written plan
        grads_of(recomputed, x)
    for source, offered in checkpoint_offered(_Mixed):
        assert offered == {"spectral": False, "normed": True, "plain": True}, (source, offered)


def checkpoint_offered(build) -> list[tuple[str, dict[str, bool]]]:
    """Per description of ``build()`` (measured, analytic): whether each unit is offered a checkpoint."""
    from osdp.describe.analytic import describe_analytic
    from osdp.describe.measured import describe
    from osdp.machine.presets import device_preset

    example = torch.randn(8, 16)
    descriptions = (describe(build(), example, cache=False, progress=False),
                    describe_analytic(build(), example, device_preset("cpu-loopback", 2), cache=False, progress=False))
    return [(d.source, {u.path: u.costs["fp32"].checkpointable for u in d.units if u.path}) for d in descriptions]


class _HookComputedWeights(nn.Module):
    """Linears whose ``weight`` a forward pre-hook of torch's computes from other tensors and returns nothing:
    pruning's (weight_orig * weight_mask) and the older hook-based weight_norm's (g * v / |v|)."""

    def __init__(self):
        super().__init__()
        import warnings

        from torch.nn.utils import prune

        self.pruned = nn.Linear(16, 32)
        prune.l1_unstructured(self.pruned, "weight", amount=0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated for the parametrizations' one, still in use
            self.normed = torch.nn.utils.weight_norm(nn.Linear(32, 16))

    def forward(self, x):
        return self.normed(torch.tanh(self.pruned(x)))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_unit_whose_weights_torchs_hooks_compute_recomputes_them(policy):
    """The recompute runs torch's own forward pre-hooks again, as the forward ran them: without, it reused the
    weights the forward computed and saved another number of tensors (torch's CheckpointError)."""
    torch.manual_seed(0)
    plain = _HookComputedWeights()
    torch.manual_seed(0)
    recomputed = _HookComputedWeights()  # not a deep copy: weight_norm's computed weight refuses one
    checkpoint_unit(recomputed, policy)
    x = torch.randn(4, 16)
    for _ in range(2):
        expected, got = grads_of(plain, x), grads_of(recomputed, x)
        assert set(got) == set(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)


class _Keeping(nn.Module):
    """Its forward keeps, as a plain attribute, a tensor it computed with grad (an attention map kept for display),
    or that tensor detached."""

    def __init__(self, detach: bool):
        super().__init__()
        self.fc, self.detach, self.kept = nn.Linear(16, 16), detach, None

    def forward(self, x):
        y = self.fc(x).softmax(-1)
        self.kept = y.detach() if self.detach else y
        return y


class _KeepingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.keeps_graph, self.keeps_values, self.plain = _Keeping(False), _Keeping(True), nn.Linear(16, 16)

    def forward(self, x):
        return self.plain(self.keeps_values(self.keeps_graph(x))).square().mean()


def test_a_unit_keeping_a_tensor_with_its_graph_is_offered_no_checkpoint():
    """The kept tensor's graph holds a checkpoint's inputs past the unit's backward, to the next forward (a plan
    checkpointing such blocks measured 7 KiB over its budget); a value kept detached holds no graph."""
    for source, offered in checkpoint_offered(_KeepingNet):
        assert offered == {"keeps_graph": False, "keeps_values": True, "plain": True}, (source, offered)


class SelfAttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]  # query is key is value: one packed projection


@pytest.mark.parametrize("inner", ["full", "selective"])
def test_a_unit_checkpointed_inside_a_checkpointed_unit_gives_the_same_gradients(inner):
    """A recompute inside another's gives a unit its arguments apart; nn.MultiheadAttention tests query, key and
    value for identity, and would project them otherwise (saving other tensors than its forward did)."""
    torch.manual_seed(0)
    plain, x = nn.Sequential(SelfAttentionBlock(), SelfAttentionBlock()), torch.randn(2, 5, 16)
    nested = copy.deepcopy(plain)
    checkpoint_unit(nested[0].attn, inner)
    checkpoint_unit(nested)
    for model in (plain, nested):
        model(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), nested.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
