"""The cost model: step time and peak memory per rank of any plan, and the search problem.

Every plan is costed unit by unit, with the same function behind ``predict``
and ``build_problem``, so the search is exact under this model:

    step_s = sum_u time[u, o_u]
    peak  ~= base + sum_u mem[u, o_u] + max_u transient[u, o_u]   (the search's additive bound)

and ``predict`` gives the peak over the step's schedule (``schedule_peak``), with
the plan's own neighbours (``plan_neighbours``); the planner re-prices the
search's candidates so (``osdp.planner.find_plan``).

The package, in the order a price is made: ``terms`` (the constants, the calibration's parameters, the
results), ``unit`` (one unit under one option), ``neighbours`` (the FSDP buffers a unit meets),
``context`` (what every unit is priced with), ``schedule`` (a plan's step and peak: ``predict``),
``problem`` (every unit under every option: the search's ``Problem``).
"""

from osdp._moved import old_names

__getattr__ = old_names(__name__)  # the previous release's names of this package (osdp._moved)
