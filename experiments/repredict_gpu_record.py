"""The GPU's measured peaks against this checkout's predictions, without a GPU.

    python experiments/repredict_gpu_record.py             # experiments/results/gpu/nvidia-h200.paper_config.json
    python experiments/repredict_gpu_record.py RECORD.json --out OUT.json

``experiments/gpu_paper_config.py`` records, for every plan it trained as rank 0 of 8 on one GPU, the whole
plan, the device it priced it on (the preset's collectives, the GPU's matmul workspaces) and the peak
``torch.cuda.max_memory_allocated`` measured. This prices each recorded plan again with the cost model as
it is now: the model described analytically on the meta device, as the record's run described it, so nothing
measured on the GPU enters a prediction; the measured peaks are the reference. A change to the cost model
is checked against the GPU's numbers this way between GPU loans, and the table says which cost model
(``osdp_commit``) priced it. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

EXPERIMENTS = Path(__file__).resolve().parent
ROOT = EXPERIMENTS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from osdp import models  # noqa: E402
from osdp.cost.schedule import predict  # noqa: E402
from osdp.describe.analytic import describe_analytic  # noqa: E402
from osdp.machine.device_info import DeviceInfo  # noqa: E402
from osdp.machine.identity import machine_info  # noqa: E402
from osdp.schema.plan import Plan  # noqa: E402

RECORD = EXPERIMENTS / "results" / "gpu" / "nvidia-h200.paper_config.json"


def repredict(record: dict) -> list[dict]:
    """Each recorded plan's measured peak beside the peak the current cost model predicts for it."""
    info = DeviceInfo.from_dict(record["device_info"])
    batch_sizes = sorted({r["batch_size"] for r in record["runs"] if "plan" in r})
    with torch.device("meta"):
        model = models.build(record["model"], seq_len=record["seq_len"])
    example = torch.zeros(max(batch_sizes), record["seq_len"], dtype=torch.long, device="meta")
    description = describe_analytic(model, (example, example), info, world_size=record["world_size"],
                                    batch_sizes=batch_sizes, precisions=(record["mixed_precision"],),
                                    progress=False, name=record["model"])
    rows = []
    for run in record["runs"]:
        if "plan" not in run:  # a budget no plan fitted
            continue
        prediction = predict(description, Plan.from_dict(run["plan"]), info)
        rows.append({
            "name": run["name"], "budget_bytes": run.get("budget_bytes"), "measured_peak_bytes": run["peak_bytes"],
            "recorded_prediction_bytes": run["predicted_peak_bytes"], "predicted_peak_bytes": prediction.peak_bytes,
            "error": (prediction.peak_bytes - run["peak_bytes"]) / run["peak_bytes"],
            "peak_moment": prediction.breakdown["peak_moment"],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record", type=Path, nargs="?", default=RECORD, help="a gpu_paper_config record")
    p.add_argument("--out", type=Path, default=None, help="default: the record's name, .repredicted.json")
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text())
    rows = repredict(record)
    errors = [abs(r["error"]) for r in rows]
    over = [r["name"] for r in rows if r["budget_bytes"] and r["measured_peak_bytes"] > r["budget_bytes"]]
    mib = 2**20
    print(f"{record['model']}, rank 0 of {record['world_size']}, measured on {record['machine'].get('cuda')} "
          f"({record['machine'].get('date')}): measured peaks against this checkout's predictions")
    print(f"{'plan':<14} {'measured MiB':>13} {'recorded pred':>14} {'predicted now':>14} {'error':>7}  peak moment")
    for r in rows:
        print(f"{r['name']:<14} {r['measured_peak_bytes'] / mib:>13,.1f} {r['recorded_prediction_bytes'] / mib:>14,.1f} "
              f"{r['predicted_peak_bytes'] / mib:>14,.1f} {r['error']:>+7.1%}  {r['peak_moment']}")
    print(f"error median {statistics.median(errors):.1%}, worst {max(errors):.1%}; measured over its budget: {over or 'none'}")
    out = args.out or args.record.with_name(args.record.name.replace(".json", ".repredicted.json"))
    out.write_text(json.dumps({
        "record": str(args.record.relative_to(ROOT) if args.record.is_relative_to(ROOT) else args.record),
        "machine": machine_info(torch.device("cpu")), "rows": rows,
        "error_median": statistics.median(errors), "error_worst": max(errors), "measured_over_budget": over,
    }, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
