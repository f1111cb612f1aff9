"""Exact search: a vectorised min-plus knapsack DP with the max-type transient handled exactly.

Minimise ``sum_u time[u, c_u]`` subject to
``base + sum_u mem[u, c_u] + max_u transient[u, c_u] <= budget``.

How:

* The max term is enumerated. For a threshold T (a distinct transient value),
  only options with transient <= T are admitted and the rest is an additive
  multiple-choice knapsack with capacity ``budget - base - T``. The optimum is
  the best over T. Within one T the transient no longer matters, so options
  dominated in (memory, time) are dropped before the DP.
* Work is shared across thresholds. Thresholds are visited from the largest
  down. The table of the last threshold computed admits a superset of the
  options of every smaller one, so its value at a smaller T's (larger)
  capacity is a lower bound for that T: a threshold whose bound cannot beat
  the best plan found costs one lookup. Units whose option set is already
  complete at T come first in the DP order, so a restricted DP resumes from
  the unrestricted table after that shared prefix.
* Memory is discretised conservatively: each unit's memory above its cheapest
  option is rounded *up* to the grid, the capacity *down*, so a plan the DP
  calls feasible is feasible in exact bytes. Rounding can cost optimality but
  by a bounded amount: the plan is at least as fast as the exact optimum under
  ``budget - slack_bytes`` (``slack_bytes`` < units x resolution, reported with
  every solution). When all offsets share a divisor that yields few enough
  buckets, that divisor is the resolution and the search is exact.
* Identical units (repeated blocks) share one row of preprocessing.
* The unconstrained optimum (every unit's fastest option) and the uniform
  plans (one option for all units: DDP, ZeRO-2, FSDP, ...) are checked in exact
  bytes too, so rounding never makes the search miss one that fits.

A unit's options with exactly equal time and memory are told apart by the
smaller transient, then the smaller option index, so results are deterministic.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass
from functools import reduce
from math import gcd
from typing import Sequence

import numpy as np

from osdp.search.problem import BudgetTooSmall, Problem
from osdp.search.relaxation import relaxation

DEFAULT_BUCKETS = 8192  # memory levels across the budget's discretionary range
MAX_CELLS = 1 << 27  # units x levels: keeps an over-fine explicit resolution from exhausting memory
_BIG = np.iinfo(np.int64).max


@dataclass
class Solution:
    """The chosen option per unit and what it costs, recomputed exactly from the problem's arrays."""

    choice: np.ndarray  # [U] option index per unit
    step_time: float  # seconds per step
    peak_bytes: int  # exact peak under the model
    batch_size: int
    budget: int
    min_peak_bytes: int  # smallest peak any plan can have at this batch size
    resolution: int  # bytes per DP memory level (1 or a common divisor = exact)
    levels: int  # DP grid size: memory levels searched
    slack_bytes: int  # rounding bound: step_time <= exact optimum at budget - slack_bytes
    search_seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_time if self.step_time > 0 else float("inf")


@dataclass
class Candidate:
    """One micro-batch size of a sweep: its solution, or None where nothing fits."""

    batch_size: int
    solution: Solution | None
    min_peak_bytes: int


@dataclass
class Sweep:
    """The batch size with the most samples/s, and what every candidate gave."""

    best: Solution
    candidates: list[Candidate]
    search_seconds: float
    best_index: int = 0  # the problem (and candidate) ``best`` solves


def min_peak(problem: Problem, lean: bool = False) -> tuple[int, np.ndarray]:
    """(smallest peak of any choice, a choice attaining it), exactly.

    ``min over T of T + base + sum_u min{mem[u, o] : transient[u, o] <= T}``,
    evaluated for every T at once by sweeping each unit's running minimum of
    memory over its options in transient order. Computed once per problem (every solve asks).
    Each unit takes its least memory under T, the fastest such option; ``lean``: the least transient such
    option (then the fastest). Both attain the bound; on the step's schedule, where the transients of units
    next to each other add up (a prefetch), the lean one may need less.
    """
    if problem._min_peak is None:
        problem._min_peak = _min_peak(problem)
    need, fastest, leanest = problem._min_peak
    return need, (leanest if lean else fastest).copy()


