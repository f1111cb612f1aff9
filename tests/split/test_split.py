"""SplitLinear against nn.Linear, its memory, the C++ and PyTorch loops, FSDP2 integration, checkpoints.

Multi-rank cases are grouped into few spawns (each costs seconds on 2 cores).
The extension is built once by the ``extension`` fixture in this process and
loaded from its cache by the ranks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import osdp.split as split
from osdp.split import SplitLinear, _build, _extension, apply_split, split_layout, split_parameters, splittable_linears

KS = (1, 2, 3, 4, 8)
# (in, out, leading dims): divisible by N*k, uneven for k and N, fewer rows than ranks*k (empty pieces/ranks)
SHAPES = ((16, 96, (5,)), (7, 13, (2, 3)), (6, 5, (4,)))


@pytest.fixture(scope="module")
def backends():
    try:
        split.build_extension()
        return ("python", "cpp")
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"C++ extension not built, testing the PyTorch loop only: {e}")
        return ("python",)


def _mesh(world_size):
    return init_device_mesh("cpu", (world_size,))


def _reference(linear, xs, grads, rank):
    """nn.Linear on every rank's batch: this rank's output and input grad, and the mean weight/bias grads."""
    gw, gb = 0, 0
    for r, (x, g) in enumerate(zip(xs, grads)):
        linear.zero_grad()
        x = x.clone().requires_grad_()
        y = linear(x)
        y.backward(g)
        if r == rank:
            y_r, gx_r = y.detach(), x.grad
        gw, gb = gw + linear.weight.grad / len(xs), gb + linear.bias.grad / len(xs)
    return y_r, gx_r, gw, gb


def _matches_linear(rank, world_size, backends):
    """Forward and backward equal nn.Linear (fp32, 1e-5) for every k and shape; both loops agree;
    the gathered-weight peak is two slices (one for k = 1), as measured by the loop."""
    mesh = _mesh(world_size)
    report = []
    for in_f, out_f, lead in SHAPES:
        torch.manual_seed(0)
        linear = nn.Linear(in_f, out_f)
        xs = [torch.randn(*lead, in_f) for _ in range(world_size)]
        grads = [torch.randn(*lead, out_f) for _ in range(world_size)]
        y_ref, gx_ref, gw_ref, gb_ref = _reference(linear, xs, grads, rank)
        for k in KS:
            by_backend = {}
            for name in backends:
                split.set_backend(name)
                module = SplitLinear.from_linear(copy.deepcopy(linear), k, mesh)  # its own bias
                x = xs[rank].clone().requires_grad_()
                split.reset_peak_memory_stats()
                y = module(x)
                forward_stats = split.memory_stats()
                split.reset_peak_memory_stats()
                y.backward(grads[rank])
                backward_stats = split.memory_stats()
                gw = module.weight.grad.full_tensor()
                case = f"{name} k={k} in={in_f} out={out_f} N={world_size}"
                torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5, msg=case)
                torch.testing.assert_close(x.grad, gx_ref, atol=1e-5, rtol=1e-5, msg=case)
                torch.testing.assert_close(gw, gw_ref, atol=1e-5, rtol=1e-5, msg=case)
                torch.testing.assert_close(module.bias.grad, grads[rank].reshape(-1, out_f).sum(0), msg=case)
                by_backend[name] = (y.detach(), x.grad, gw)
                rows, pieces = split_layout(out_f, world_size, k)
                report.append(
                    dict(case=case, k=k, out=out_f, in_=in_f, pieces=len(pieces), slice_bytes=world_size * max(pieces) * in_f * 4,
                         full_bytes=out_f * in_f * 4, forward=forward_stats, backward=backward_stats)
                )
            for name in backends[1:]:
                for a, b in zip(by_backend[backends[0]], by_backend[name]):
                    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"{name} vs {backends[0]} k={k}")
    split.set_backend("auto")
    return report


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forward_backward_match_linear_and_peak_is_two_slices(world_size, backends):
    report = run_ranks(_matches_linear, world_size, backends, timeout=240)[0]
    assert len(report) == len(SHAPES) * len(KS) * len(backends)
    for r in report:
        slices_live = 2 if r["pieces"] > 1 else 1  # current + prefetched
        for phase in ("forward", "backward"):
            assert r[phase]["peak_gathered_bytes"] == slices_live * r["slice_bytes"], (r["case"], phase, r[phase])
        assert r["backward"]["peak_grad_bytes"] <= 2 * r["slice_bytes"], r["case"]
        if r["out"] % (world_size * r["k"]) == 0:  # no padding: the peak is exactly 2/k of the weight
            assert r["forward"]["peak_gathered_bytes"] * r["k"] == slices_live * r["full_bytes"], r["case"]


def _saved_bytes(fn, module) -> int:
    """Bytes of the tensors autograd saves while ``fn`` runs, not counting ``module``'s parameters (kept anyway)."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in module.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved), out


