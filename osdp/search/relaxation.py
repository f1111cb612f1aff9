"""What a problem's plans can reach within a memory bound, known without solving it: what lets a search over
several problems (``solver.best_of``) solve only those that can win.

* The fastest plan (every unit's fastest option, the first of equals, as ``solver._simple_choices`` takes it):
  where it fits the bound, the solver's plan is exactly as fast (``solve`` checks it in exact bytes and keeps
  the fastest candidate, and no plan is faster: a floating-point sum is monotone in its terms).
* Elsewhere, the linear relaxation of the knapsack: each unit's (memory, time) options on their lower convex
  hull, the memory beyond every unit's least bought where it saves the most time per byte, the last segment
  in part, within ``bound - base -`` the least transient any plan holds. No plan fitting the bound is faster.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from osdp.search.problem import Problem

# The relaxation's step time is a sum of a few hundred terms; lowered by this fraction of the largest it is a
# bound on the true one whatever the rounding (about 1e-14 of it).
_ROUNDING = 1e-9


@dataclass(frozen=True)
class Relaxation:
    """A problem's fastest plan and the hull segments of its linear relaxation, built once per problem."""

    batch_size: int
    fastest_peak: int  # exact peak of the fastest plan
    fastest_samples_per_s: float  # its samples/s: the most any plan reaches
    floor: int  # base + every unit's least memory + the least max transient: below this nothing fits
    least_mem_time: float  # step time with every unit at its least memory (the fastest of those)
    more_bytes: np.ndarray  # cumulative bytes of the hull segments, most time saved per byte first
    less_time: np.ndarray  # cumulative seconds those segments save
    per_byte: np.ndarray  # seconds each segment saves per byte

    def samples_per_s(self, bound: int) -> float:
        """Samples/s no plan whose peak is within ``bound`` exceeds, and that of the solver's plan where the
        fastest fits (-inf where nothing fits: a plan would need more than ``bound``)."""
        if self.fastest_peak <= bound:
            return self.fastest_samples_per_s
        room = bound - self.floor
        if room < 0:
            return -np.inf
        k = int(np.searchsorted(self.more_bytes, room, side="right"))  # segments bought whole
        saved = float(self.less_time[k - 1]) if k else 0.0
        if k < len(self.more_bytes):
            saved += (room - (int(self.more_bytes[k - 1]) if k else 0)) * float(self.per_byte[k])
        time = self.least_mem_time - saved - _ROUNDING * self.least_mem_time
        return min(self.fastest_samples_per_s, self.batch_size / time if time > 0 else np.inf)


def relaxation(problem: Problem) -> Relaxation:
    """``problem``'s Relaxation, built on first use and cached on the problem."""
    if problem._relaxation is None:
        problem._relaxation = _relax(problem)
    return problem._relaxation


def _relax(problem: Problem) -> Relaxation:
    fastest = np.argmin(np.where(problem.allowed, problem.time, np.inf), axis=1)
    step_time = problem.step_time(fastest)
    rep, kind = problem.unit_types()
    count = np.bincount(kind, minlength=len(rep))
    mem, time = _pareto(problem, rep)
    least_mem, least_mem_time, segments = 0, 0.0, []
    for q in range(len(rep)):
        hull = _lower_hull(mem[q], time[q])
        least_mem += int(count[q]) * hull[0][0]
        least_mem_time += float(count[q]) * hull[0][1]
        segments += [((t0 - t1) / (m1 - m0), int(count[q]) * (m1 - m0), float(count[q]) * (t0 - t1))
                     for (m0, t0), (m1, t1) in itertools.pairwise(hull)]
    segments.sort(key=lambda s: -s[0])
    least_transient = int(np.where(problem.allowed, problem.transient, np.iinfo(np.int64).max).min(axis=1).max())
    return Relaxation(
        batch_size=problem.batch_size,
        fastest_peak=problem.peak(fastest),
        fastest_samples_per_s=problem.batch_size / step_time if step_time > 0 else np.inf,
        floor=problem.base + least_mem + least_transient,
        least_mem_time=least_mem_time,
        more_bytes=np.cumsum([s[1] for s in segments], dtype=np.int64),
        less_time=np.cumsum([s[2] for s in segments], dtype=np.float64),
        per_byte=np.array([s[0] for s in segments], dtype=np.float64),
    )


def _pareto(problem: Problem, rep: np.ndarray) -> tuple[list[list[int]], list[list[float]]]:
    """Per unit type, its allowed options not dominated in (memory, time), by increasing memory."""
    ok = problem.allowed[rep]
    mem = np.where(ok, problem.mem[rep], np.iinfo(np.int64).max)
    time = np.where(ok, problem.time[rep], np.inf)
    order = np.lexsort((time, mem), axis=1)
    mem, time = np.take_along_axis(mem, order, axis=1), np.take_along_axis(time, order, axis=1)
    faster_before = np.concatenate([np.full((len(rep), 1), np.inf), np.minimum.accumulate(time, axis=1)[:, :-1]],
                                   axis=1)
    keep = time < faster_before
    return [m[k].tolist() for m, k in zip(mem, keep)], [t[k].tolist() for t, k in zip(time, keep)]


def _lower_hull(mem: list[int], time: list[float]) -> list[tuple[int, float]]:
    """The lower convex hull of Pareto points (memory increasing, time decreasing), from least memory."""
    hull: list[tuple[int, float]] = []
    for m, t in zip(mem, time):
        # drop the last point while it lies on or above the segment from the one before it to this one
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (m - hull[-2][0]) >= \
                (t - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((m, t))
    return hull