def _min_peak(problem: Problem) -> tuple[int, np.ndarray, np.ndarray]:
    rep, kind = problem.unit_types()
    ok, mem, tr, t = problem.allowed[rep], problem.mem[rep], problem.transient[rep], problem.time[rep]
    count = np.bincount(kind, minlength=len(rep))
    order = np.argsort(np.where(ok, tr, _BIG), axis=1, kind="stable")
    tr_sorted = np.take_along_axis(np.where(ok, tr, _BIG), order, axis=1)
    run_min = np.minimum.accumulate(np.take_along_axis(np.where(ok, mem, _BIG), order, axis=1), axis=1)
    step = np.diff(run_min, axis=1, prepend=0)  # changes of each unit's cheapest memory as T grows
    step = np.where(tr_sorted < _BIG, step, 0) * count[:, None]
    events = np.argsort(tr_sorted, axis=None, kind="stable")
    at = tr_sorted.reshape(-1)[events]
    total = np.cumsum(step.reshape(-1)[events])
    t_min = int(tr_sorted[:, 0].max())  # below this some unit has no admissible option
    last = np.r_[at[1:] != at[:-1], True] & (at >= t_min) & (at < _BIG)
    peaks = at[last] + total[last]
    best = int(np.argmin(peaks))
    threshold = int(at[last][best])
    # Per type: cheapest memory under the threshold, the fastest among equals; or the least transient among
    # equals, then the fastest
    admissible = ok & (tr <= threshold)
    cheapest = admissible & (mem == np.where(admissible, mem, _BIG).min(axis=1, keepdims=True))
    fastest = np.argmin(np.where(cheapest, t, np.inf), axis=1)
    lean = cheapest & (tr == np.where(cheapest, tr, _BIG).min(axis=1, keepdims=True))
    leanest = np.argmin(np.where(lean, t, np.inf), axis=1)
    return problem.base + int(peaks[best]), fastest[kind], leanest[kind]