def _frozen_weight(rank, world_size, backends):
    """A frozen weight (LoRA's base Linears): the input gradient equals nn.Linear's, no weight gradient is made,
    and the op saves what nn.Linear saves (not the input, which only the weight's gradient needs)."""
    mesh = _mesh(world_size)
    torch.manual_seed(0)
    linear = nn.Linear(16, 96).requires_grad_(False)
    x = torch.randn(4, 5, 16)
    g = torch.randn(4, 5, 96)
    ref_x = x.clone().requires_grad_()
    ref_saved, y_ref = _saved_bytes(lambda: linear(ref_x), linear)
    y_ref.backward(g)
    out = []
    for name in backends:
        split.set_backend(name)
        module = SplitLinear.from_linear(copy.deepcopy(linear), 4, mesh)
        mine = x.clone().requires_grad_()
        saved, y = _saved_bytes(lambda: module(mine), module)
        y.backward(g)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.grad, ref_x.grad, atol=1e-5, rtol=1e-5)
        out.append((name, module.weight.grad is None, saved, ref_saved))
    split.set_backend("auto")
    return out


def test_a_frozen_weight_gives_the_input_gradient_and_saves_what_linear_saves(backends):
    for name, no_weight_grad, saved, ref_saved in run_ranks(_frozen_weight, 2, backends, timeout=120)[0]:
        assert no_weight_grad, name
        assert saved == ref_saved, (name, saved, ref_saved)

def _peaks_every_step(rank, world_size, backends, steps):
    """A split Linear's forward and backward, ``steps`` times per loop: the peak live bytes of each."""
    from osdp.machine.memory import PeakMemory

    mesh = _mesh(world_size)
    out = {}
    for name in backends:
        split.set_backend(name)
        torch.manual_seed(0)
        module = SplitLinear.from_linear(nn.Linear(64, 256), 8, mesh)  # slices of 8 KiB, as in gpt2-tiny
        x = torch.randn(16, 64, requires_grad=True)
        peaks = []
        for _ in range(steps):
            with PeakMemory("cpu", module, x) as meter:
                module(x).sum().backward()
            peaks.append(meter.stats().peak_bytes)
            module.zero_grad(set_to_none=True)
            x.grad = None
        out[name] = peaks
    split.set_backend("auto")
    return out


def test_the_loops_free_their_slices_where_they_let_go_of_them(backends):
    """Gloo's worker thread can hold a collective's tensors a moment after the collective completed; a slice
    freed then was freed after the loop's next allocation in some steps (one slice more in a plan's peak,
    tests/planner/test_wrap_search.py). Both loops wait until it let go: every step's peak is the same."""
    for by_backend in run_ranks(_peaks_every_step, 2, backends, 60, timeout=180):
        for name, peaks in by_backend.items():
            assert len(set(peaks)) == 1, (name, sorted(set(peaks)), [peaks.count(p) for p in sorted(set(peaks))])


