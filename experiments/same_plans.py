"""The plans the installed osdp's search makes from a sweep's own inputs, to tell whether two commits plan alike.

    PYTHONPATH=OLD python experiments/same_plans.py PART/runs.json... > old.txt
    PYTHONPATH=NEW python experiments/same_plans.py PART/runs.json... > new.txt
    diff old.txt new.txt   # empty: the two commits make the same plans with the same predictions

For each sweep part (a ``runs.json`` of ``experiments/sweep.py``) and each budget OSDP ran at, the search
plans with the part's stored calibration and device (as measured in that run) and the model's analytic
descriptions at every unit granularity (the measured descriptions are not stored; analytic ones are the
same on every machine and commit), and prints a digest of the per-unit decisions, the predicted step and
peak and the granularity chosen. Used to merge sweep parts run at different commits honestly: the report
can say the parts' commits plan alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from osdp import models
from osdp.cost.terms import Calibration
from osdp.describe.analytic import describe_analytic
from osdp.machine.device_info import DeviceInfo
from osdp.models.data import synthetic_batch
from osdp.planner import describe_granularities, find_plan
from osdp.search import BudgetTooSmall


def plan_lines(runs_json: str) -> list[str]:
    lines = []
    for result in json.loads(Path(runs_json).read_text())["results"]:
        calibration = Calibration.from_dict(result["calibration"]["calibration"])
        device = DeviceInfo.from_dict(result["device_info"])
        at_budgets = [r for r in result["records"] if r["strategy"] == "osdp"]
        batch_size, seq_len = at_budgets[0]["batch_size"], at_budgets[0]["seq_len"]
        config = models.get_config(result["model"])
        model = models.build(config)
        batch = synthetic_batch(config, batch_size, seq_len)
        descriptions = describe_granularities(lambda **g: describe_analytic(
            model, batch, device, world_size=result["records"][0]["world_size"], batch_sizes=[batch_size],
            progress=False, **g))
        for record in at_budgets:
            where = f"{record['model']} {record['link']} {record['budget_bytes']}"
            try:
                plan = find_plan(descriptions, device, [batch_size], budget=record["budget_bytes"],
                              calibration=calibration, optimizer="adamw").plan
            except BudgetTooSmall as e:
                lines.append(f"{where} budget too small (needs {e.min_peak_bytes})")
                continue
            decisions = json.dumps([vars(u) for u in plan.units], sort_keys=True)
            lines.append(f"{where} {hashlib.sha1(decisions.encode()).hexdigest()[:10]} "
                         f"step {plan.predicted_step_s:.6e} s peak {plan.predicted_peak_bytes} "
                         f"{plan.meta.get('granularity', '')}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="runs.json of sweep parts")
    args = parser.parse_args()
    torch.manual_seed(0)
    for path in args.runs:
        for line in plan_lines(path):
            print(line, flush=True)


if __name__ == "__main__":
    main()
