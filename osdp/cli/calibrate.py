"""``osdp calibrate``: measure this machine's calibration for a job of ``--nproc`` ranks, and cache it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from osdp.calibration.measured import calibrate
from osdp.calibration.store import calibration_path
from osdp.cli.launch import run_on_ranks
from osdp.distributed import world


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="osdp calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch when not under torchrun (default 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--force", action="store_true", help="measure again even if this job's calibration is cached")
    p.add_argument("--full", action="store_true",
                   help="every term, DDP's all-reduce hidden behind backward among them (what models over 1 MiB "
                        "need; the experiments use it); default: what a small model's job needs, in less time")
    p.add_argument("--json", type=Path, help="also write the calibration here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    def body(device: torch.device) -> None:
        record = calibrate(device, force=args.force, profile="full" if args.full else None, ddp_overlap=False)
        if world()[0] == 0:
            print(record.summary())
            print(f"cached in {calibration_path(record.key)}")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(record.to_dict(), indent=1))

    return run_on_ranks("osdp.cli.calibrate", argv, nproc=args.nproc, device=args.device, body=body)


if __name__ == "__main__":
    sys.exit(main())
