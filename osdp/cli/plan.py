"""``osdp plan``: plan a model offline, for a device preset, without the hardware.

The model is a reference model (``--model gpt2-small``), a user's factory
(``--model my_pkg.models:build_model --input-spec "long[B,S] long[B,S]"``) or
a local Transformers config (``--hf-config path/to/config.json``); see
``osdp.describe.sources``. It is built on the meta device (no memory), described analytically
(FLOPs at the preset's rate, memory from a fake-tensor trace) and searched at
the given budget; the plan is printed unit by unit and can be written as JSON
for ``osdp train --plan`` or drawn as a throughput-vs-memory frontier. A job on
one node takes ``--world-size``; one on several, ``--nodes`` and
``--gpus-per-node`` with a multi-node preset, whose units may then be sharded
within their node (``zero3@node`` in the table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from osdp import models
from osdp.cost.schedule import predict
from osdp.describe.analytic import describe_analytic
from osdp.describe.sources import ModelSource, ModelSourceError, from_factory, from_hf_config, from_reference
from osdp.machine.device_info import DeviceInfo
from osdp.machine.presets import DEVICE_PRESETS, MultiNodePreset, device_preset, list_presets, multi_node_presets
from osdp.optim import OPTIMIZERS
from osdp.planner import describe_granularities, find_plan
from osdp.report import format_table
from osdp.schema.description import ModelDescription
from osdp.schema.plan import display_path
from osdp.search import BudgetTooSmall, format_frontier, plot_frontier
from osdp.sizes import format_bytes, parse_size

DEFAULT_BATCH_CANDIDATES = (1, 2, 4, 8)
DEFAULT_WORLD_SIZE = 8
DEFAULT_DEVICE, DEFAULT_MULTI_NODE_DEVICE = "h100-nvlink", "h100-nvlink-ndr400"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="osdp plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="reference model (--list-models), or a factory MODULE:FUNCTION (with --input-spec)")
    p.add_argument("--input-spec", help='the batch a factory\'s model takes: "long[B,S] long[B,S]" or '
                   '"input_ids=long[B,S] labels=long[B,S]" (B: micro-batch, S: --seq-len)')
    p.add_argument("--hf-config", help="a local Transformers config.json (or its folder) to plan instead of --model")
    p.add_argument("--world-size", type=int, help=f"ranks on one node (default {DEFAULT_WORLD_SIZE}); for several "
                   "nodes give --nodes and --gpus-per-node")
    p.add_argument("--nodes", type=int,
                   help="nodes of the job (a multi-node preset; world size = nodes x gpus per node)")
    p.add_argument("--gpus-per-node", type=int, help="ranks on each node (default: the preset's GPUs per node)")
    p.add_argument("--device-mem", help="memory budget per rank, e.g. 16GiB (default: the preset's memory)")
    p.add_argument("--device", help=f"device preset (--list-devices; default {DEFAULT_DEVICE}, or "
                   f"{DEFAULT_MULTI_NODE_DEVICE} with --nodes or --gpus-per-node)")
    p.add_argument("--batch-size", type=int, help=f"micro-batch per rank (default: search {DEFAULT_BATCH_CANDIDATES})")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--group-blocks", action="store_true",
                   help="also search plans gathering consecutive identical blocks as one FSDP2 unit")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--json", type=Path, help="write the Plan JSON here (with search_seconds)")
    p.add_argument("--frontier", type=Path, help="draw the throughput-vs-memory frontier to this PNG")
    p.add_argument("--list-models", action="store_true")
    p.add_argument("--list-devices", action="store_true")
    return p.parse_args(argv)


def list_devices() -> str:
    rows = []
    for name in list_presets():
        preset = DEVICE_PRESETS[name]
        if isinstance(preset, MultiNodePreset):
            ranks, node = f"nodes of <= {preset.gpus_per_node}", preset.node
        else:
            ranks, node = ("any" if preset.max_world_size is None else f"<= {preset.max_world_size}"), preset
        rows.append([name, format_bytes(node.memory_bytes), ranks, preset.description.split(";")[0][:90]])
    return format_table(rows, ["preset", "memory", "ranks", "notes"], "lrll")


def device_for(args: argparse.Namespace) -> DeviceInfo:
    """The preset at the job's layout: --world-size ranks on one node, or --nodes x --gpus-per-node.

    ValueError naming what would work where the flags disagree or the preset cannot hold the layout."""
    if args.nodes is None and args.gpus_per_node is None:
        args.device = args.device or DEFAULT_DEVICE
        return device_preset(args.device, args.world_size or DEFAULT_WORLD_SIZE)
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive number, got {value}")
    nodes = 1 if args.nodes is None else args.nodes
    args.device = args.device or DEFAULT_MULTI_NODE_DEVICE
    preset = DEVICE_PRESETS.get(args.device)
    if preset is None:
        return device_preset(args.device, nodes)  # raises, naming the known presets
    if not isinstance(preset, MultiNodePreset):
        raise ValueError(f"device '{args.device}' describes one level of links, not nodes joined by a network: "
                         f"for --nodes and --gpus-per-node use a multi-node preset "
                         f"({', '.join(multi_node_presets())}), or --world-size on one node")
    per_node = args.gpus_per_node or preset.gpus_per_node
    world_size = nodes * per_node
    if args.world_size is not None and args.world_size != world_size:
        raise ValueError(f"--world-size {args.world_size} disagrees with --nodes {nodes} x --gpus-per-node "
                         f"{per_node} = {world_size}: give --world-size {world_size}, or leave it out")
    return device_preset(args.device, world_size, ranks_per_node=per_node)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.list_models:
        print("\n".join(models.names()))
        return 0
    if args.list_devices:
        print(list_devices())
        return 0
    if bool(args.model) == bool(args.hf_config):
        print("osdp plan: give --model NAME (see --list-models), --model MODULE:FUNCTION with --input-spec, "
              "or --hf-config PATH", file=sys.stderr)
        return 2
    if args.device is not None and args.device not in DEVICE_PRESETS:
        print(f"osdp plan: unknown device '{args.device}'; use one of {', '.join(list_presets())}", file=sys.stderr)
        return 2
    try:
        device_info = device_for(args)
        budget = parse_size(args.device_mem) if args.device_mem else None
        source = model_source(args)
    except (ValueError, ModelSourceError) as e:
        print(f"osdp plan: {e}", file=sys.stderr)
        return 2
    budget = budget or device_info.memory_bytes
    seq_len = source.seq_len
    candidates = (args.batch_size,) if args.batch_size else DEFAULT_BATCH_CANDIDATES
    try:
        descriptions = describe_for(source, device_info, candidates, args.mixed_precision)
    except Exception as e:  # noqa: BLE001 - the model's own forward: say what to check
        print(f"osdp plan: {source.name}: its forward failed on the example batch ({type(e).__name__}: {e}); "
              "does the batch give every input the forward needs (--input-spec), and does it return a loss?",
              file=sys.stderr)
        return 2
    try:
        result = find_plan(descriptions, device_info, candidates, budget=budget, mixed_precision=args.mixed_precision,
                           optimizer=args.optimizer, model_signature=descriptions[0].signature,
                           group_blocks=args.group_blocks)
    except BudgetTooSmall as e:
        print(f"osdp plan: {e}", file=sys.stderr)
        return 1
    plan = result.plan
    prediction = predict(result.description, plan, device_info, optimizer=args.optimizer)
    described = [d.profile_seconds for d in descriptions if not d.from_cache]
    print(plan_report(args, device_info, plan, prediction, seq_len, described, result.search_seconds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(plan.to_json())
        print(f"plan written to {args.json}")
    if args.frontier:
        points = result.frontier()
        print(format_frontier(points, budget=budget, max_rows=15))
        plot_frontier(points, str(args.frontier), budget=budget,
                      title=f"{args.model or args.hf_config}, {layout(device_info)} {args.device} (analytic)")
        print(f"frontier drawn to {args.frontier}")
    return 0


def describe_for(source: ModelSource, device_info: DeviceInfo, batch_sizes: tuple[int, ...],
                 precision: str) -> list[ModelDescription]:
    """The model described analytically for the device, at every unit granularity the search chooses from."""
    return describe_granularities(lambda **g: describe_analytic(
        source.model, source.example(max(batch_sizes)), device_info, world_size=device_info.world_size,
        batch_sizes=batch_sizes, precisions=(precision,), progress=False, name=source.name, **g,
    ))


def model_source(args: argparse.Namespace) -> ModelSource:
    """The model to plan and its example batch: a reference model, a factory or a Transformers config."""
    if args.hf_config:
        return from_hf_config(args.hf_config, args.seq_len)
    if ":" in args.model:
        return from_factory(args.model, args.input_spec, args.seq_len)
    return from_reference(args.model, args.seq_len)


def layout(device_info: DeviceInfo) -> str:
    """'8 nodes x 8 ranks of' or '8 ranks of'."""
    t = device_info.topology
    return f"{device_info.world_size} ranks of" if t is None else f"{t.nodes} nodes x {t.ranks_per_node} ranks of"


def plan_report(args, device_info: DeviceInfo, plan, prediction, seq_len: int, described: list[float],
                search_s: float) -> str:
    """The plan's table and totals; ``described``: the seconds of each description made now (not cached)."""
    units = prediction.breakdown["units"]
    rows = []
    for u in plan.units:
        mode = u.mode + ("@node" if u.shard_scope == "node" else "")  # sharded within the node, as UnitPlan.label
        c = units.get(u.path)
        if c is None:  # a group's later unit: the group is priced as one, under its first unit
            rows.append([display_path(u.path), mode, u.split, u.checkpoint_policy, f"in {display_path(u.group)}",
                         "", ""])
            continue
        rows.append([display_path(u.path), mode, u.split, u.checkpoint_policy,
                     format_bytes(c["mem_bytes"]), format_bytes(c["transient_bytes"]), f"{c['time_s'] * 1e3:.2f}"])
    table = format_table(rows, ["unit", "mode", "split", "ckpt", "memory", "transient", "time ms"], "llrlrrr")
    tokens_per_s = plan.batch_size * seq_len / plan.predicted_step_s
    totals = [
        f"{plan.summary()}",
        f"model {args.model or args.hf_config}, {layout(device_info)} {args.device}, budget "
        f"{format_bytes(plan.meta['budget_bytes'])}, micro-batch {plan.batch_size} x {seq_len} tokens, "
        f"{plan.mixed_precision}, {plan.meta['granularity']} units",
        f"predicted: step {plan.predicted_step_s * 1e3:.1f} ms, peak {format_bytes(plan.predicted_peak_bytes)} per rank, "
        f"{tokens_per_s:,.0f} tokens/s per rank",
        f"calibration: {plan.meta.get('calibration')} (a preset is planned offline: no machine was calibrated; "
        "on the machine itself osdp.wrap and osdp train use its cached calibration, osdp calibrate)",
        (f"described in {sum(described):.1f} s (analytic)" if described else "described earlier (from the cache)")
        + f", searched in {search_s * 1e3:.1f} ms",
    ]
    return "\n".join([table, *totals])


if __name__ == "__main__":
    sys.exit(main())
