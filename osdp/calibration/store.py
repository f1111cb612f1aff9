"""The cached calibration: its key (``CalibrationKey``: everything it depends on), the record
(``MachineCalibration``), and where it is read from and written to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from osdp.calibration.nets import CalibrationError, profile_from_env
from osdp.cost.terms import Calibration
from osdp.distributed import all_gather_objects, world
from osdp.machine.device_info import DeviceInfo
from osdp.machine.identity import cpu_model, host
from osdp.schema.plan import MODES
from osdp.store import cache_dir, write_atomically

CALIBRATION_VERSION = 15  # bump when what is measured changes: older cache entries are not read


# --------------------------------------------------------------------------- the cached record


@dataclass(frozen=True)
class CalibrationKey:
    """Everything a calibration depends on: one measured under another key is never used."""

    hosts: tuple[str, ...]  # every rank's host name, sorted, once each
    device: str  # the GPU's name, or the CPU's model
    device_type: str
    backend: str
    world_size: int
    threads: int  # per rank
    interface: str  # the network interface gloo / NCCL are told to use, if any
    torch: str
    profile: str = "full"
    reduce_scatter: str = "native"  # osdp.distributed.collectives's implementations, which the collectives were measured with
    all_gather: str = "native"
    ranks_per_node: int = 0  # the job's node layout (torchrun's LOCAL_WORLD_SIZE): its topology is measured
    version: int = CALIBRATION_VERSION

    @classmethod
    def current(cls, device: torch.device, profile: str | None = None) -> "CalibrationKey":
        """Collective: this job's key (every rank's host, rank 0's view of the rest); ``profile`` defaults
        to ``OSDP_CALIBRATION_PROFILE`` (``full`` when unset)."""
        profile = profile or profile_from_env().name
        _, world_size = world()
        hosts = tuple(sorted(set(all_gather_objects(host()))))
        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
        interface = os.environ.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", "")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        from osdp.distributed import collectives as comm
        from osdp.distributed import ranks_per_node

        return cls(hosts, name, device.type, backend, world_size, torch.get_num_threads(), interface,
                   torch.__version__, profile, comm.reduce_scatter_impl(), comm.all_gather_impl(),
                   min(ranks_per_node(), world_size))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        where = ", ".join(self.hosts) if len(self.hosts) <= 2 else f"{len(self.hosts)} hosts"
        return (f"{self.device} ({self.device_type}, {self.backend}), {self.world_size} ranks of {self.threads} "
                f"thread(s) on {where}" + (f" over {self.interface}" if self.interface else "")
                + (f" as nodes of {self.ranks_per_node}" if 0 < self.ranks_per_node < self.world_size else "")
                + f", torch {self.torch}" + (f", {self.profile} profile" if self.profile != "full" else ""))

    def differences(self, other: "CalibrationKey") -> list[str]:
        """What differs, each as "field OTHER'S (this job: THIS ONE'S)"."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k} {theirs[k]!r} (this job: {mine[k]!r})" for k in mine if mine[k] != theirs[k]]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CalibrationKey":
        return cls(**{**d, "hosts": tuple(d["hosts"])})


@dataclass(frozen=True)
class MachineCalibration:
    """A machine's calibration: its collectives and the cost model's runtime terms, under its key."""

    key: CalibrationKey
    device_info: DeviceInfo  # collectives (and matmul FLOP/s) on the live group
    calibration: Calibration  # the cost model's terms
    seconds: float = 0.0  # how long measuring it took
    measured_at: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what was measured, for the record

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": dataclasses.asdict(self.key), "device_info": self.device_info.to_dict(),
            "calibration": self.calibration.to_dict(), "seconds": self.seconds, "measured_at": self.measured_at,
            "details": dict(self.details),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MachineCalibration":
        return cls(CalibrationKey.from_dict(d["key"]), DeviceInfo.from_dict(d["device_info"]),
                   Calibration.from_dict(d["calibration"]), float(d.get("seconds", 0.0)),
                   str(d.get("measured_at", "")), dict(d.get("details", {})))

    def summary(self) -> str:
        c = self.calibration
        per_unit = ", ".join(f"{m} {1e3 * c.unit_overhead_s.get(m, 0):.2f}" for m in MODES)
        per_step = ", ".join(f"{m} {1e3 * c.root_overhead_s.get(m, 0):.2f}" for m in MODES)
        return (f"calibration of {self.key.describe()}, measured {self.measured_at} in {self.seconds:.0f} s: "
                f"compute x{c.compute_scale:.2f}; per step (ms) {per_step}; per unit (ms) {per_unit}; "
                # s per sqrt(s) as ms per sqrt(ms): the wait at a meeting after 1 ms of compute
                f"ranks meeting {1e3 * c.meeting_wait_s_per_sqrt_s * 1e-3 ** 0.5:.2f} ms per sqrt(ms); "
                f"margin {c.margin_bytes} B")


def calibration_dir() -> Path:
    return cache_dir() / "calibration"


def calibration_path(key: CalibrationKey) -> Path:
    return calibration_dir() / f"{key.device_type}-{key.world_size}ranks-{key.digest()}.json"


def read_calibration(path: Path, key: CalibrationKey | None = None) -> MachineCalibration:
    """The calibration in ``path``; with ``key``, refused (CalibrationError, naming what differs) unless
    it was measured under that key."""
    try:
        found = MachineCalibration.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"{path} is not a calibration osdp can read ({type(e).__name__}: {e})") from e
    if key is not None and found.key != key:
        raise CalibrationError(
            f"the calibration in {path} was measured for another job: " + "; ".join(key.differences(found.key))
            + f". Measure one for this job: osdp calibrate --nproc {key.world_size}"
        )
    return found


def cached_calibration(key: CalibrationKey) -> MachineCalibration | None:
    """The cached calibration for exactly ``key``, or None."""
    path = calibration_path(key)
    if not path.exists():
        return None
    try:
        return read_calibration(path, key)
    except CalibrationError:
        return None  # unreadable or (never by construction) another key's: measured again


def other_calibrations(key: CalibrationKey) -> list[str]:
    """The cached calibrations that do not fit ``key``, each with what differs."""
    out = []
    for path in sorted(calibration_dir().glob("*.json")):
        try:
            other = read_calibration(path)
        except CalibrationError:
            continue
        if other.key != key:
            out.append(f"{path.name}: {'; '.join(key.differences(other.key))}")
    return out


def _where(path: Path | None) -> str:
    return f"cached in {path}" if path is not None else "not cached (see the warning)"


def _save(record: MachineCalibration) -> Path | None:
    """Cache ``record``; None if the cache cannot be written (the run goes on, with a warning)."""
    path = calibration_path(record.key)
    return path if write_atomically(path, json.dumps(record.to_dict(), indent=1)) else None
