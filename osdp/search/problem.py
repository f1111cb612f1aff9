"""The search problem as plain arrays, independent of torch and of the cost model.

U units each take one of O options (a table shared by all units; options that
make no sense for a unit are masked out). For a choice ``c`` (one option index
per unit)::

    step_time(c) = sum_u time[u, c_u]
    peak(c)      = base + sum_u mem[u, c_u] + max_u transient[u, c_u]

``mem`` is what a unit adds for the whole step (its parameters, gradients and
optimizer state as the mode keeps them, saved activations, zero2's held
parameters); ``transient`` is what exists only while the unit runs (the
gathered full parameters, plus whatever the cost model charges for the
prefetched neighbour), so only the largest one counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

from osdp.schema.plan import MODES, SPLIT_CHOICES, UnitPlan
from osdp.sizes import format_bytes


class Option(NamedTuple):
    """One way to run a unit: the fields of ``osdp.plan.UnitPlan`` but its path."""

    mode: str
    split: int = 1
    checkpoint: bool | str = False  # False (none), "selective" or True (full), as UnitPlan.checkpoint
    scope: str = "world"  # shard scope: over every rank, or within the node ("node")


class SubUnits(NamedTuple):
    """A unit run as units nested in it (``osdp.describe.granularity``): per part, its path relative to the unit
    ("" for the unit itself, which keeps what its parts do not hold) and the option it takes."""

    parts: tuple[tuple[str, Option], ...]

    def __str__(self) -> str:
        return " + ".join(f"{name or '(own)'}: {UnitPlan(name, *o).label}" for name, o in self.parts)


# How a unit's activations may be checkpointed: none, selective, full (osdp.schema.plan.CHECKPOINT_POLICIES).
CHECKPOINTS = (False, "selective", True)
# The standard option table: (mode, split, checkpoint), sharded over every rank. Only what a plan can say:
# splitting only exists for zero3, and selective checkpointing not with it (a split Linear's matmuls run
# inside one autograd function). A cost model masks what a given unit cannot take.
OPTIONS: tuple[Option, ...] = tuple(
    Option(mode, k, ckpt) for mode, k, ckpt in itertools.product(MODES, SPLIT_CHOICES, CHECKPOINTS)
    if k == 1 or (mode == "zero3" and ckpt != "selective")
)
# What a job spanning several nodes adds: units sharded within their node (zero2 and zero3, unsplit: a split
# Linear is sharded over every rank).
NODE_OPTIONS: tuple[Option, ...] = tuple(
    Option(mode, 1, ckpt, "node") for mode, ckpt in itertools.product(("zero2", "zero3"), CHECKPOINTS)
)


class BudgetTooSmall(ValueError):
    """No choice fits the budget; says the smallest budget at which one does."""

    def __init__(self, budget: int, min_peak_bytes: int, batch_size: int | None = None):
        self.budget = int(budget)
        self.min_peak_bytes = int(min_peak_bytes)
        self.batch_size = batch_size
        at = f" (at micro-batch {batch_size})" if batch_size is not None else ""
        super().__init__(
            f"memory budget {format_bytes(self.budget)} ({self.budget} bytes) is too small: the "
            f"smallest plan needs a peak of {format_bytes(self.min_peak_bytes)} "
            f"({self.min_peak_bytes} bytes){at}"
        )

    def __reduce__(self):  # keeps the fields when sent to other ranks
        return type(self), (self.budget, self.min_peak_bytes, self.batch_size)


def _distinct_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row of each distinct row, in lexicographic order; which of them each row is): what
    ``np.unique(key, axis=0, return_index=True, return_inverse=True)`` gives, a dozen times faster (one stable
    lexsort where np.unique sorts the rows as structured records)."""
    key = key.reshape(len(key), -1)
    order = np.lexsort(key.T[::-1])  # by the first column, then the next...; equal rows keep their order
    ordered = key[order]
    starts = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    kind = np.empty(len(key), dtype=np.int64)
    kind[order] = np.cumsum(starts) - 1
    return order[starts], kind


