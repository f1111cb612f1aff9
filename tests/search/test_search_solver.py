"""The search is exact: brute force on small instances, HiGHS on medium ones, and its frontier agrees with it."""

import itertools

import numpy as np
import pytest

from osdp.search import (
    BudgetTooSmall,
    Problem,
    best_under,
    format_frontier,
    min_peak,
    pareto_frontier,
    plot_frontier,
    solve,
    sweep_batch_sizes,
)
from osdp.search.reference import brute_force, brute_force_min_peak, solve_milp


def random_problem(rng, units, options, *, mem_scale=1, max_mem=40, max_tr=40, batch_size=1, p_allowed=0.7):
    """Integer bytes (times mem_scale), random times, random masks with at least one option per unit."""
    time = rng.random((units, options)) * 10
    mem = rng.integers(0, max_mem, (units, options)) * mem_scale
    tr = rng.integers(0, max_tr, (units, options)) * mem_scale
    allowed = rng.random((units, options)) < p_allowed
    allowed[np.arange(units), rng.integers(0, options, units)] = True
    return Problem(time, mem, tr, allowed, base=int(rng.integers(0, 5)) * mem_scale, batch_size=batch_size)


def assert_same_time(a, b):
    assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


def test_small_instances_equal_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = random_problem(rng, int(rng.integers(1, 7)), int(rng.integers(1, 7)))
        need = brute_force_min_peak(p)
        for budget in (need - 1, need, need + int(rng.integers(1, 60))):
            expected = brute_force(p, budget)
            if expected is None:
                with pytest.raises(BudgetTooSmall) as e:
                    solve(p, budget, resolution=1)
                assert e.value.min_peak_bytes == need
                continue
            for resolution in (1, None):  # None: the gcd of these small integers, also exact
                s = solve(p, budget, resolution=resolution)
                assert_same_time(s.step_time, expected[0])
                assert s.slack_bytes == 0
                assert s.peak_bytes == p.peak(s.choice) <= budget
                assert_same_time(s.step_time, p.step_time(s.choice))


def test_coarse_grid_is_conservative_and_within_its_slack():
    rng = np.random.default_rng(1)
    for _ in range(200):
        p = random_problem(rng, int(rng.integers(1, 7)), int(rng.integers(1, 7)), max_mem=3000, max_tr=3000)
        budget = brute_force_min_peak(p) + int(rng.integers(0, 6000))
        s = solve(p, budget, resolution=int(rng.integers(2, 700)))
        assert s.peak_bytes == p.peak(s.choice) <= budget
        assert s.step_time >= brute_force(p, budget)[0] - 1e-12
        tighter = brute_force(p, budget - s.slack_bytes)
        if tighter is not None:
            assert s.step_time <= tighter[0] + 1e-12


def test_coarse_grid_never_misses_a_uniform_plan_or_the_fastest_plan_that_fits():
    """At a budget exactly equal to a uniform plan's peak (DDP's budget in a sweep), rounding up onto a
    coarse grid would rule it out; the search still returns it, or something faster, in exact bytes."""
    rng = np.random.default_rng(7)
    for _ in range(100):
        units, options = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        p = random_problem(rng, units, options, max_mem=3001, max_tr=3001, p_allowed=1.0)
        fastest = np.argmin(p.time, axis=1)
        for choice in (fastest, *(np.full(units, o) for o in range(options))):
            budget = p.peak(choice)
            if budget < brute_force_min_peak(p):
                continue
            s = solve(p, budget, resolution=997)
            assert s.peak_bytes == p.peak(s.choice) <= budget
            assert s.step_time <= p.step_time(choice) + 1e-12
        s = solve(p, p.peak(fastest), resolution=997)
        assert_same_time(s.step_time, p.step_time(fastest))  # the unconstrained optimum, exactly


@pytest.mark.parametrize("units,seed", [(30, 0), (45, 1), (60, 2)])
def test_medium_instances_equal_milp(units, seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, units, 24, max_mem=1000, max_tr=3000, p_allowed=0.5)
    budget = min_peak(p)[0] + 6000
    s = solve(p, budget, resolution=1)
    milp_time, milp_choice = solve_milp(p, budget)
    assert p.peak(milp_choice) <= budget
    assert_same_time(s.step_time, milp_time)
    assert_same_time(s.step_time, p.step_time(milp_choice))
    assert s.peak_bytes <= budget