def _bf16_and_mixed_precision(rank, world_size, backends):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(world_size)
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(2, 5, 24)
    for name in backends:
        split.set_backend(name)
        # bf16 weights and inputs, like nn.Linear in bf16
        linear_bf16 = nn.Linear(24, 40).to(torch.bfloat16)
        linear_bf16.load_state_dict(linear.state_dict())
        module = SplitLinear.from_linear(linear_bf16, 4, mesh)
        y = module(x.bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, linear_bf16(x.bfloat16()), atol=2e-2, rtol=2e-2)
        y.float().sum().backward()
        assert module.weight.grad.dtype == torch.bfloat16
        # fp32 parameters, bf16 compute and gathers, fp32 gradient reduction (FSDP2's MixedPrecisionPolicy)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        module = SplitLinear.from_linear(copy.deepcopy(linear), 4, mesh, mp_policy=policy)
        split.reset_peak_memory_stats()
        y = module(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), linear(x), atol=3e-2, rtol=3e-2)
        assert split.memory_stats()["peak_gathered_bytes"] == 2 * 40 // 4 * 24 * 2  # two bf16 slices
        y.float().sum().backward()
        assert module.weight.grad.dtype == torch.float32
        linear.zero_grad()
        linear(x).sum().backward()
        torch.testing.assert_close(module.weight.grad.full_tensor(), linear.weight.grad, atol=5e-2, rtol=2e-2)
    split.set_backend("auto")
    return True


def test_bf16_forward_and_mixed_precision(backends):
    assert run_ranks(_bf16_and_mixed_precision, 2, backends, timeout=120) == [True, True]


class _Net(nn.Module):
    def __init__(self, checkpoint_mlp=False):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.out = nn.Linear(32, 4)
        self.checkpoint_mlp = checkpoint_mlp

    def forward(self, x):
        h = self.inp(x)
        mlp = torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=False) if self.checkpoint_mlp else self.mlp(h)
        return self.out(torch.relu(h) + mlp)


