"""osdp.describe.units: which modules are units at each granularity."""

from __future__ import annotations

import torch
import torch.nn as nn

import osdp
from osdp import models


def _paths(model: nn.Module, granularity: str) -> set[str]:
    return {u.path for u in osdp.discover_units(model, granularity=granularity)}


def test_whole_blocks_leave_a_small_embedding_with_the_root():
    model = models.build("gpt2-mini")
    blocks = {f"blocks.{i}" for i in range(4)}
    assert _paths(model, "sub-block") == {f"{b}.{part}" for b in blocks for part in ("attn", "mlp")} | {"wpe", ""}
    assert _paths(model, "block") == blocks | {""}  # wpe (128 x 256) is smaller than a block
    root = next(u for u in osdp.discover_units(model, granularity="block") if u.path == "")
    assert root.numel == sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))


class _BigHead(nn.Module):
    """Two blocks of two sub-blocks, a small embedding and an untied head larger than a block."""

    def __init__(self, d: int = 16, vocab: int = 1000):
        super().__init__()
        self.pos = nn.Embedding(4, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"a": nn.Sequential(nn.Linear(d, d)), "b": nn.Sequential(nn.Linear(d, d))})
            for _ in range(2))
        self.head = nn.Linear(d, vocab)


def test_leaves_as_large_as_a_block_stay_units_and_a_model_without_blocks_keeps_its_leaves():
    assert _paths(_BigHead(), "block") == {"blocks.0", "blocks.1", "head", ""}
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert _paths(mlp, "block") == _paths(mlp, "sub-block") == {"0", "2", ""}


def test_nested_units_are_whole_blocks_with_their_sub_blocks_and_a_block_keeps_only_what_they_do_not_hold():
    model = models.build("gpt2-mini")
    blocks = {f"blocks.{i}" for i in range(4)}
    assert _paths(model, "nested") == blocks | {f"{b}.{part}" for b in blocks for part in ("attn", "mlp")} | {""}
    units = {u.path: u for u in osdp.discover_units(model, granularity="nested")}
    assert units["blocks.0"].nested == ("blocks.0.attn", "blocks.0.mlp")
    assert units["blocks.0"].numel == sum(p.numel() for p in model.blocks[0].parameters()
                                          if p.dim() == 1 and not any(p is q for q in model.blocks[0].attn.parameters())
                                          and not any(p is q for q in model.blocks[0].mlp.parameters()))
    # a block whose sub-blocks hold everything is no unit of its own: the sub-blocks go straight to the root
    assert _paths(_BigHead(), "nested") == {"blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head", ""}


def test_a_parametrized_module_is_the_unit_not_its_parametrization():
    """weight_norm keeps a convolution's parameters in ``conv.parametrizations.weight`` (a module that computes
    the weight whenever the convolution's forward reads it): the convolution is the unit, as it is the module
    whose forward uses them."""
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(weight_norm(nn.Conv1d(4, 8, 3)), nn.ReLU(), weight_norm(nn.Linear(8, 8)), nn.Linear(8, 2))
    for granularity in ("sub-block", "block"):
        assert _paths(model, granularity) == {"0", "2", "3", ""}