def test_discretised_medium_instance_within_bound_of_milp():
    rng = np.random.default_rng(3)
    # Bytes in 64 KiB steps keep HiGHS's tolerances far below one step; the DP's grid is 1 MiB.
    p = random_problem(rng, 40, 24, mem_scale=2**16, max_mem=3000, max_tr=8000, p_allowed=0.5)
    budget = min_peak(p)[0] + 300 * 2**20
    s = solve(p, budget, resolution=2**20)
    assert s.resolution == 2**20 and 0 < s.slack_bytes < 40 * 2**20
    assert s.peak_bytes == p.peak(s.choice) <= budget
    at_budget = solve_milp(p, budget)
    assert s.step_time >= at_budget[0] * (1 - 1e-9)
    with_slack = solve_milp(p, budget - s.slack_bytes)
    assert p.peak(with_slack[1]) <= budget - s.slack_bytes
    assert s.step_time <= with_slack[0] * (1 + 1e-9)


def test_more_budget_is_never_slower():
    rng = np.random.default_rng(4)
    p = random_problem(rng, 40, 24, max_mem=1000, max_tr=3000, p_allowed=0.5)
    need = min_peak(p)[0]
    times = [solve(p, need + extra, resolution=7).step_time for extra in range(0, 12000, 250)]
    assert all(b <= a for a, b in zip(times, times[1:]))
    assert times[-1] < times[0]


def test_budget_too_small_names_the_exact_minimum():
    rng = np.random.default_rng(5)
    for _ in range(100):
        p = random_problem(rng, int(rng.integers(1, 6)), int(rng.integers(1, 6)), batch_size=3)
        need = brute_force_min_peak(p)
        peak, choice = min_peak(p)
        assert peak == need == p.peak(choice)
        with pytest.raises(BudgetTooSmall) as e:
            solve(p, need - 1)
        assert isinstance(e.value, ValueError)
        assert (e.value.min_peak_bytes, e.value.batch_size, e.value.budget) == (need, 3, need - 1)
        assert solve(p, need).peak_bytes == need  # the minimum is attainable, whatever the grid
    big = Problem([[1.0]], [[5 * 2**30]], [[2**29]], base=2**28)
    with pytest.raises(BudgetTooSmall, match=r"5\.75 GiB.*micro-batch 1") as e:
        solve(big, 2**30)
    assert "1.00 GiB" in str(e.value)


def brute_force_frontier(p):
    choices = np.array(list(itertools.product(*[np.flatnonzero(r) for r in p.allowed])))
    rows = np.arange(p.num_units)
    times = p.time[rows, choices].sum(axis=1)
    peaks = p.base + p.mem[rows, choices].sum(axis=1) + p.transient[rows, choices].max(axis=1)
    out = []
    for i in np.lexsort((times, peaks)):
        if not out or times[i] < out[-1][1] * (1 - 1e-12):
            out.append((int(peaks[i]), float(times[i])))
    return out


def test_frontier_equals_brute_force_and_solve():
    rng = np.random.default_rng(6)
    for _ in range(100):
        p = random_problem(rng, int(rng.integers(1, 6)), int(rng.integers(1, 6)))
        points = pareto_frontier(p, resolution=1)
        expected = brute_force_frontier(p)
        assert [pt.peak_bytes for pt in points] == [e[0] for e in expected]
        for pt, (_, t) in zip(points, expected):
            assert_same_time(pt.step_time, t)
            assert pt.peak_bytes == p.peak(pt.choice)
            assert pt.samples_per_s == pytest.approx(1 / t)
        for budget in rng.integers(points[0].peak_bytes, points[-1].peak_bytes + 2, 10).tolist():
            assert_same_time(solve(p, budget, resolution=1).step_time, best_under(points, budget).step_time)


def test_frontier_of_medium_instance_is_pareto_and_matches_solve():
    rng = np.random.default_rng(7)
    p = random_problem(rng, 40, 24, max_mem=1000, max_tr=3000, p_allowed=0.5)
    need = min_peak(p)[0]
    points = pareto_frontier(p, max_peak=need + 8000, resolution=1)
    assert points[0].peak_bytes == need
    peaks = [pt.peak_bytes for pt in points]
    assert peaks == sorted(set(peaks)) and peaks[-1] <= need + 8000
    assert all(b.step_time < a.step_time for a, b in zip(points, points[1:]))
    for pt in points:
        assert pt.peak_bytes == p.peak(pt.choice)
        assert_same_time(pt.step_time, p.step_time(pt.choice))
    for budget in np.linspace(need, need + 8000, 25).astype(int).tolist():
        assert_same_time(solve(p, budget, resolution=1).step_time, best_under(points, budget).step_time)