def _train(model, batches, targets, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        loss = nn.functional.mse_loss(model(batches[step]), targets[step])
        loss.backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _fsdp2_training(rank, world_size, backends):
    """A split unit under fully_shard(ignored_params=...) trains like single-process nn.Linear and like FSDP2."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world_size)
    torch.manual_seed(0)
    init = _Net().state_dict()
    xs = [torch.randn(8, 16) for _ in range(3)]
    ts = [torch.randn(8, 4) for _ in range(3)]
    local = slice(rank * 4, rank * 4 + 4)  # each rank its part of the global batch of 8

    reference = _Net()
    reference.load_state_dict(init)
    ref_grads = _train(reference, xs, ts)

    fsdp = _Net()
    fsdp.load_state_dict(init)
    fully_shard(fsdp.mlp, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_grads = _train(fsdp, [x[local] for x in xs], [t[local] for t in ts])

    # every implementation; then the last one with the split unit's activations checkpointed (recomputed forward)
    for name, checkpoint_mlp in [(b, False) for b in backends] + [(backends[-1], True)]:
        split.set_backend(name)
        model = _Net(checkpoint_mlp)
        model.load_state_dict(init)
        assert apply_split(model.mlp, 3, mesh) == ["0", "2"]
        assert isinstance(model.mlp[0], SplitLinear)
        fully_shard(model.mlp, mesh=mesh, ignored_params=split_parameters(model.mlp))
        fully_shard(model, mesh=mesh)
        grads = _train(model, [x[local] for x in xs], [t[local] for t in ts])
        name += " checkpointed" if checkpoint_mlp else ""
        for step in range(3):
            for n, g in grads[step].items():
                torch.testing.assert_close(g, fsdp_grads[step][n], atol=1e-6, rtol=1e-6, msg=f"{name} step {step} {n} vs FSDP2")
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(_full(p), q.detach(), atol=1e-5, rtol=1e-5, msg=f"{name} {n} vs single process")
    for n, g in fsdp_grads[0].items():
        torch.testing.assert_close(g, ref_grads[0][n], atol=1e-5, rtol=1e-5, msg=f"FSDP2 {n} vs single process")
    split.set_backend("auto")
    return True


def test_fsdp2_unit_with_split_trains_like_single_process(backends):
    assert run_ranks(_fsdp2_training, 2, backends, timeout=180) == [True, True]


def _state_dicts(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world_size)
    full = StateDictOptions(full_state_dict=True)

    def make(kind, seed, k=3):
        torch.manual_seed(seed)
        model = _Net()
        if kind.startswith("split"):
            apply_split(model.mlp, k, mesh)
        if kind.endswith("fsdp"):
            fully_shard(model.mlp, mesh=mesh, ignored_params=split_parameters(model.mlp))
            fully_shard(model, mesh=mesh)
        return model

    def assert_same(a, b, what):
        sa, sb = get_model_state_dict(a, options=full), get_model_state_dict(b, options=full)
        assert list(sa) == list(sb), what
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], atol=0, rtol=0, msg=f"{what}: {key}")

    plain = make("plain", 0)
    # Full state dict, both ways.
    sd = get_model_state_dict(make("split_fsdp", 0), options=full)
    assert list(sd) == list(plain.state_dict()) and not any(isinstance(v, DTensor) for v in sd.values())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(sd[key], value, atol=0, rtol=0)
    for target in ("split_fsdp", "split", "plain"):
        model = make(target, 1)
        set_model_state_dict(model, dict(sd), options=full)  # it replaces the dict's values by its own
        assert_same(model, plain, f"full state dict into {target}")
    other = make("plain", 1)
    other.load_state_dict(get_model_state_dict(make("split_fsdp", 0), options=full))
    assert_same(other, plain, "nn.Module.load_state_dict of a split model's full state dict")
    model = make("split", 1)
    model.load_state_dict(plain.state_dict())  # plain full weights: each rank keeps its rows
    assert_same(model, plain, "nn.Module.load_state_dict of an unsplit model's state dict into a split model")
    assert isinstance(make("split", 0).mlp[0].full_weight(), torch.Tensor)
    torch.testing.assert_close(make("split", 0).mlp[0].full_weight(), plain.mlp[0].weight, atol=0, rtol=0)

    # Sharded DCP: split (k=3) into unsplit (FSDP2 and plain) and split with another k; unsplit into split.
    sources = {"split_fsdp": make("split_fsdp", 0), "fsdp": make("fsdp", 0), "plain": plain}
    targets = {"split_fsdp": ("fsdp", "plain", "split"), "fsdp": ("split_fsdp",), "plain": ("split_fsdp",)}
    for source, model in sources.items():
        path = f"{directory}/{source}"
        dcp.save(get_model_state_dict(model), checkpoint_id=path)
        for target in targets[source]:
            loaded = make(target, 2, k=2)
            sd = get_model_state_dict(loaded)
            dcp.load(sd, checkpoint_id=path)
            set_model_state_dict(loaded, sd)
            assert_same(loaded, plain, f"DCP {source} -> {target}")
    return True


def _load_on_other_world_size(rank, world_size, directory):
    """Checkpoints saved on 2 ranks load into split models on ``world_size`` ranks (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    mesh = _mesh(world_size)
    torch.manual_seed(0)
    expected = _Net().state_dict()
    for source in ("split_fsdp", "plain"):
        model = _Net()
        apply_split(model.mlp, 3, mesh)
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=f"{directory}/{source}")
        set_model_state_dict(model, sd)
        loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key], value, atol=0, rtol=0, msg=f"{source} on {world_size} ranks: {key}")
    return True


def test_state_dict_round_trips_between_split_and_unsplit(tmp_path, backends):
    assert run_ranks(_state_dicts, 2, str(tmp_path), timeout=180) == [True, True]
    assert run_ranks(_load_on_other_world_size, 4, str(tmp_path), timeout=120) == [True] * 4


