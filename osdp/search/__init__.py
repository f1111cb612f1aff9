"""Search: the fastest per-unit plan under a memory budget, exactly, in milliseconds."""

from osdp.search.frontier import FrontierPoint, best_under, format_frontier, pareto_frontier, plot_frontier
from osdp.search.problem import NODE_OPTIONS, OPTIONS, BudgetTooSmall, Option, Problem, SubUnits
from osdp.search.solver import Candidate, Solution, Sweep, min_peak, solve, sweep_batch_sizes

__all__ = [
    "NODE_OPTIONS",
    "OPTIONS",
    "BudgetTooSmall",
    "Candidate",
    "FrontierPoint",
    "Option",
    "Problem",
    "Solution",
    "SubUnits",
    "Sweep",
    "best_under",
    "format_frontier",
    "min_peak",
    "pareto_frontier",
    "plot_frontier",
    "solve",
    "sweep_batch_sizes",
]