def two_unit_problem(step_time, mem, batch_size):
    """Unit 0: a fast option and a small one; unit 1: fixed. Step time and memory scale the whole problem."""
    time = np.array([[0.5, 0.8], [0.5, 0.5]]) * step_time
    mem_ = np.array([[2, 1], [1, 1]]) * mem
    return Problem(time, mem_, np.zeros((2, 2), np.int64), batch_size=batch_size)


def test_sweep_keeps_the_most_samples_per_second():
    problems = [
        two_unit_problem(1.0, 100, batch_size=1),  # 1.0 s/step: 1 sample/s
        two_unit_problem(1.6, 200, batch_size=4),  # 1.6 s/step: 2.5 samples/s (slower step, more throughput)
        two_unit_problem(2.0, 400, batch_size=8),  # needs 800 bytes at least: does not fit
    ]
    sweep = sweep_batch_sizes(problems, budget=700)
    assert sweep.best.batch_size == 4 and sweep.best.samples_per_s == pytest.approx(2.5)
    by_batch = {c.batch_size: c for c in sweep.candidates}
    assert by_batch[1].solution.step_time == pytest.approx(1.0)
    assert by_batch[1].solution.step_time < sweep.best.step_time
    assert by_batch[8].solution is None and by_batch[8].min_peak_bytes == 800
    with pytest.raises(BudgetTooSmall, match="micro-batch 1") as e:
        sweep_batch_sizes(problems, budget=199)
    assert (e.value.min_peak_bytes, e.value.batch_size) == (200, 1)
    # The throughput frontier over batch sizes: every point beats the ones with less memory.
    points = pareto_frontier(problems)
    assert [(pt.peak_bytes, pt.batch_size) for pt in points] == [
        (200, 1), (300, 1), (400, 4), (600, 4), (800, 8), (1200, 8)
    ]
    assert best_under(points, 700).samples_per_s == pytest.approx(sweep.best.samples_per_s)



def test_best_of_takes_what_the_sweep_takes_solving_fewer_problems():
    """best_of skips problems that cannot win: the sweep's answer still, to the choice, with ties between equally
    fast problems going to the first, as in the sweep; and with ``beat``, only an answer faster than that."""
    from osdp.search.solver import best_of

    rng = np.random.default_rng(3)
    for _ in range(60):
        units, options = int(rng.integers(2, 7)), int(rng.integers(2, 5))
        problems = [random_problem(rng, units, options, max_mem=3000, max_tr=3000, batch_size=int(b))
                    for b in rng.choice([1, 2, 4, 8], size=int(rng.integers(1, 6)))]
        problems += problems[: int(rng.integers(0, 3))]  # the same problem twice: equally fast, the first wins
        for budget in np.linspace(min(min_peak(p)[0] for p in problems) - 1, 12000, 6).astype(int):
            try:
                sweep = sweep_batch_sizes(problems, int(budget))
            except BudgetTooSmall:
                assert best_of(problems, int(budget)) is None
                continue
            index, solution = best_of(problems, int(budget))
            assert index == sweep.best_index and np.array_equal(solution.choice, sweep.best.choice)
            speed = sweep.best.samples_per_s
            assert best_of(problems, int(budget), beat=speed) is None
            index, solution = best_of(problems, int(budget), beat=np.nextafter(speed, 0))
            assert index == sweep.best_index and np.array_equal(solution.choice, sweep.best.choice)


def test_the_relaxation_bounds_every_plan_that_fits():
    """No plan within a bound is faster than the relaxation says (so none fits where it says -inf), and where the
    fastest plan fits the solver's plan is exactly as fast."""
    from osdp.search.relaxation import relaxation

    rng = np.random.default_rng(4)
    tight = 0
    for _ in range(150):
        p = random_problem(rng, int(rng.integers(1, 6)), int(rng.integers(1, 6)), max_mem=3000, max_tr=3000,
                           batch_size=int(rng.choice([1, 4])))
        need = brute_force_min_peak(p)
        for budget in np.linspace(need - 500, need + 8000, 8).astype(int):
            reach = relaxation(p).samples_per_s(int(budget))
            best = brute_force(p, int(budget))
            if best is None:
                with pytest.raises(BudgetTooSmall):
                    solve(p, int(budget))
                continue
            assert reach >= p.batch_size / best[0]
            tight += reach <= p.batch_size / best[0] * (1 + 1e-6)
            if relaxation(p).fastest_peak <= budget:
                assert solve(p, int(budget)).samples_per_s == reach
    assert tight > 100  # mostly the optimum itself, not a loose bound