def _cuda_stream_path(rank, world_size, backends):
    """On GPUs with NCCL: the extension's stream path (and the PyTorch loop) equal nn.Linear."""
    from torch.distributed.device_mesh import DeviceMesh

    torch.cuda.set_device(rank)
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    torch.manual_seed(0)
    linear = nn.Linear(40, 72).cuda()
    xs = [torch.randn(3, 5, 40, device="cuda") for _ in range(world_size)]
    grads = [torch.randn(3, 5, 72, device="cuda") for _ in range(world_size)]
    y_ref, gx_ref, gw_ref, _ = _reference(linear, xs, grads, rank)
    for name in backends:
        split.set_backend(name)
        for k in (1, 3, 4):
            module = SplitLinear.from_linear(copy.deepcopy(linear), k, mesh)
            x = xs[rank].clone().requires_grad_()
            y = module(x)
            y.backward(grads[rank])
            torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)  # TF32 may be on
            torch.testing.assert_close(x.grad, gx_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(module.weight.grad.full_tensor(), gw_ref, atol=1e-4, rtol=1e-4)
        # bf16 compute (slices gathered in bf16), fp32 gradient reduction: equal to nn.Linear in bf16 on the same
        # bf16 inputs, up to the rounding of each output (against fp32 an element that cancels to near zero
        # differs by the inputs' rounding, ~1e-2 of the sum's terms: that says nothing about the op)
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        y16, gx16, gw16, _ = _reference(copy.deepcopy(linear).to(torch.bfloat16), [x.bfloat16() for x in xs],
                                        [g.bfloat16() for g in grads], rank)

        def close_to_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
            expected = expected.float()
            torch.testing.assert_close(actual.float(), expected, rtol=2**-7, atol=2**-8 * expected.abs().max().item())

        for k in (1, 4):
            module = SplitLinear.from_linear(copy.deepcopy(linear), k, mesh, mp_policy=bf16)
            x = xs[rank].clone().requires_grad_()
            y = module(x)
            y.backward(grads[rank].to(torch.bfloat16))
            assert y.dtype == torch.bfloat16 and module.weight.grad.dtype == torch.float32
            close_to_bf16(y, y16)
            close_to_bf16(x.grad, gx16)
            close_to_bf16(module.weight.grad.full_tensor(), gw16)
    split.set_backend("auto")
    return split.backend()


@pytest.mark.gpu
def test_cuda_stream_path_matches_linear(backends):
    world_size = min(torch.cuda.device_count(), 2)
    assert run_ranks(_cuda_stream_path, world_size, backends, timeout=240) == ["cuda" if "cpp" in backends else "python"] * world_size


# -- single process: the splitting rule and the backend switch -------------------------------------------


def test_stand_in_transport_matches_linear(backends):
    """The C++ loop with its collectives replaced by copies from and to host memory (how
    experiments/gpu_check.py measures overlap on one GPU) computes nn.Linear's forward and gradients,
    holds at most two gathered slices, and sends each slice's weight gradient to its host sink."""
    if "cpp" not in backends:
        pytest.skip("the C++ extension could not be built here (see the warning)")
    ext = split.build_extension()
    torch.manual_seed(0)
    for in_f, out_f, k in ((16, 96, 1), (16, 96, 4), (7, 13, 3), (6, 5, 8)):
        linear = nn.Linear(in_f, out_f, bias=False)
        w = linear.weight.detach()
        pieces = split_layout(out_f, 1, k)[1]
        rows = [sum(pieces[:i]) for i in range(len(pieces))]
        slices = [w[r : r + q].clone() for r, q in zip(rows, pieces)]
        sinks = [torch.full((q, in_f), float("nan")) for q in pieces]
        x = torch.randn(11, in_f, requires_grad=True)
        grad = torch.randn(11, out_f)
        y_ref = linear(x)
        y_ref.backward(grad)
        split.reset_peak_memory_stats()
        y = ext.stand_in_forward(x.detach(), w, slices, pieces)
        gathered_peak = ext.memory_stats()["peak_gathered_bytes"] - ext.memory_stats()["gathered_bytes"]
        gx, gw = ext.stand_in_backward(grad, x.detach(), w, slices, sinks, pieces)
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, linear.weight.grad)
        torch.testing.assert_close(torch.cat(sinks), linear.weight.grad)
        assert gathered_peak == min(len(pieces), 2) * max(pieces) * in_f * 4
    with pytest.raises(RuntimeError, match="one host tensor per slice"):
        ext.stand_in_forward(torch.randn(2, 16), torch.randn(96, 16), [torch.randn(48, 16)], [48, 48])
    with pytest.raises(RuntimeError, match=r"host tensor 1 must be \(48, 16\)"):
        ext.stand_in_forward(torch.randn(2, 16), torch.randn(96, 16), [torch.randn(48, 16), torch.randn(40, 16)], [48, 48])


