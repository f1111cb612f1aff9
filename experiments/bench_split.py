"""Split vs unsplit sharded Linear: step time and peak gathered weight, side by side in one run.

Models: a Linear 4096 -> 16384, and the MLP of the 48-layer hidden-1536 GPT
(1536 -> 6144 -> GELU -> 1536). Strategies, each on the same 1-D mesh:

* zero3: FSDP2 ``fully_shard`` of the model (reshard after forward);
* split k (k = 1, 2, 4, 8): ``apply_split`` then ``fully_shard(..., ignored_params=split_parameters(...))``,
  as the apply code does, so FSDP2 manages the biases.

A step is forward, backward (input gradient included) and an SGD step. The
strategies' steps run in turn, round after round, so that other load on the
machine slows them alike; a time is the slowest rank's; "vs zero3" is the
median over rounds of the ratio to zero3's step in the same round, "min vs"
the ratio of the fastest steps; the JSON records the load average. Peak gathered weight is
measured the same way for every strategy, from the operator stream: the live
bytes of storages that all-gathers write (and FSDP2 copies them into, its
unsharded parameters), sampled at every op of one extra step. For split, the
op's own counters (``osdp.split.memory_stats``) are reported too.

Overlap: for every k, forward only, the time of the k gathers alone, of the k
matmuls alone, and of the split forward; hidden = (gather + compute - split) /
gather, the fraction of all-gather time hidden behind the matmuls. Timed with
CUDA events on a GPU, wall clock on CPU.

Run (2 local CPU ranks, one thread each; spawns its own ranks):
    python experiments/bench_split.py
or, e.g. on GPUs: torchrun --nproc-per-node 2 experiments/bench_split.py
Writes experiments/results/bench_split.json (machine, torch version, all numbers).

On one GPU there is no second rank to gather from: ``stand_in_overlap`` (run by
experiments/gpu_check.py) drives the op's C++ stream path with a stand-in for
its collectives, copies between pinned host memory and the GPU (``StandInSplit``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

import osdp.split as split
from osdp._torch_private import TorchDispatchMode
from osdp.distributed.local_ranks import run_local_ranks
from osdp.machine.identity import machine_info
from osdp.machine.timing import StepTimer

MODELS = {  # (in, out) of each Linear, GELU between
    "linear_4096x16384": [(4096, 16384)],
    "gpt_mlp_1536": [(1536, 6144), (6144, 1536)],
}
RESULTS = Path(__file__).resolve().parent / "results" / "bench_split.json"


class GatheredBytes(TorchDispatchMode):
    """Peak live bytes of all-gather outputs and FSDP2's copies of them, sampled at every op."""

    def __init__(self) -> None:
        super().__init__()
        self.storages = WeakIdKeyDictionary()  # by identity: FSDP2 re-grows the same storage at a new address
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.c10d._allgather_base_.default:
            self._watch(args[0])
        elif func is torch.ops.fsdp.split_with_sizes_copy.default:
            for t in kwargs["out"]:
                self._watch(t)
        # FSDP2 frees unsharded parameters by resizing their storage to 0, so read sizes now.
        live = sum(s.nbytes() for s in self.storages.keys())
        self.peak = max(self.peak, live)
        return out

    def _watch(self, t: torch.Tensor) -> None:
        self.storages[t.untyped_storage()] = None


def slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def build(model_name: str, strategy: str, k: int, mesh) -> nn.Module:
    """The unit under a parameterless root, so that FSDP2 reshards it after forward (it keeps the root's)."""
    torch.manual_seed(0)
    layers = []
    for in_f, out_f in MODELS[model_name]:
        layers += [nn.Linear(in_f, out_f), nn.GELU()]
    unit = nn.Sequential(*layers[:-1])
    if strategy == "split":  # (apply_split leaves k = 1 alone; here k = 1 is the op with a single slice)
        for name, linear in split.splittable_linears(unit):
            setattr(unit, name, split.SplitLinear.from_linear(linear, k, mesh))
    fully_shard(unit, mesh=mesh, ignored_params=split.split_parameters(unit))
    return fully_shard(nn.Sequential(unit), mesh=mesh)


def interleaved(fns: dict, args, device) -> dict[str, list[float]]:
    """Each function once per round, in turn, so that other load on the machine slows all alike;
    per function, the slowest rank's time in every round after warm-up."""
    times = {name: [] for name in fns}
    for i in range(args.warmup + args.steps):
        for name, fn in fns.items():
            dist.barrier()
            with StepTimer(device) as timer:
                fn()
            elapsed = slowest(timer.seconds, device)
            if i >= args.warmup:
                times[name].append(elapsed)
    return times