def _auto_resolution(offsets: np.ndarray, room: int, buckets: int) -> int:
    """Bytes per level: a common divisor of all offsets if that gives few enough levels (exact), else room / buckets."""
    divisor = reduce(gcd, np.unique(offsets).tolist(), 0)
    if divisor and room // divisor < buckets:
        return divisor
    return max(1, -(-room // buckets))


@dataclass(eq=False)
class _Table:
    """DP rows for one threshold; units [0, j) in DP order are shared with the unrestricted table."""

    rows: np.ndarray  # [U + 1, levels]; rows[i][L] = least time of the first i units within L levels
    j: int
    opts: list
    keep: np.ndarray


class _Tables:
    """One problem's per-type option arrays at one memory resolution, and the DP over them."""

    def __init__(self, problem: Problem, limit: int | None, resolution: int | None, buckets: int):
        rep, kind = problem.unit_types()
        ok, t, mem, tr = problem.allowed[rep], problem.time[rep], problem.mem[rep], problem.transient[rep]
        mem_min = np.where(ok, mem, _BIG).min(axis=1)
        off = np.where(ok, mem - mem_min[:, None], 0)
        self.kind = kind
        self.floor = problem.base + int(mem_min[kind].sum())  # bytes every plan pays besides offsets and max transient
        self.t_min = int(np.where(ok, tr, _BIG).min(axis=1).max())
        span = int(off.max(axis=1)[kind].sum())
        room = span if limit is None else max(0, min(span, limit - self.floor - self.t_min))
        if resolution is None:
            resolution = _auto_resolution(off[ok], room, buckets)
        if resolution < 1:
            raise ValueError(f"resolution must be >= 1 byte, got {resolution}")
        self.res = int(resolution)
        levels = -(-off // self.res)
        self.slack = int((levels * self.res - off).max(axis=1)[kind].sum())
        self.level_cap = int(levels.max(axis=1)[kind].sum())  # every plan fits in this many levels
        cells = (len(kind) + 1) * (min(room // self.res, self.level_cap) + 1)
        if cells > MAX_CELLS:
            raise ValueError(
                f"resolution {self.res} bytes needs {cells} DP cells (limit {MAX_CELLS}); use a coarser resolution"
            )
        # Options per type sorted by (levels, time, transient, index): a candidate is kept at T iff it is
        # faster than every candidate before it, which is exactly "not dominated in (memory, time)".
        idx = np.broadcast_to(np.arange(ok.shape[1]), ok.shape)
        order = np.lexsort((idx, np.where(ok, tr, _BIG), np.where(ok, t, np.inf), np.where(ok, levels, _BIG)))
        self.order = order
        self.ok = np.take_along_axis(ok, order, axis=1)
        self.levels = np.take_along_axis(levels, order, axis=1)
        self.t = np.take_along_axis(np.where(ok, t, np.inf), order, axis=1)
        self.tr = np.take_along_axis(np.where(ok, tr, _BIG), order, axis=1)
        self.thresholds = np.unique(self.tr[self.ok])
        self.thresholds = self.thresholds[self.thresholds >= self.t_min]
        self.keep_all = self.keep(int(self.thresholds[-1]))
        # DP order: units whose option set is complete at a lower threshold come first, so a DP
        # restricted to T shares the unrestricted DP's prefix of units with tau <= T.
        tau = np.where(self.keep_all, self.tr, -1).max(axis=1)
        self.dp_order = np.argsort(tau[kind], kind="stable")
        self.dp_types = kind[self.dp_order]
        self.dp_tau = tau[self.dp_types]

    def keep(self, threshold: int) -> np.ndarray:
        """[types, options] in sorted order: admitted at this threshold and not dominated in (memory, time)."""
        t = np.where(self.ok & (self.tr <= threshold), self.t, np.inf)
        faster_before = np.minimum.accumulate(t, axis=1)
        faster_before = np.concatenate([np.full((t.shape[0], 1), np.inf), faster_before[:, :-1]], axis=1)
        return t < faster_before

    def options(self, keep: np.ndarray) -> list[tuple[list[int], list[float], np.ndarray, np.ndarray, np.ndarray]]:
        """Per type: kept options as lists for the DP loop and arrays for the trace (levels, time, index)."""
        out = []
        for q in range(keep.shape[0]):
            sel = keep[q]
            lv, tt, ix = self.levels[q, sel], self.t[q, sel], self.order[q, sel]
            out.append((lv.tolist(), tt.tolist(), lv, tt, ix))
        return out

    def split(self, threshold: int) -> int:
        """Number of leading units (DP order) whose option set at this threshold is their full one."""
        return int(np.searchsorted(self.dp_tau, threshold, side="right"))

    def run(self, rows: np.ndarray, types: np.ndarray, opts: list) -> None:
        """Fill rows[1:] from rows[0]: rows[i + 1][L] = least time of units so far within L levels.

        One vectorised min-plus step per (unit, option) over the whole memory axis.
        """
        n = rows.shape[1]
        for i, q in enumerate(types):
            lv, tt = opts[q][0], opts[q][1]
            prev, cur = rows[i], rows[i + 1]
            k = lv[0]
            cur[: min(k, n)] = np.inf
            if k < n:
                np.add(prev[: n - k], tt[0], out=cur[k:])
            for k, t in zip(lv[1:], tt[1:]):
                if k >= n:
                    break
                np.minimum(cur[k:], prev[: n - k] + t, out=cur[k:])

    def trace(self, rows: np.ndarray, types: np.ndarray, opts: list, at: np.ndarray, choice: np.ndarray) -> None:
        """Backtrack several levels at once through rows filled by ``run``; writes choice[:, i] (DP order)."""
        if len(at) == 1:  # the solver's one plan: scalar steps, several times faster than the vectorised ones
            at[0] = self.trace_one(rows, types, opts, int(at[0]), choice[0])
            return
        for i in range(len(types) - 1, -1, -1):
            lv, tt, ix = opts[types[i]][2:]
            src = at[:, None] - lv[None, :]
            cand = np.where(src >= 0, rows[i][np.maximum(src, 0)] + tt, np.inf)
            hit = cand == rows[i + 1][at][:, None]
            assert hit.any(axis=1).all(), "DP table and its trace disagree"
            o = np.argmax(hit, axis=1)
            choice[:, i] = ix[o]
            at -= lv[o]

    @staticmethod
    def trace_one(rows: np.ndarray, types: np.ndarray, opts: list, at: int, choice: np.ndarray) -> int:
        """``trace`` for one level, comparing the same sums: writes choice[i] and returns the level left."""
        for i in range(len(types) - 1, -1, -1):
            lv, tt, _, _, ix = opts[types[i]]
            prev, target = rows[i], rows[i + 1, at]
            o = next((o for o, k in enumerate(lv) if k <= at and prev[at - k] + tt[o] == target), None)
            assert o is not None, "DP table and its trace disagree"
            choice[i] = ix[o]
            at -= lv[o]
        return at

    def capacity(self, budget: int, thresholds: np.ndarray) -> np.ndarray:
        return np.minimum((budget - self.floor - thresholds) // self.res, self.level_cap)

    def unrestricted(self, levels: int) -> _Table:
        opts = self.options(self.keep_all)
        rows = np.empty((len(self.kind) + 1, levels))
        rows[0] = 0.0
        self.run(rows, self.dp_types, opts)
        return _Table(rows, len(self.kind), opts, self.keep_all)

    def restricted(self, full: _Table, threshold: int, keep: np.ndarray, rows: np.ndarray) -> _Table:
        """The table at a threshold, in ``rows`` (full's shape), resuming from full after the shared prefix."""
        j = self.split(threshold)
        opts = self.options(keep)
        rows[j] = full.rows[j]
        self.run(rows[j:], self.dp_types[j:], opts)
        return _Table(rows, j, opts, keep)

    def choose(self, full: _Table, table: _Table, levels: np.ndarray) -> np.ndarray:
        """[len(levels), U] option index per unit of the plans that ``table`` holds at these levels."""
        at = np.array(levels, dtype=np.int64)
        choice = np.empty((len(at), len(self.kind)), dtype=np.int64)
        j = table.j
        self.trace(table.rows[j:], self.dp_types[j:], table.opts, at, choice[:, j:])
        self.trace(full.rows[: j + 1], self.dp_types[:j], full.opts, at, choice[:, :j])
        out = np.empty_like(choice)
        out[:, self.dp_order] = choice
        return out


def _simple_choices(problem: Problem) -> list[np.ndarray]:
    """The fastest option for every unit, and every option taken by all units that allow it.

    Checked in exact bytes after the DP, so that grid rounding can never make the
    search miss the unconstrained optimum or a uniform plan (DDP, ZeRO-2, FSDP,
    each with or without checkpointing) that fits the budget.
    """
    ok = problem.allowed
    fastest = np.argmin(np.where(ok, problem.time, np.inf), axis=1)
    uniform = [np.full(problem.num_units, o) for o in range(problem.num_options) if ok[:, o].all()]
    return [fastest, *uniform]


def solve(
    problem: Problem, budget: int, *, resolution: int | None = None, buckets: int = DEFAULT_BUCKETS
) -> Solution:
    """The fastest choice whose peak fits ``budget`` bytes.

    The returned plan always fits in exact bytes. It is optimal when
    ``slack_bytes`` is 0 and otherwise at least as fast as the optimum under
    ``budget - slack_bytes``. ``resolution`` is bytes per DP memory level
    (None: a common divisor of the memory offsets when that gives fewer than
    ``buckets`` levels, which is exact, else the budget's discretionary range
    / ``buckets``; 1 is always exact). The default grid follows the budget,
    so to compare plans across budgets (monotone in the budget) or with
    ``pareto_frontier``, pass one explicit resolution. Raises
    ``BudgetTooSmall`` when no choice fits.
    """
    start = _time.perf_counter()
    budget = int(budget)
    need, fallback = min_peak(problem)
    if budget < need:
        raise BudgetTooSmall(budget, need, problem.batch_size)
    tab = _Tables(problem, budget, resolution, buckets)
    U = problem.num_units

    cand_t = tab.thresholds
    cand_l = tab.capacity(budget, cand_t)
    fits = cand_l >= 0
    cand_t, cand_l = cand_t[fits], cand_l[fits]
    last_of_level = np.r_[cand_l[1:] != cand_l[:-1], True]  # same capacity: the larger T admits more
    cand_t, cand_l = cand_t[last_of_level], cand_l[last_of_level]

    # Non-empty: the min-peak plan's threshold has a capacity >= 0.
    full = tab.unrestricted(int(cand_l[0]) + 1)
    bound, best, best_level, found = full, None, -1, np.inf
    spare: list[np.ndarray] = []  # row buffers of tables that are neither the bound nor the best

    def release(table: _Table | None) -> None:
        if table is not None and table is not full and table is not bound and table is not best:
            spare.append(table.rows)

    for T, L in zip(cand_t[::-1].tolist(), cand_l[::-1].tolist()):
        if bound.rows[U, L] >= found:
            continue
        keep = tab.keep(T)
        if not np.array_equal(keep, bound.keep):
            old, bound = bound, None
            release(old)
            bound = tab.restricted(full, T, keep, spare.pop() if spare else np.empty_like(full.rows))
        if bound.rows[U, L] < found:
            old, best, best_level, found = best, bound, L, bound.rows[U, L]
            release(old)
    # The DP's plan, or a simple plan checked in exact bytes where grid rounding hid it.
    candidates = [tab.choose(full, best, [best_level])[0]] if best is not None else []
    candidates += [c for c in _simple_choices(problem) if problem.peak(c) <= budget] + [fallback]
    choice = min(candidates, key=problem.step_time)  # min keeps the first of equals: the DP's
    step_time, peak = problem.step_time(choice), problem.peak(choice)
    assert peak <= budget, "conservative rounding violated"
    return Solution(
        choice=choice,
        step_time=step_time,
        peak_bytes=peak,
        batch_size=problem.batch_size,
        budget=budget,
        min_peak_bytes=need,
        resolution=tab.res,
        levels=full.rows.shape[1],
        slack_bytes=tab.slack,
        search_seconds=_time.perf_counter() - start,
    )


def sweep_batch_sizes(
    problems: Sequence[Problem], budget: int, *, resolution: int | None = None, buckets: int = DEFAULT_BUCKETS
) -> Sweep:
    """Solve each micro-batch size's problem and keep the one with the most samples/s.

    Throughput ``batch_size / step_time``, not step time, decides: a larger
    batch with a longer step can be the faster way through the data. Several
    problems may share a batch size (the same model with other options or
    prices); the first of equally fast ones is kept. Raises ``BudgetTooSmall``
    naming the batch size with the smallest need when no candidate fits.
    """
    if not problems:
        raise ValueError("no batch-size candidates to search")
    start = _time.perf_counter()
    candidates = []
    for p in problems:
        try:
            sol = solve(p, budget, resolution=resolution, buckets=buckets)
            candidates.append(Candidate(p.batch_size, sol, sol.min_peak_bytes))
        except BudgetTooSmall as e:
            candidates.append(Candidate(p.batch_size, None, e.min_peak_bytes))
    feasible = [i for i, c in enumerate(candidates) if c.solution is not None]
    if not feasible:
        smallest = min(candidates, key=lambda c: c.min_peak_bytes)
        raise BudgetTooSmall(budget, smallest.min_peak_bytes, smallest.batch_size)
    best = max(feasible, key=lambda i: candidates[i].solution.samples_per_s)
    return Sweep(best=candidates[best].solution, candidates=candidates,
                 search_seconds=_time.perf_counter() - start, best_index=best)


def best_of(problems: Sequence[Problem], budget: int, *, beat: float | None = None) -> tuple[int, Solution] | None:
    """(index, solution) of what ``sweep_batch_sizes(problems, budget)`` takes: the most samples/s, the first
    problem's of equally fast ones; None where nothing fits, or (given ``beat``) nothing is faster than ``beat``.

    Solves fewer problems (``osdp.search.relaxation``): none whose bound on samples/s cannot beat the best found
    (nor equal it from an earlier problem), and one whose fastest plan fits only where it wins, its samples/s
    known without solving. The answer is the sweep's exactly.
    """
    bounds = [relaxation(p) for p in problems]
    reach = [b.samples_per_s(budget) for b in bounds]
    # (samples/s, -index) orders candidates as the sweep does; the sentinel admits only those beating ``beat``
    best_key: tuple[float, float] = (-np.inf if beat is None else beat, np.inf)
    best: tuple[int, Solution | None] | None = None
    for i, b in enumerate(bounds):
        if b.fastest_peak <= budget and (reach[i], -i) > best_key:
            best_key, best = (reach[i], -i), (i, None)
    rest = [i for i, b in enumerate(bounds) if b.fastest_peak > budget and reach[i] > -np.inf]
    for i in sorted(rest, key=lambda i: (-reach[i], i)):  # the most promising first: the rest are skipped
        if (reach[i], -i) < best_key:
            continue
        try:
            solution = solve(problems[i], budget)
        except BudgetTooSmall:
            continue
        if (solution.samples_per_s, -i) > best_key:
            best_key, best = (solution.samples_per_s, -i), (i, solution)
    if best is None or best[1] is not None:
        return best
    solution = solve(problems[best[0]], budget)  # the winner whose fastest plan fits: its plan
    assert solution.samples_per_s == reach[best[0]], "the fastest plan fits, and the solver found a slower one"
    return best[0], solution