class _PositionalConv(nn.Module):
    """wav2vec2's positional convolution: a weight_norm'd Conv1d and its activation, inside the encoder."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.conv = weight_norm(nn.Conv1d(16, 16, 3, padding=1), dim=2)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.conv(x))


def test_a_block_of_parametrized_modules_is_a_sub_block_like_any_other():
    """A parametrization is no child of the module's own: the block holding a parametrized Linear or convolution
    is the unit, with its parameters (each of these was a unit owning none, refused by every plan)."""
    from torch.nn.utils.parametrizations import spectral_norm

    encoder = nn.Sequential(_PositionalConv(), nn.Flatten(), nn.Linear(16 * 8, 4))
    blocks = nn.ModuleList([nn.Sequential(spectral_norm(nn.Linear(8, 16)), nn.ReLU(), spectral_norm(nn.Linear(16, 8)))
                            for _ in range(2)])
    for model, expected in ((encoder, {"0", "2", ""}), (_Blocks(blocks), {"layers.0", "layers.1", ""})):
        assert {u.path for u in osdp.discover_units(model)} == expected
        for granularity in ("sub-block", "block", "nested"):
            units = osdp.discover_units(model, granularity=granularity)
            assert all(u.numel > 0 and "parametrizations" not in u.path for u in units if u.path), granularity


class _Blocks(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class _LayerList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)])

    def forward(self, x):
        return x + sum(layer(x) for layer in self.layers)


def test_sub_blocks_held_by_a_container_are_the_blocks():
    """A ModuleList holds layers, it runs none of them: at "block" granularity each layer stays a unit. Where the
    example's forward ran none of them (LayerDrop's draw), they are the root's: no module the example never
    called is a unit."""
    from osdp.describe.units import trace_calls

    model = _LayerList()
    skipped_all = trace_calls(model, lambda: model.layers[0:0])
    for granularity in ("sub-block", "block"):
        assert _paths(model, granularity) == {"layers.0", "layers.1", "layers.2", ""}, granularity
        traced = trace_calls(model, lambda: model(torch.randn(2, 8)))
        assert {u.path for u in osdp.discover_units(model, traced, granularity)} == {
            "layers.0", "layers.1", "layers.2", ""}, granularity
        assert {u.path for u in osdp.discover_units(model, skipped_all, granularity)} == {""}, granularity


def test_a_module_the_forward_never_calls_is_no_unit():
    """An auxiliary head left off, a ParameterList read by its owner: the unit around it holds them."""
    from osdp.describe.units import trace_calls

    class WithAuxiliary(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.scales = nn.ParameterList([nn.Parameter(torch.ones(8)) for _ in range(2)])
            self.aux = nn.ModuleDict({"head": nn.Linear(8, 3), "proj": nn.Linear(8, 8)})

        def forward(self, x):
            return self.body(x) * self.scales[0] * self.scales[1]

    model = WithAuxiliary()
    traced = trace_calls(model, lambda: model(torch.randn(2, 8)))
    for granularity in ("sub-block", "block", "nested"):
        assert {u.path for u in osdp.discover_units(model, traced, granularity)} == {"body", ""}, granularity


def test_a_weight_read_through_data_outside_its_owner_is_a_use_there():
    """BYOL's momentum update, ``t.data.mul_(m).add_(o.data, alpha=1 - m)`` in the model's forward, reads the
    online encoder's weights where the online encoder is not running: were it a unit, FSDP2 would hand the
    update its shard. It is no unit of its own; the same read through the parameter itself (``o * 1``) was
    always one."""
    from osdp.describe.units import trace_calls

    class Momentum(nn.Module):
        def __init__(self, through_data: bool):
            super().__init__()
            self.through_data = through_data
            self.online = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.target = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.target.requires_grad_(False)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            with torch.no_grad():
                for t, o in zip(self.target.parameters(), self.online.parameters()):
                    t.data.mul_(0.9).add_(o.data if self.through_data else o * 1, alpha=0.1)
            return self.head(self.online(x) + self.target(x))

    for through_data in (True, False):
        model = Momentum(through_data)
        traced = trace_calls(model, lambda: model(torch.randn(2, 8)))
        used = {id(p) for p in model.online.parameters()}
        assert all(any(running[-1] == "" for running in traced.uses[key]) for key in used), through_data
        paths = {u.path for u in osdp.discover_units(model, traced, "block")}
        assert "online" not in paths and "head" in paths, (through_data, paths)


def test_a_module_called_through_a_method_is_no_unit_but_the_modules_it_runs_are():
    """A VAE's ``encode`` called by its owner: the VAE's forward never runs, so it is no unit (FSDP2 would not
    gather it), while the Linears ``encode`` calls run their own forwards and may be units."""
    from osdp.describe.units import trace_calls

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.mu, self.dec = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 8)

        def encode(self, x):
            return self.mu(torch.relu(self.enc(x)))

        def forward(self, x):  # never called here
            return self.dec(self.encode(x))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.vae, self.head = VAE(), nn.Linear(4, 8)

        def forward(self, x):
            z = self.vae.encode(x)
            return self.vae.dec(z) + self.head(z)

    model = Owner()
    traced = trace_calls(model, lambda: model(torch.randn(2, 8)))
    for granularity in ("sub-block", "block", "nested"):
        paths = {u.path for u in osdp.discover_units(model, traced, granularity)}
        assert "vae" not in paths and "" in paths, (granularity, paths)
