"""osdp.describe.recompute: a checkpointed unit recomputes its forward in backward, with gradients equal to the plain
module's, keeps its state-dict keys and type, survives a deep copy independently, and is undone exactly."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from osdp.describe.recompute import checkpoint_unit, is_checkpointed, undo_checkpoint


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
