"""Figures of a sweep (``sweep.py``): ``python experiments/plots.py experiments/results/sweep-quick``.

- ``throughput_<model>.png``: tokens/s per rank against the memory budget per
  rank, one line per strategy (OSDP, the six baselines of ``baselines.py``,
  OSDP's uniform plans thin and grey), one column per link; a baseline is
  drawn where its measured peak fits and marked with the budget it needs
  elsewhere; bars are the spread over repeats. Below: the measured peak
  memory of each point against the budget (the diagonal).
- ``memory_<model>.png``: the peak memory of each strategy broken down as
  ``osdp.machine.memory`` does (parameters, gradients, optimizer state, activations,
  gathered parameters, temporaries), rank 0, at the moment of the peak.
- ``predicted_vs_measured.png``: the cost model's tokens/s and peak against
  the measured ones, every run with a plan (OSDP and its uniform plans; the
  baselines are no plans and have no prediction).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

STYLE = {  # strategy -> (colour, marker, label)
    "torch-ddp": ("tab:blue", "s", "torch DDP"),
    "torch-ddp+ac": ("tab:cyan", "s", "torch DDP + AC"),
    "fsdp2": ("tab:red", "v", "FSDP2 per block"),
    "fsdp2+ac": ("tab:pink", "v", "FSDP2 + AC"),
    "fsdp2+sac": ("darkred", "<", "FSDP2 + selective AC (per op)"),
    "fsdp2+ac2": ("salmon", ">", "FSDP2 + AC of every 2nd block"),
    "torch-ddp+sac": ("navy", "p", "torch DDP + selective AC (per op)"),
    "fsdp2-zero2": ("tab:orange", "^", "FSDP2 ZeRO-2"),
    "fsdp2-zero2+ac": ("tab:olive", "^", "FSDP2 ZeRO-2 + AC"),
    "fsdp2-hsdp": ("tab:purple", "D", "FSDP2 HSDP per block"),
    "fsdp2-hsdp+ac": ("tab:gray", "D", "FSDP2 HSDP + AC"),
    "fairscale": ("tab:brown", "x", "fairscale FSDP"),
    "osdp-uniform-ddp": ("0.55", "1", "OSDP units, replicate all (ablation)"),
    "osdp-uniform-zero2": ("0.55", "2", "OSDP units, zero2 all (ablation)"),
    "osdp-uniform-fsdp": ("0.55", "3", "OSDP units, zero3 all (ablation)"),
    "osdp": ("tab:green", "o", "OSDP at the budget"),
}
BREAKDOWN = [  # (label, osdp.machine.memory categories)
    ("parameters", ("parameters",)),
    ("gradients", ("gradients",)),
    ("optimizer state", ("optimizer_state",)),
    ("activations", ("activations",)),
    ("gathered parameters", ("unsharded_parameters",)),
    ("temporaries", ("temporaries",)),
    ("batch, buffers", ("inputs", "buffers")),
]
BREAKDOWN_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#bbbbbb"]
MiB = 2**20


def _num(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def load_rows(folder: Path) -> list[dict[str, Any]]:
    with (folder / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("budget_bytes", "tokens_per_s", "peak_bytes", "predicted_tokens_per_s", "predicted_peak_bytes",
                  "needs_bytes", "tokens_per_s_min", "tokens_per_s_max", "replicated_fraction", "efficiency"):
            r[k] = _num(r.get(k, ""))
        r["fits"] = r["fits"] == "True"
    return rows


def plot_throughput(rows: list[dict[str, Any]], model: str, links: list[dict[str, Any]], path: Path,
                    note: str = "", ranks: str = "2 CPU ranks (gloo)") -> None:
    fig = Figure(figsize=(max(8.5, 6.2 * len(links)), 8.5), layout="constrained")  # one link: room for the titles
    axes = fig.subplots(2, len(links), sharex="col", squeeze=False, height_ratios=[3, 2])
    for col, link in enumerate(links):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["model"] == model and r["link"] == link["name"]]
        budgets = sorted({r["budget_bytes"] for r in mine})
        for strategy, (colour, marker, label) in STYLE.items():
            pts = sorted((r for r in mine if r["strategy"] == strategy), key=lambda r: r["budget_bytes"])
            if not pts:
                continue
            fit = [r for r in pts if r["fits"] and r["tokens_per_s"]]
            xs = [r["budget_bytes"] / MiB for r in fit]
            ys = [r["tokens_per_s"] for r in fit]
            err = [[r["tokens_per_s"] - r["tokens_per_s_min"] for r in fit],
                   [r["tokens_per_s_max"] - r["tokens_per_s"] for r in fit]]
            ablation = strategy.startswith("osdp-uniform")
            style = "-" if strategy == "osdp" else (":" if ablation else "--")
            top.errorbar(xs, ys, yerr=err, color=colour, marker=marker, linestyle=style, capsize=3, label=label,
                         linewidth=2.2 if strategy == "osdp" else (0.8 if ablation else 1.4), markersize=6)
            if strategy == "osdp":
                for r in fit:
                    top.annotate(f"{r['peak_bytes'] / MiB:.0f}", (r["budget_bytes"] / MiB, r["tokens_per_s"]),
                                 textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7, color=colour)
            needs = next((r["needs_bytes"] for r in pts if not r["fits"] and r["needs_bytes"]), None)
            if strategy != "osdp" and not ablation and needs and needs > budgets[0]:
                top.axvline(needs / MiB, color=colour, linestyle=":", linewidth=1)
                top.text(needs / MiB, 0.02, f" {strategy} needs {needs / MiB:.0f} MiB",
                         rotation=90, transform=top.get_xaxis_transform(), fontsize=7, color=colour, va="bottom")
            peaks = [(r["budget_bytes"] / MiB, r["peak_bytes"] / MiB) for r in fit if r["peak_bytes"]]
            if peaks and not ablation:
                bottom.plot(*zip(*peaks), color=colour, marker=marker, linestyle=style, label=label)
        lo, hi = budgets[0] / MiB, budgets[-1] / MiB
        bottom.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="budget")
        top.set_title(f"{model}, {ranks}\n{link.get('label', link['name'])}", fontsize=9)
        top.set_ylabel("tokens/s per rank (median; bars: spread over repeats)")
        top.set_ylim(bottom=0)
        top.grid(alpha=0.3)
        bottom.set_xlabel("memory budget per rank (MiB)")
        bottom.set_ylabel("measured peak memory per rank (MiB)")
        bottom.grid(alpha=0.3)
        if col == 0:
            top.legend(fontsize=8, loc="upper left")
            bottom.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Throughput vs memory budget: real runs; OSDP points labelled with their measured peak (MiB)"
                 + (f"\n{note}" if note else ""), fontsize=10)
    fig.savefig(path, dpi=110)


def plot_memory(results: list[dict[str, Any]], model: str, path: Path) -> None:
    result = next(r for r in results if r["model"] == model)  # memory does not depend on the link: the first one
    bars: list[tuple[str, dict[str, int], int | None]] = []
    for rec in result["records"]:
        m = rec.get("measured")
        if not m:
            continue
        bd = m["per_rank"][0]["peak_breakdown"] or {}
        if rec["strategy"] == "osdp":
            label = f"OSDP\n@{rec['budget_bytes'] / MiB:.0f}"
        else:
            label = rec["strategy"].replace("osdp-uniform-", "uniform\n").replace("+", "\n+")
        bars.append((label, bd, rec.get("budget_bytes")))
    fig = Figure(figsize=(max(6.0, 0.8 * len(bars) + 2), 5), layout="constrained")
    ax = fig.subplots()
    bottoms = [0.0] * len(bars)
    for (name, cats), colour in zip(BREAKDOWN, BREAKDOWN_COLOURS):
        vals = [sum(bd.get(c, 0) for c in cats) / MiB for _, bd, _ in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, color=colour, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, (_, _, budget) in enumerate(bars):
        if budget:
            ax.plot([i - 0.4, i + 0.4], [budget / MiB] * 2, color="black", linewidth=1.2)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("peak memory of rank 0 (MiB)")
    ax.set_title(f"{model}: peak memory by category (osdp.machine.memory, rank 0; black line: OSDP's budget)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)


def plot_predicted(results: list[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(11, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    markers = {}
    for result in results:
        link = result["link"]["name"]
        fill = "full" if link == "loopback" else "none"
        markers[link] = fill
        for rec in result["records"]:
            m = rec.get("measured")
            if not m or rec.get("predicted_tokens_per_s") is None:
                continue
            colour, marker, _ = STYLE.get(rec["strategy"], ("gray", "o", ""))
            kw = dict(color=colour, marker=marker, fillstyle=fill, linestyle="", markersize=7)
            left.plot(rec["predicted_tokens_per_s"], m["tokens_per_s"], **kw)
            right.plot(rec["predicted_peak_bytes"] / MiB, m["peak_bytes"] / MiB, **kw)
    for ax, what in ((left, "tokens/s per rank"), (right, "peak memory per rank (MiB)")):
        lo, hi = ax.get_xlim()
        lo2, hi2 = ax.get_ylim()
        a, b = min(lo, lo2), max(hi, hi2)
        ax.plot([a, b], [a, b], color="black", linewidth=0.8)
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
        ax.grid(alpha=0.3)
    for strategy, (colour, marker, label) in STYLE.items():
        if strategy == "osdp" or strategy.startswith("osdp-uniform"):
            left.plot([], [], color=colour, marker=marker, linestyle="", label=label)
    for link, fill in markers.items():
        left.plot([], [], color="gray", marker="o", fillstyle=fill, linestyle="", label=f"link: {link}")
    left.legend(fontsize=7)
    left.set_title("throughput: cost model vs real runs (runs with a plan)", fontsize=10)
    right.set_title("peak memory: cost model vs real runs (runs with a plan)", fontsize=10)
    fig.savefig(path, dpi=110)


def plot_all(folder: Path) -> list[Path]:
    folder = Path(folder)
    data = json.loads((folder / "runs.json").read_text())
    results = data["results"]
    rows = load_rows(folder)
    written = []
    for model in dict.fromkeys(r["model"] for r in results):
        links = [r["link"] for r in results if r["model"] == model]
        load = "; ".join(f"{p['link']}: load {p['load_before'][0]:.1f}"
                         for p in data["meta"].get("parts", []) if p["model"] == model)
        p = folder / f"throughput_{model}.png"
        plot_throughput(rows, model, links, p, note=f"{data['meta']['date']}, 1-min load average at start: {load}")
        written.append(p)
        p = folder / f"memory_{model}.png"
        plot_memory(results, model, p)
        written.append(p)
    p = folder / "predicted_vs_measured.png"
    plot_predicted(results, p)
    written.append(p)
    return written


if __name__ == "__main__":
    for path in plot_all(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "sweep-quick")):
        print(path)