def _int_array(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "f":
        raise TypeError(f"{name} must hold integer bytes; round up first: np.ceil({name}).astype(np.int64)")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    return a.astype(np.int64, copy=False)


@dataclass(eq=False)
class Problem:
    """One search instance: costs of every (unit, option) at one micro-batch size.

    time:      [U, O] float, seconds per step
    mem:       [U, O] int, additive bytes
    transient: [U, O] int, bytes that exist only while the unit runs (max-type)
    allowed:   [U, O] bool, False for options a unit cannot take (None = all)
    base:      bytes present regardless of the choice (allocator margin, temporaries)
    batch_size: the micro-batch these costs are for (samples per step per rank)
    group:     [U] ids of identical units (repeated blocks); None = detected from the arrays
    units, options: optional labels (unit paths, option descriptions) for reports

    Treat the arrays as read-only once built: identical-unit detection and the least peak are cached.
    """

    time: np.ndarray
    mem: np.ndarray
    transient: np.ndarray
    allowed: np.ndarray | None = None
    base: int = 0
    batch_size: int = 1
    group: np.ndarray | None = None
    units: Sequence[str] | None = None
    options: Sequence[Any] | None = None
    _types: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)
    _min_peak: tuple[int, np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)  # solver.min_peak's
    _relaxation: Any = field(default=None, init=False, repr=False)  # relaxation.relaxation's

    def __post_init__(self) -> None:
        self.time = np.asarray(self.time, dtype=np.float64)
        if self.time.ndim != 2 or 0 in self.time.shape:
            raise ValueError(f"time must be a non-empty [units, options] array, got shape {self.time.shape}")
        shape = self.time.shape
        self.mem = _int_array("mem", self.mem, shape)
        self.transient = _int_array("transient", self.transient, shape)
        if self.allowed is None:
            self.allowed = np.ones(shape, dtype=bool)
        self.allowed = np.asarray(self.allowed, dtype=bool)
        if self.allowed.shape != shape:
            raise ValueError(f"allowed has shape {self.allowed.shape}, expected {shape}")
        stuck = np.flatnonzero(~self.allowed.any(axis=1))
        if stuck.size:
            raise ValueError(f"unit(s) {[self.unit_name(u) for u in stuck[:5]]} have no allowed option")
        if not np.isfinite(self.time[self.allowed]).all():
            raise ValueError("time must be finite for every allowed option")
        if (self.mem[self.allowed] < 0).any() or (self.transient[self.allowed] < 0).any():
            raise ValueError("mem and transient must be >= 0 bytes")
        self.base = int(self.base)
        if self.units is not None and len(self.units) != shape[0]:
            raise ValueError(f"{len(self.units)} unit names for {shape[0]} units")
        if self.options is not None and len(self.options) != shape[1]:
            raise ValueError(f"{len(self.options)} option labels for {shape[1]} options")
        if self.group is not None:
            self.group = np.asarray(self.group)
            if self.group.shape != (shape[0],):
                raise ValueError(f"group has shape {self.group.shape}, expected ({shape[0]},)")

    @property
    def num_units(self) -> int:
        return self.time.shape[0]

    @property
    def num_options(self) -> int:
        return self.time.shape[1]

    def unit_name(self, u: int) -> str:
        return str(self.units[u]) if self.units is not None else f"#{u}"

    def unit_types(self) -> tuple[np.ndarray, np.ndarray]:
        """(representative unit of each type, type of each unit): units with identical rows share a type.

        Per-unit preprocessing runs once per type, which is what makes 48 identical
        transformer blocks cost little more than one. ``group`` ids, when given, are
        checked: units in one group must have identical rows.
        """
        if self._types is None:
            ok = self.allowed
            cells = [np.where(ok, self.time, 0.0).view(np.int64), np.where(ok, self.mem, 0), np.where(ok, self.transient, 0)]
            rows = np.concatenate([ok.astype(np.int64), *cells], axis=1)
            key = self.group if self.group is not None else rows
            rep, kind = _distinct_rows(key)
            differs = (rows[rep[kind]] != rows).any(axis=1)
            if differs.any():
                bad = int(np.flatnonzero(differs)[0])
                raise ValueError(
                    f"unit {self.unit_name(bad)} is in the same group as unit "
                    f"{self.unit_name(int(rep[kind[bad]]))} but their costs differ"
                )
            self._types = (rep, kind)
        return self._types

    def _check_choice(self, choice: np.ndarray) -> np.ndarray:
        choice = np.asarray(choice, dtype=np.int64)
        if choice.shape != (self.num_units,):
            raise ValueError(f"choice has shape {choice.shape}, expected ({self.num_units},)")
        if not self.allowed[np.arange(self.num_units), choice].all():
            raise ValueError("choice takes an option that is not allowed")
        return choice

    def step_time(self, choice: np.ndarray) -> float:
        choice = self._check_choice(choice)
        return float(self.time[np.arange(self.num_units), choice].sum())

    def peak(self, choice: np.ndarray) -> int:
        """Exact peak bytes of a choice, in integers."""
        choice = self._check_choice(choice)
        rows = np.arange(self.num_units)
        return self.base + int(self.mem[rows, choice].sum()) + int(self.transient[rows, choice].max())