def training_step(model, model_name, tokens, device):
    in_f, out_f = MODELS[model_name][0][0], MODELS[model_name][-1][1]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(tokens, in_f, device=device, requires_grad=True)
    grad = torch.randn(tokens, out_f, device=device)

    def step():
        model(x).backward(grad)
        opt.step()
        opt.zero_grad()

    return step


def overlap_probes(model, tokens, device) -> dict:
    """Forward of the unit's first SplitLinear: its gathers alone, its matmuls alone, and the split op."""
    layer = next(m for m in model.modules() if isinstance(m, split.SplitLinear))
    group = layer.weight.device_mesh.get_group()
    n, w = group.size(), layer.weight.to_local().detach()
    pieces, offsets = layer.piece_sizes, [sum(layer.piece_sizes[:i]) for i in range(len(layer.piece_sizes))]
    padded = torch.zeros(layer.rows_per_rank, layer.in_features, device=device)
    padded[: w.shape[0]] = w
    slices = [torch.empty(n * q, layer.in_features, device=device) for q in pieces]
    x = torch.randn(tokens, layer.in_features, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather():
        for s, off, q in zip(slices, offsets, pieces):
            all_gather(s, padded[off : off + q], group=group)

    def compute():
        out = torch.empty(tokens, n, layer.rows_per_rank, device=device)
        for s, off, q in zip(slices, offsets, pieces):
            out[:, :, off : off + q] = torch.mm(x, s.t()).view(tokens, n, q)

    @torch.no_grad()
    def split_forward():
        layer(x)

    return {"gather": gather, "compute": compute, "split_forward": split_forward}


class StandInSplit:
    """The split op's C++ loop on one device, its collectives replaced by copies (csrc/split_linear.cpp,
    ``HostCopyTransport``): slice i is copied in from pinned host memory where its all-gather would
    bring it, and each slice's weight gradient copied out to pinned host memory where its
    reduce-scatter would send it. The copies run where the collectives would, on the op's
    communication stream, on the GPU's copy engines, for as long as those bytes take over PCIe.
    Everything else is the op's own code: streams, events, the two gather buffers, the loop.
    """

    def __init__(self, weight: torch.Tensor, k: int) -> None:
        self.ext = split.build_extension()
        self.weight = weight.detach()
        self.pieces = split.split_layout(weight.shape[0], 1, k)[1]
        self.rows = [sum(self.pieces[:i]) for i in range(len(self.pieces))]
        pin = weight.is_cuda  # page-locked memory needs a GPU; on CPU the copies are plain copies
        self.slices = [self.weight[r : r + q].to("cpu", copy=True) for r, q in zip(self.rows, self.pieces)]
        self.slices = [t.pin_memory() if pin else t for t in self.slices]
        self.sinks = [torch.empty(q, weight.shape[1], dtype=weight.dtype, pin_memory=pin) for q in self.pieces]
        self.buffer = torch.empty(max(self.pieces), weight.shape[1], dtype=weight.dtype, device=weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ext.stand_in_forward(x, self.weight, self.slices, self.pieces)

    def step(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        """Forward and backward (input and weight gradients), as in training."""
        self.forward(x)
        self.ext.stand_in_backward(grad, x, self.weight, self.slices, self.sinks, self.pieces)

    def gathers(self) -> None:
        """The forward's copies alone, one after another."""
        for t in self.slices:
            self.buffer[: t.shape[0]].copy_(t, non_blocking=True)

    def matmuls(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The forward's slice products alone, into their columns of ``out``."""
        for r, q in zip(self.rows, self.pieces):
            out[:, r : r + q].copy_(torch.mm(x, self.buffer[:q].t()))


def _median_times(fns: dict, rounds: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Each function once per round, in turn (other load slows all alike); its times after warm-up."""
    times = {name: [] for name in fns}
    for i in range(warmup + rounds):
        for name, fn in fns.items():
            with StepTimer(device) as timer:
                fn()
            if i >= warmup:
                times[name].append(timer.seconds)
    return times


def stand_in_overlap(
    device: torch.device,
    *,
    in_features: int = 4096,
    out_features: int = 16384,
    ks: tuple[int, ...] = (2, 4, 8),
    dtype: torch.dtype = torch.bfloat16,
    compute_to_gather: float = 1.5,
    tokens: int | None = None,
    max_tokens: int = 65536,
    rounds: int = 10,
    warmup: int = 2,
) -> dict:
    """Fraction of the gather time hidden behind the slice matmuls, and step times, of an
    ``out_features x in_features`` Linear on one device through ``StandInSplit``.

    The stand-in's duration is fixed by the bytes and the host link; ``tokens`` (default: chosen
    so that the forward's matmuls take ``compute_to_gather`` times as long as its copies, the
    regime in which overlap can hide them) sets the compute. Per k, over interleaved rounds:
    the copies alone (g), the matmuls alone (c), the op's forward (f); hidden = (g + c - f) / g.
    The op starts slice 0's gather only when it is called, so at most (k - 1) / k of g can
    hide (``hideable_s``); ``hidden_of_hideable`` is hidden time over that. Steps (forward and
    backward) against the unsplit ``nn.Linear`` with its weight resident, and against the op
    with one slice (gather all, then compute).
    """
    torch.manual_seed(0)
    weight = (torch.randn(out_features, in_features, device=device) / in_features**0.5).to(dtype)
    whole = StandInSplit(weight, 1)
    if tokens is None:  # calibrate: the copies of the whole weight, and matmul seconds per token
        probe = torch.randn(4096, in_features, device=device, dtype=dtype)
        out = torch.empty(4096, out_features, device=device, dtype=dtype)
        t = _median_times({"g": whole.gathers, "c": lambda: whole.matmuls(probe, out)}, 5, 2, device)
        per_token = statistics.median(t["c"]) / 4096
        tokens = int(compute_to_gather * statistics.median(t["g"]) / per_token) // 256 * 256
        tokens = min(max(tokens, 256), max_tokens)
        del probe, out
    x = torch.randn(tokens, in_features, device=device, dtype=dtype)
    grad = torch.randn(tokens, out_features, device=device, dtype=dtype)
    out = torch.empty(tokens, out_features, device=device, dtype=dtype)
    linear_w = weight.clone().requires_grad_()
    x_leaf = x.clone().requires_grad_()

    def linear_step() -> None:
        torch.nn.functional.linear(x_leaf, linear_w).backward(grad)
        linear_w.grad = x_leaf.grad = None

    reference = torch.nn.functional.linear(x, weight).float()
    low = dtype in (torch.bfloat16, torch.float16)  # outputs of about 1: a bf16 rounding step is up to 0.03
    atol, rtol = (5e-2, 2e-2) if low else (1e-4, 1e-4)
    results = {}
    for k in ks:
        op = StandInSplit(weight, k)
        errors = []

        def forward_checked(op=op, errors=errors) -> None:
            y = op.forward(x)
            if len(errors) < 3:  # a missing wait between the streams would read a stale slice
                diff = (y.float() - reference).abs()
                errors.append((diff.max().item(), bool((diff <= atol + rtol * reference.abs()).all())))

        fns = {"gather": op.gathers, "compute": lambda op=op: op.matmuls(x, out), "split_forward": forward_checked,
               "split_step": lambda op=op: op.step(x, grad), "unsplit_gathered_step": lambda: whole.step(x, grad),
               "linear_step": linear_step}
        t = _median_times(fns, rounds, warmup, device)
        g, c, f = t["gather"], t["compute"], t["split_forward"]
        hideable = 1 - op.pieces[0] / sum(op.pieces)
        hidden = [(gi + ci - fi) / gi for gi, ci, fi in zip(g, c, f)]
        med = {name: statistics.median(v) for name, v in t.items()}
        results[k] = {
            "hidden_fraction": min(max(statistics.median(hidden), 0.0), 1.0),
            "hideable_fraction": hideable,
            "hidden_of_hideable": min(max(statistics.median(hidden) / hideable, 0.0), 1.0),
            "gather_s": med["gather"], "compute_s": med["compute"], "split_forward_s": med["split_forward"],
            "split_step_s": med["split_step"], "linear_step_s": med["linear_step"],
            "unsplit_gathered_step_s": med["unsplit_gathered_step"],
            "step_vs_linear": med["split_step"] / med["linear_step"],
            "step_vs_unsplit_gathered": med["split_step"] / med["unsplit_gathered_step"],
            "max_abs_error": max(e for e, _ in errors), "matches_linear": all(ok for _, ok in errors),
        }
        del op
    return {
        "layer": f"Linear({in_features}, {out_features})", "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens, "compute_to_gather_target": compute_to_gather, "weight_bytes": weight.nbytes, "rounds": rounds, "timer": "CUDA events" if device.type == "cuda"
        else "wall clock", "stand_in": StandInSplit.__doc__.split("\n\n")[0].replace("\n    ", " ").strip(),
        "per_k": results,
    }


def run(rank: int, world_size: int, args) -> list[dict] | None:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))
    if args.backend:
        split.set_backend(args.backend)
    rows = []
    for model_name in args.models:
        tokens = args.tokens[model_name]
        strategies = {"zero3": build(model_name, "zero3", 1, mesh)}
        strategies.update({f"split k={k}": build(model_name, "split", k, mesh) for k in args.ks})
        steps = {name: training_step(model, model_name, tokens, device) for name, model in strategies.items()}
        step_times = interleaved(steps, args, device)

        # Overlap, with each split unit's bias gathered as in its forward.
        split_units = {name: model[0] for name, model in strategies.items() if name != "zero3"}
        probes = {}
        for name, unit in split_units.items():
            unit.unshard()
            probes.update({(name, part): fn for part, fn in overlap_probes(unit, tokens, device).items()})
        probe_times = interleaved(probes, args, device)
        for unit in split_units.values():
            unit.reshard()

        for name, model in strategies.items():
            split.reset_peak_memory_stats()
            tracker = GatheredBytes()
            with tracker:
                steps[name]()
            times = step_times[name]
            row = dict(model=model_name, strategy=name, tokens_per_rank=tokens, step_s=statistics.median(times),
                       step_min_s=min(times), step_times_s=times, peak_gathered_bytes=tracker.peak,
                       full_weight_bytes=sum(4 * i * o for i, o in MODELS[model_name]),
                       # per round against zero3's step of the same round: robust to slowly varying load
                       step_vs_zero3=statistics.median(t / z for t, z in zip(times, step_times["zero3"])))
            if name != "zero3":
                stats = split.memory_stats()
                row.update(op_peak_gathered_bytes=stats["peak_gathered_bytes"], op_peak_unreduced_grad_bytes=stats["peak_grad_bytes"])
                g, c, f = (probe_times[(name, part)] for part in ("gather", "compute", "split_forward"))
                hidden = statistics.median((gi + ci - fi) / gi for gi, ci, fi in zip(g, c, f))  # per round, as above
                row.update(gather_s=statistics.median(g), compute_s=statistics.median(c), split_forward_s=statistics.median(f),
                           hidden_fraction=min(max(hidden, 0.0), 1.0))
            rows.append(row)
        if rank == 0:
            print(f"  {model_name}: done", flush=True)
        del strategies, steps, probes, split_units
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["strategy"] == "zero3")
        row["step_min_vs_zero3"] = row["step_min_s"] / base["step_min_s"]
        row["gathered_vs_zero3"] = row["peak_gathered_bytes"] / base["peak_gathered_bytes"]
        row["gathered_vs_full_weight"] = row["peak_gathered_bytes"] / row["full_weight_bytes"]
    return rows if rank == 0 else None


def machine(args, world_size: int) -> dict:
    info = {**machine_info(args.device), "world_size": world_size, "split_backend": split.backend()}
    info["gpu"] = info.pop("cuda")
    return info


def report(rows: list[dict], info: dict, out: Path) -> None:
    print(f"\n{info['cpu'] if info['device'] == 'cpu' else info['gpu']}, torch {info['torch']}, "
          f"{info['world_size']} ranks, split backend {info['split_backend']}")
    header = (f"{'model':18s} {'strategy':10s} {'step ms':>9s} {'vs zero3':>8s} {'min vs':>7s} "
              f"{'gathered MiB':>12s} {'vs zero3':>8s} {'vs W':>6s} {'hidden':>6s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        hidden = f"{r['hidden_fraction']:6.2f}" if "hidden_fraction" in r else "     -"
        print(f"{r['model']:18s} {r['strategy']:10s} {r['step_s'] * 1e3:9.1f} {r['step_vs_zero3']:8.3f} {r['step_min_vs_zero3']:7.3f} "
              f"{r['peak_gathered_bytes'] / 2**20:12.1f} {r['gathered_vs_zero3']:8.3f} {r['gathered_vs_full_weight']:6.3f} {hidden}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "results": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


def run_and_describe(rank: int, world_size: int, args) -> tuple[list, dict]:
    return run(rank, world_size, args), machine(args, world_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens-linear", type=int, default=256, help="tokens per rank for the 4096x16384 Linear")
    p.add_argument("--tokens-mlp", type=int, default=512, help="tokens per rank for the GPT MLP")
    p.add_argument("--steps", type=int, default=8, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--backend", choices=split._extension.MODES, default=None, help="split implementation (default: auto)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    args.tokens = {"linear_4096x16384": args.tokens_linear, "gpt_mlp_1536": args.tokens_mlp}
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend != "python":
        split.build_extension()  # once, before the ranks load it from the cache

    if "RANK" in os.environ:  # torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        else:
            torch.set_num_threads(args.threads)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rows = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            report(rows, machine(args, dist.get_world_size()), args.out)
        dist.destroy_process_group()
        return

    if args.device == "cuda":
        raise SystemExit("on GPUs, launch with torchrun (one process per GPU)")
    rows, info = run_local_ranks(run_and_describe, args.world_size, args, timeout_s=3600,
                                 collective_timeout_s=600, threads=args.threads)[0]
    report(rows, info, args.out)


if __name__ == "__main__":
    main()