def test_split_layout():
    assert split_layout(96, 2, 4) == (48, [12, 12, 12, 12])
    assert split_layout(13, 2, 3) == (7, [3, 2, 2])
    assert split_layout(5, 4, 8) == (2, [1, 1])  # fewer rows than slices: one row each
    for out, n, k in [(1, 1, 1), (5, 8, 2), (1000, 3, 7), (6144, 8, 8)]:
        rows, pieces = split_layout(out, n, k)
        assert rows * n >= out > (rows - 1) * n and sum(pieces) == rows and max(pieces) - min(pieces) <= 1
    with pytest.raises(ValueError):
        split_layout(8, 2, 0)


def test_splittable_linears_rule():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(64, 4)  # out_proj is a Linear subclass used through its weight
            self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
            self.small = nn.Linear(8, 8)
            self.child = nn.Sequential(nn.Linear(64, 256))  # a nested unit, excluded below
            self.tied_a, self.tied_b = nn.Linear(64, 128), nn.Linear(64, 128)
            self.tied_b.weight = self.tied_a.weight
            shared = nn.Linear(64, 128)
            self.shared = nn.ModuleList([shared, shared])

    block = Block()
    names = [n for n, _ in splittable_linears(block, exclude={block.child})]
    assert names == ["fc1", "fc2"]
    assert [n for n, _ in splittable_linears(block)] == ["fc1", "fc2", "child.0"]
    assert [n for n, _ in splittable_linears(block, min_numel=64)] == ["fc1", "fc2", "small", "child.0"]
    # a unit that is itself a Linear; a weight tied outside the unit is seen only with root=
    head = nn.Linear(64, 128)
    model = nn.ModuleDict({"emb": nn.Embedding(128, 64), "head": head})
    assert splittable_linears(head) == [("", head)]
    model["emb"].weight = head.weight
    assert splittable_linears(head, root=model) == []


def _apply_split_in_place(rank, world_size):
    mesh = _mesh(world_size)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128))
    linear, seen = model[1], []
    linear.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    assert apply_split(model[1], 1, mesh) == []  # k = 1: not split
    assert apply_split(model[1], 2, mesh, root=model) == [""]
    model(torch.randn(3, 64))
    # still a Linear to the user's code, as FSDP2's FSDPLinear is: optimizer groups and initialisations chosen by
    # module type (minGPT's configure_optimizers) find it under every plan; and the same module, with its hooks
    return (type(model[1]).__name__, model[1] is linear, isinstance(model[1], nn.Linear),
            (model[1].in_features, model[1].out_features), seen)


def test_apply_split_makes_the_linear_itself_a_split_linear_keeping_its_hooks():
    assert run_ranks(_apply_split_in_place, 1, timeout=60) == [("SplitLinear", True, True, (64, 128), [(3, 128)])]


def test_backend_switch_and_fallback(monkeypatch, backends):
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "python")
    assert split.backend() == "python"
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "auto")
    assert split.backend() == ("cpp" if "cpp" in backends else "python")
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "nonsense")
    with pytest.raises(ValueError):
        split.backend()
    # A failed build falls back to the PyTorch loop with a warning in "auto", and raises in "cpp".
    monkeypatch.setattr(_extension, "_ext", None)
    monkeypatch.setattr(_extension, "_error", None)
    monkeypatch.setattr(_build, "SOURCE_DIRS", (_build.SOURCE_DIRS[0].with_name("missing"),))
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "auto")
    with pytest.warns(UserWarning, match="extension unavailable .*sources .*reinstall osdp-torch"):
        assert split.backend() == "python"
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "cpp")
    with pytest.raises(split.ExtensionUnavailable, match="installed without them"):
        split.backend()
