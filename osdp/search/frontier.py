"""The whole throughput-vs-memory Pareto frontier, from the same DP tables the solver uses.

A point is a plan that no other plan beats on both peak memory and
throughput. For one problem the frontier is what ``solve`` returns as the
budget grows; over several batch sizes it keeps, at each peak, the batch size
with the most samples/s.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from osdp.search.problem import Problem
from osdp.search.solver import DEFAULT_BUCKETS, _Tables, min_peak
from osdp.sizes import format_bytes

_TIE = 1e-12  # relative: sums of the same times in another order differ by float rounding, not by a better plan


class FrontierPoint(NamedTuple):
    peak_bytes: int  # exact, from the integer arrays
    step_time: float
    samples_per_s: float
    choice: np.ndarray  # [U] option index per unit
    batch_size: int


def _rate(batch_size: int, step_time: float) -> float:
    return batch_size / step_time if step_time > 0 else float("inf")


def _steps(final: np.ndarray) -> np.ndarray:
    """Levels where the least time strictly drops (the first finite level included)."""
    prev = np.r_[np.inf, final[:-1]]
    return np.flatnonzero(final < prev)


def _problem_frontier(p: Problem, max_peak: int | None, resolution: int | None, buckets: int) -> list[FrontierPoint]:
    need, fallback = min_peak(p)
    if max_peak is not None and max_peak < need:
        return []
    tab = _Tables(p, max_peak, resolution, buckets)
    U = p.num_units
    thresholds = tab.thresholds
    if max_peak is None:
        levels = np.full(len(thresholds), tab.level_cap)
    else:
        levels = tab.capacity(max_peak, thresholds)
    fits = levels >= 0
    thresholds, levels = thresholds[fits], levels[fits]

    t = p.step_time(fallback)
    candidates = [(need, t, _rate(p.batch_size, t), fallback)]
    full = tab.unrestricted(int(levels[0]) + 1)  # non-empty: max_peak >= the min peak
    buffer = np.empty_like(full.rows)
    # Pass 1: the envelope of (budget needed on the grid, least time) over thresholds, which is what
    # ``solve`` returns as the budget grows. Thresholds are computed by bisection: between two computed
    # ones, the larger one's table bounds every threshold in between from below (it admits more
    # options), so a threshold whose bound nowhere beats the envelope so far is never computed.
    env = np.empty((0, 4))  # rows: grid budget, time, threshold number, level
    finals, keeps = {}, {}

    def grid(i: int) -> np.ndarray:
        return tab.floor + int(thresholds[i]) + np.arange(int(levels[i]) + 1) * tab.res

    def beats_envelope(i: int, times: np.ndarray) -> bool:
        if not len(env):
            return True
        pos = np.searchsorted(env[:, 0], grid(i), side="right") - 1
        return bool((times < np.where(pos >= 0, env[np.maximum(pos, 0), 1], np.inf)).any())

    def compute(i: int) -> None:
        nonlocal env
        keep, T, L = keeps[i], int(thresholds[i]), int(levels[i])
        table = full if np.array_equal(keep, full.keep) else tab.restricted(full, T, keep, buffer)
        finals[i] = table.rows[U].copy()
        at = _steps(finals[i][: L + 1])
        new = np.stack([grid(i)[at], finals[i][at], np.full(len(at), i), at], axis=1)
        env = np.concatenate([env, new])
        env = env[np.lexsort((env[:, 1], env[:, 0]))]
        env = env[env[:, 1] < np.minimum.accumulate(np.r_[np.inf, env[:-1, 1]])]

    last = len(thresholds) - 1
    for i in sorted({0, last}):
        keeps[i] = tab.keep(int(thresholds[i]))
        compute(i)
    intervals = [(0, last)]
    while intervals:
        lo, hi = intervals.pop()
        bound = finals[hi]
        open_ = [i for i in range(lo + 1, hi) if beats_envelope(i, bound[: int(levels[i]) + 1])]
        if not open_:
            continue
        mid = open_[len(open_) // 2]
        keeps[mid] = tab.keep(int(thresholds[mid]))
        if np.array_equal(keeps[mid], keeps[lo]):
            intervals.append((mid, hi))  # (lo, mid] has lo's options with fewer bytes left: dominated
            continue
        compute(mid)
        intervals += [(lo, mid), (mid, hi)]
    # Pass 2: backtrack the envelope's levels of each threshold at once.
    for i in np.unique(env[:, 2]).astype(int).tolist():
        keep = keeps[i]
        table = full if np.array_equal(keep, full.keep) else tab.restricted(full, int(thresholds[i]), keep, buffer)
        choices = tab.choose(full, table, env[env[:, 2] == i, 3].astype(np.int64))
        rows = np.arange(U)
        times = p.time[rows, choices].sum(axis=1)
        peaks = p.base + p.mem[rows, choices].sum(axis=1) + p.transient[rows, choices].max(axis=1)
        candidates += [(pk, t, _rate(p.batch_size, t), c) for pk, t, c in zip(peaks.tolist(), times.tolist(), choices)]
    return [FrontierPoint(peak, t, sps, c, p.batch_size) for peak, t, sps, c in candidates]


def pareto_frontier(
    problems: Problem | Sequence[Problem],
    *,
    max_peak: int | None = None,
    resolution: int | None = None,
    buckets: int = DEFAULT_BUCKETS,
) -> list[FrontierPoint]:
    """Plans from the smallest possible peak up to ``max_peak`` (None: up to the fastest plan), by peak.

    Each point has strictly more samples/s than the one before (by more than
    float rounding). With one problem and ``max_peak`` = a budget (so the same
    grid as ``solve``), the best point whose peak fits that budget is
    ``solve``'s answer: exactly at exact resolution; with rounding, a point
    can need up to ``slack_bytes`` more budget than its peak for ``solve`` to
    find it.
    """
    if isinstance(problems, Problem):
        problems = [problems]
    points = [pt for p in problems for pt in _problem_frontier(p, max_peak, resolution, buckets)]
    points.sort(key=lambda pt: (pt.peak_bytes, -pt.samples_per_s))
    frontier: list[FrontierPoint] = []
    for pt in points:
        if not frontier or pt.samples_per_s > frontier[-1].samples_per_s * (1 + _TIE):
            frontier.append(pt)
    return frontier


def best_under(points: Sequence[FrontierPoint], budget: int) -> FrontierPoint | None:
    """The frontier's fastest point whose peak fits the budget."""
    fitting = [pt for pt in points if pt.peak_bytes <= budget]
    return fitting[-1] if fitting else None