def test_one_plan_traced_alone_is_the_plan_traced_among_others():
    """The solver traces its one plan with scalar steps, the frontier many at once: the same plans."""
    from osdp.search.solver import DEFAULT_BUCKETS, _Tables

    rng = np.random.default_rng(5)
    for _ in range(40):
        p = random_problem(rng, int(rng.integers(2, 12)), int(rng.integers(2, 6)), max_mem=3000, max_tr=3000)
        p.time[:, 1:] = np.where(rng.random((p.num_units, p.num_options - 1)) < 0.3, p.time[:, :1], p.time[:, 1:])
        tab = _Tables(p, None, int(rng.integers(1, 300)), DEFAULT_BUCKETS)
        full = tab.unrestricted(tab.level_cap + 1)
        levels = np.arange(tab.level_cap + 1)
        together = tab.choose(full, full, levels)
        alone = np.stack([tab.choose(full, full, [level])[0] for level in levels])
        assert np.array_equal(together, alone)


def test_identical_units_share_work_and_keep_their_own_choices():
    rng = np.random.default_rng(8)
    block = random_problem(rng, 2, 6, max_mem=500, max_tr=800)
    reps = 24
    p = Problem(
        np.tile(block.time, (reps, 1)), np.tile(block.mem, (reps, 1)), np.tile(block.transient, (reps, 1)),
        np.tile(block.allowed, (reps, 1)),
    )
    grouped = Problem(p.time, p.mem, p.transient, p.allowed, group=np.tile([0, 1], reps))
    assert len(p.unit_types()[0]) == 2 == len(grouped.unit_types()[0])
    budget = min_peak(p)[0] + 2500
    s, g = solve(p, budget, resolution=1), solve(grouped, budget, resolution=1)
    assert_same_time(s.step_time, solve_milp(p, budget)[0])
    assert_same_time(s.step_time, g.step_time)
    assert len(set(s.choice[0::2].tolist())) > 1  # identical units are free to differ
    bad = Problem(p.time, p.mem, p.transient, p.allowed, group=np.zeros(2 * reps, int))
    with pytest.raises(ValueError, match="same group"):
        solve(bad, budget)

    # the types, as np.unique numbers them (the first unit of each, in the rows' lexicographic order)
    from osdp.search.problem import _distinct_rows

    rng = np.random.default_rng(9)
    for key in (np.tile([3, -1, 2], 5), rng.integers(-3, 3, (40, 4)), rng.integers(-2, 2, (30, 60)) << 62):
        _, rep, kind = np.unique(key, axis=0, return_index=True, return_inverse=True)
        assert all(np.array_equal(a, b) for a, b in zip(_distinct_rows(key), (rep, kind.reshape(-1))))


def test_problem_validation():
    with pytest.raises(TypeError, match="integer bytes"):
        Problem([[1.0]], [[1.5]], [[0]])
    with pytest.raises(ValueError, match="no allowed option"):
        Problem([[1.0, 2.0]], [[1, 2]], [[0, 0]], allowed=[[False, False]])
    with pytest.raises(ValueError, match="shape"):
        Problem([[1.0, 2.0]], [[1]], [[0, 0]])
    # Options not allowed may carry any junk: it never reaches the answer.
    p = Problem([[np.nan, 1.0]], [[-5, 3]], [[0, 2]], allowed=[[False, True]])
    assert solve(p, 5).choice.tolist() == [1]


def test_frontier_table_and_plot(tmp_path):
    rng = np.random.default_rng(9)
    problems = [random_problem(rng, 20, 12, mem_scale=2**20, max_mem=200, batch_size=b) for b in (1, 2)]
    budget = max(min_peak(p)[0] for p in problems) + 500 * 2**20
    points = pareto_frontier(problems, max_peak=budget)
    table = format_frontier(points, budget=budget, max_rows=10)
    assert "<- best within budget" in table and "MiB" in table and f"{len(points)} frontier points" in table
    path = tmp_path / "frontier.png"
    plot_frontier(points, str(path), budget=budget)
    assert path.stat().st_size > 1000
