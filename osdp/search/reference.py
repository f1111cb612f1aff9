"""Independent solvers that the tests hold the DP to: brute force and a MILP (HiGHS).

Both answer the same question as ``solve``, in exact bytes, with no
discretisation: they are slow and only for checking.
"""

from __future__ import annotations

import itertools

import numpy as np

from osdp.search.problem import Problem


def brute_force(problem: Problem, budget: int) -> tuple[float, np.ndarray] | None:
    """(least step time, a choice attaining it) over every choice that fits, or None if none fits."""
    per_unit = [np.flatnonzero(row) for row in problem.allowed]
    choices = np.array(list(itertools.product(*per_unit)), dtype=np.int64)
    rows = np.arange(problem.num_units)
    times = problem.time[rows, choices].sum(axis=1)
    peaks = problem.base + problem.mem[rows, choices].sum(axis=1) + problem.transient[rows, choices].max(axis=1)
    fits = peaks <= budget
    if not fits.any():
        return None
    best = np.flatnonzero(fits)[np.argmin(times[fits])]
    return float(times[best]), choices[best]


def brute_force_min_peak(problem: Problem) -> int:
    per_unit = [np.flatnonzero(row) for row in problem.allowed]
    choices = np.array(list(itertools.product(*per_unit)), dtype=np.int64)
    rows = np.arange(problem.num_units)
    peaks = problem.base + problem.mem[rows, choices].sum(axis=1) + problem.transient[rows, choices].max(axis=1)
    return int(peaks.min())


def solve_milp(problem: Problem, budget: int, *, time_limit: float = 60.0) -> tuple[float, np.ndarray] | None:
    """The same problem as a MILP solved by HiGHS (scipy.optimize.milp), or None if infeasible.

    Binary x[u, o] picks option o for unit u (one per unit); the max term is an
    auxiliary continuous M with M >= sum_o transient[u, o] x[u, o] for every
    unit, and sum mem x + M <= budget - base. Bytes are scaled by the budget to
    keep HiGHS's absolute tolerances meaningful; the answer's choice is
    returned so callers can check it in exact integers.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    U, O = problem.time.shape
    cells = np.argwhere(problem.allowed)  # (unit, option) of every variable
    nx = len(cells)
    scale = float(max(budget, 1))
    cost = np.r_[problem.time[cells[:, 0], cells[:, 1]], 0.0]
    mem = problem.mem[cells[:, 0], cells[:, 1]] / scale
    tr = problem.transient[cells[:, 0], cells[:, 1]] / scale

    one = np.zeros((U, nx + 1))
    one[cells[:, 0], np.arange(nx)] = 1.0
    top = np.zeros((U, nx + 1))  # sum_o tr x - M <= 0
    top[cells[:, 0], np.arange(nx)] = tr
    top[:, nx] = -1.0
    room = np.r_[mem, 1.0][None, :]  # sum mem x + M <= (budget - base) / scale
    constraints = [
        LinearConstraint(one, 1.0, 1.0),
        LinearConstraint(top, -np.inf, 0.0),
        LinearConstraint(room, -np.inf, (budget - problem.base) / scale),
    ]
    integrality = np.r_[np.ones(nx), 0.0]
    bounds = Bounds(np.zeros(nx + 1), np.r_[np.ones(nx), np.inf])
    res = milp(
        cost, constraints=constraints, integrality=integrality, bounds=bounds,
        options={"mip_rel_gap": 1e-12, "time_limit": time_limit},
    )
    if res.status == 2:  # infeasible
        return None
    if res.x is None:
        raise RuntimeError(f"HiGHS did not solve the problem: {res.message}")
    x = res.x[:nx] > 0.5
    choice = np.empty(U, dtype=np.int64)
    choice[cells[x, 0]] = cells[x, 1]
    return float(res.fun), choice