def format_frontier(points: Sequence[FrontierPoint], *, budget: int | None = None, max_rows: int | None = 25) -> str:
    """A printable table; with ``max_rows`` evenly spaced rows (first, last and the budget's pick always shown)."""
    pick = best_under(points, budget) if budget is not None else None
    shown = range(len(points))
    if max_rows is not None and len(points) > max_rows:
        shown = sorted(set(np.linspace(0, len(points) - 1, max_rows).round().astype(int).tolist()))
        if pick is not None:
            shown = sorted(set(shown) | {next(i for i, pt in enumerate(points) if pt is pick)})
    lines = [f"{'peak':>12} {'step ms':>10} {'samples/s':>11} {'batch':>6}", "-" * 43]
    for i in shown:
        pt = points[i]
        mark = "  <- best within budget" if pt is pick else ""
        lines.append(
            f"{format_bytes(pt.peak_bytes):>12} {pt.step_time * 1e3:>10.3f} {pt.samples_per_s:>11.2f} "
            f"{pt.batch_size:>6}{mark}"
        )
    lines.append(f"{len(points)} frontier points" + (f", budget {format_bytes(budget)}" if budget is not None else ""))
    return "\n".join(lines)


def plot_frontier(
    points: Sequence[FrontierPoint], path: str, *, budget: int | None = None, title: str | None = None
) -> None:
    """Samples/s against peak memory as a step curve, one colour per batch size, the budget as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's global backend
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    gib = np.array([pt.peak_bytes for pt in points]) / 2**30
    sps = np.array([pt.samples_per_s for pt in points])
    ax.step(gib, sps, where="post", color="0.6", linewidth=1, zorder=1)
    for b in sorted({pt.batch_size for pt in points}):
        mine = np.array([pt.batch_size == b for pt in points])
        ax.scatter(gib[mine], sps[mine], s=10, label=f"micro-batch {b}", zorder=2)
    if budget is not None:
        ax.axvline(budget / 2**30, color="red", linestyle="--", linewidth=1, label=f"budget {format_bytes(budget)}")
        pick = best_under(points, budget)
        if pick is not None:
            ax.scatter([pick.peak_bytes / 2**30], [pick.samples_per_s], s=80, facecolors="none", edgecolors="red",
                       zorder=3)
    ax.set_xlabel("predicted peak memory per rank (GiB)")
    ax.set_ylabel("predicted samples/s per rank")
    ax.set_title(title or "OSDP throughput vs memory frontier")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
