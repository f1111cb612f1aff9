"""How long ranks wait for each other where FSDP2's collectives make them meet, on three kinds of net.

    python experiments/meeting_wait.py --out experiments/results/meeting_wait.json

On 2 gloo ranks of one thread each, ``osdp.calibration.fit.measure_meeting_wait`` (what ``osdp calibrate`` runs
on its transformer) times each plain net with every rank computing at once, freely (the ranks meet once a
step) and meeting at every unit's forward and backward (a one-element all-reduce), at its micro-batch and
at 4x, and fits the wait per square root of the seconds computed between meetings:

* ``linears``: a stack of Linear pairs, the shape of the calibration nets the per-unit costs are fitted on;
* the calibration's own transformer (``CalibrationProfile.meeting_net`` of the full profile);
* gpt2-mini's shape (4 layers, width 256, sequence 128, micro-batch 8).

The calibration (compute scale, the all-reduce's latency) is this job's cached one (``OSDP_CACHE_DIR``), or
measured first. Prints a table and writes every point to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from local_ranks import rank0_result

ROUNDS = 15


class _Linears(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.units = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                                   for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return (x - y).pow(2).mean()


@dataclass(frozen=True)
class LinearsNet:
    """A stack of ``depth`` units of two Linears each: ``measure_meeting_wait``'s net interface."""

    depth: int
    width: int
    batch: int

    @property
    def name(self) -> str:
        return f"linears-{self.depth}x2x{self.width}b{self.batch}"

    def build(self) -> nn.Module:
        return _Linears(self.depth, self.width)

    def batch_of(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        return (torch.randn(b, self.width, generator=g).to(device), torch.randn(b, self.width, generator=g).to(device))


def nets() -> dict[str, object]:
    from osdp.calibration.nets import PROFILES, MeetingNet

    return {
        "linears": LinearsNet(depth=8, width=512, batch=64),
        "calibration transformer": PROFILES["full"].meeting_net,
        "gpt2-mini shape": MeetingNet(n_layer=4, n_embd=256, n_head=4, seq_len=128, batch=8),
    }


def _measure(rank: int, world_size: int) -> dict:
    from osdp.calibration.fit import measure_meeting_wait
    from osdp.calibration.measured import calibrate

    device = torch.device("cpu")
    machine = calibrate(device)  # cached, or measured now by every rank
    rows = {}
    for kind, net in nets().items():
        got = measure_meeting_wait(device, net, machine.calibration.compute_scale,
                                   machine.device_info.collectives, ROUNDS)
        rows[kind] = got
    return {"calibration": machine.to_dict(), "nets": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "meeting_wait.json")
    args = p.parse_args()
    result = rank0_result(_measure, 2)
    calibrated = result["calibration"]["calibration"]["meeting_wait_s_per_sqrt_s"]
    print(f"{'net':26} {'name':22} {'batch':>5} {'extra ms':>9} {'meetings':>8} {'sum sqrt(s)':>11} "
          f"{'wait ms/sqrt(ms)':>16}")
    for kind, got in result["nets"].items():
        for point in got["points"]:
            print(f"{kind:26} {got['net']:22} {point['batch']:5d} {1e3 * point['extra_s']:9.1f} "
                  f"{point['meetings']:8d} {point['sqrt_segments']:11.3f}")
        # s per sqrt(s) is sqrt(1000) ms per sqrt(ms)
        print(f"{'':26} {'fitted':22} {'':5} {'':9} {'':8} {'':11} {got['wait_s_per_sqrt_s'] * 1000 ** 0.5:16.3f}")
    print(f"the cached calibration's wait: {calibrated * 1000 ** 0.5:.3f} ms per sqrt(ms)")
    from osdp.machine.identity import machine_info

    result["machine"] = {**machine_info(), "ranks": 2, "threads_per_rank": 1, "rounds": ROUNDS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
