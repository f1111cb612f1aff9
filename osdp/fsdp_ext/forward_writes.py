"""What a forward writes into parameters is the same on every rank: checked as the first backwards end.

A forward may write a parameter in place: ``F.embedding(..., max_norm=...)`` renormalizes the rows its batch looks
up, code clamps or normalizes a weight in its own forward, a momentum encoder moves towards another. Where every
rank writes the same values, every plan keeps them as one process would: a replicated unit's copies stay equal, a
sharded unit copies its shard of the written gathered parameter back (``_torch_private.fsdp_keep_forward_writes``).
Where the values come from each rank's own batch, the ranks' copies (or shards) come from different writes and
training goes on apart from one process's, without an error. Nothing marks such a write but its values, so the
first ``CHECKED_BACKWARDS`` backwards through the model's output end, on every rank alike, with one comparison over
the ranks: a checksum of every replicated parameter (``replicas.differing_replicas``) and of every sharded
parameter's gathered copy as a forward wrote it. A difference raises ``ReplicaDivergence`` on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from osdp._torch_private import output_tensors, queue_at_backward_end
from osdp.distributed import all_gather_objects
from osdp.fsdp_ext.replicas import ReplicaDivergence, checksum, differing_replicas
from osdp.report import first_few

CHECKED_BACKWARDS = 2  # the first step's, and one after an optimizer step has written every parameter


class ForwardWrites:
    """Records the writes a forward makes to sharded parameters (``record``: FSDP2's reshard is told of them) and
    compares them, with the replicated parameters, over the ranks as the first backwards end (``after_forward``: a
    forward hook of the ``fully_shard``-ed root, registered after FSDP2's and the reducer's)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.left = CHECKED_BACKWARDS
        self.written: dict[str, tuple[int, int]] = {}  # a sharded parameter's name: its written copy's checksum
        self._armed_in: int | None = None  # the backward (graph task) that will end with a check
        self._on = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"

    def record(self, name: str, gathered: torch.Tensor) -> None:
        # the first write a backward's check sees: later reshards copy back what the ranks then share (a zero3
        # unit's backward gathers the shards each rank wrote back)
        if self.left > 0 and self._on and name not in self.written:
            self.written[name] = tuple(checksum(gathered).tolist())

    @torch._dynamo.disable
    def after_forward(self, _module: nn.Module, _args, output):
        if self.left > 0 and self._on and torch.is_grad_enabled():
            grads_from = [t for t in output_tensors(output) if t.requires_grad]
            if grads_from:  # registered after FSDP2's and the reducer's: the check runs after their ends
                register_multi_grad_hook(grads_from, self._arm, mode="any")
        return output

    def _arm(self, *_) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._armed_in and self.left > 0:  # once per backward, however many forwards it goes through
            self._armed_in = task
            queue_at_backward_end(self._check)

    def _check(self) -> None:
        self.left -= 1
        written, self.written = self.written, {}
        reports = all_gather_objects((differing_replicas(self.model), written))
        names = {name for differing, _ in reports for name in differing}
        for name in {name for _, w in reports for name in w}:
            if len({w.get(name) for _, w in reports}) > 1:
                names.add(name)
        if names:
            raise ReplicaDivergence(differing_writes_message(sorted(names)))


def differing_writes_message(names: list[str]) -> str:
    return (f"{first_few(names, 6)}: after this backward, these parameters hold different values on different ranks, "
            "which one process training the whole batch would not: a forward wrote them in place from each rank's "
            "own batch (F.embedding(..., max_norm=...) renormalizes the rows its batch looks up; a statistic of "
            "the batch copied into a weight), or code changed them on some ranks only. Write parameters from what "
            "every rank shares (after optimizer.step(), or from an all-reduced statistic), keep per-batch state in "
            "buffers, and look up embeddings with max_norm=None (renormalize the table after each optimizer step "
            "if you need the bound)")
