"""``calibrate``: this job's calibration, from the cache, else measured now (``measure_calibration``) and cached.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import torch

from osdp.calibration.fit import (
    BUSY_RETRIES,
    BUSY_WAIT_S,
    fit_calibration,
    measure_compute_scale,
    measure_meeting_wait,
    median_collectives,
    pooled_compute_scale,
)
from osdp.calibration.nets import (
    CalibrationError,
    CalibrationProfile,
    _described_compute_s,
    PROFILES,
    calibration_jobs,
    can_split,
    describe_nets,
    profile_from_env,
    profiles_for_job,
)
from osdp.calibration.store import (
    CalibrationKey,
    MachineCalibration,
    _save,
    _where,
    cached_calibration,
    calibration_dir,
    other_calibrations,
)
from osdp.distributed import broadcast_object, job_device, world
from osdp.log import Progress, log
from osdp.machine.measure import measure_collectives, measure_device
from osdp.runtime.jobs import run_jobs


# The share of a calibration's time each part takes (after the C++ split op is built or loaded), measured on
# the full profile on 2 CPU ranks: what the progress line's time left is paced by.
SHARES = {"collectives": 0.06, "compute": 0.05, "describe": 0.15, "jobs": 0.57, "compute again": 0.05,
          "meeting": 0.12}


def _paced(progress: Callable[[str, float], None] | None) -> Callable[..., None]:
    """``say(part, message, within=0.0)``: ``progress`` told the fraction done, ``within`` of ``part``."""
    starts = dict(zip(SHARES, itertools.accumulate([0.0, *SHARES.values()])))

    def say(part: str, message: str, within: float = 0.0) -> None:
        if progress:
            progress(message, starts[part] + SHARES[part] * within)

    return say


def measure_calibration(
    device: torch.device,
    profile: CalibrationProfile | None = None,
    *,
    optimizer: str = "adamw",
    progress: Callable[[str, float | None], None] | None = None,
) -> MachineCalibration:
    """Collective: measure this machine's calibration now (see the module docstring); not cached here."""
    profile = profile or profile_from_env()
    start = time.perf_counter()
    key = CalibrationKey.current(device, profile.name)
    # first, before anything is timed: building the C++ op (once per osdp and torch) takes the cores
    splits = can_split(device)
    split_op_s = broadcast_object(time.perf_counter() - start)  # rank 0's: every rank records the same
    say = _paced(progress)
    say("collectives", "collectives")
    fits = [measure_collectives(time_budget_s=profile.collectives_s)]
    say("compute", "compute: every rank at once against rank 0 alone")
    (compute_net,) = [spec for spec in profile.nets if spec.compute]
    compute = measure_compute_scale(device, compute_net, profile.compute_rounds)
    for retry in range(BUSY_RETRIES if profile.busy_spread else 0):
        if compute["spread"] <= profile.busy_spread:
            break
        say("compute", f"the machine looks busy (a fixed step's time varies {compute['spread']:.2f}x, quiet is "
                       f"<= {profile.busy_spread}x): waiting, then measuring again ({retry + 1}/{BUSY_RETRIES})")
        time.sleep(BUSY_WAIT_S)
        compute = measure_compute_scale(device, compute_net, profile.compute_rounds)
    say("describe", "describing the calibration nets")
    descriptions = describe_nets(device, profile, optimizer=optimizer)
    jobs = calibration_jobs(device, profile, splits=splits)
    measured = run_jobs(
        jobs, device=device, optimizer=optimizer, time_budget_s=profile.run_s, warmup=profile.warmup,
        min_steps=profile.min_steps, rounds=profile.refits, progress=lambda m, f: say("jobs", m, f),
        each_round=lambda: fits.append(measure_collectives(time_budget_s=profile.collectives_s / 2)),
    )
    device_info = broadcast_object(measure_device(collectives=median_collectives(fits)))  # + matmul FLOP/s
    # the machine may have got busy while the jobs ran: the same check once more, at the end
    say("compute again", "compute, again")
    after = measure_compute_scale(device, compute_net, profile.compute_rounds) if profile.busy_spread else None
    busy = max(compute["spread"], after["spread"] if after else 0.0)
    compute_scale = pooled_compute_scale(compute, after)
    say("meeting", "ranks meeting at every unit against once a step")
    meeting = measure_meeting_wait(device, profile.meeting_net, compute_scale, device_info.collectives,
                                   profile.compute_rounds, repeats=profile.describe_repeats)
    calibration = fit_calibration(profile, compute_scale, descriptions, jobs, measured, device_info,
                                  overlap=0.0 if device.type == "cpu" else None, optimizer=optimizer,
                                  meeting_wait=meeting["wait_s_per_sqrt_s"])
    details = {
        "compute": compute,
        "compute_after": after,
        "compute_scale": compute_scale,
        "meeting": meeting,
        "busy": bool(profile.busy_spread and busy > profile.busy_spread),  # said whenever it is used
        "busy_spread": busy,
        "split_op_s": split_op_s,  # of ``seconds``: loading, or building, the C++ split op
        "jobs": {name: {"measured_step_s": m["measured_step_s"], "measured_fwd_bwd_s": m["measured_fwd_bwd_s"],
                        "measured_peak_bytes": m["measured_peak_bytes"], "steps": m["steps"]}
                 for name, m in measured.items()},
        "described_compute_s": {spec.name: _described_compute_s(descriptions[spec.name], spec.batch)
                                for spec in profile.nets},
    }
    seconds = broadcast_object(time.perf_counter() - start)
    when = broadcast_object(time.strftime("%Y-%m-%d %H:%M"))
    calibration = dataclasses.replace(calibration, source=f"measured {when} for {key.describe()}")
    return MachineCalibration(key, device_info, calibration, seconds, when, details)


def calibrate_command(profile: str, world_size: int, *, force: bool = False) -> str:
    """The command that measures ``profile``'s calibration for a job of ``world_size`` ranks."""
    return ("osdp calibrate" + (" --full" if profile == "full" else "") + (" --force" if force else "")
            + f" --nproc {world_size}")


def calibrate(device: torch.device | None = None, *, force: bool = False, measure: bool = True,
              progress: bool = True, profile: str | None = None, ddp_overlap: bool = True) -> MachineCalibration:
    """Collective: this job's calibration, from the cache, else measured now and cached (rank 0 writes it).

    ``profile``: that profile's calibration (``PROFILES``); None: the fullest
    cached one that serves the job (``profiles_for_job``: "full", or "quick"
    where the job cannot hide DDP's all-reduce, ``ddp_overlap=False``), else the
    least measured now. ``force`` measures again even if one is cached.
    ``measure=False`` raises CalibrationError instead of measuring (``osdp
    validate`` and the experiments, which must predict with a calibration made by
    an earlier, separate process). Every rank returns the same calibration.
    """
    device = device or job_device()
    profiles = (PROFILES[profile],) if profile else profiles_for_job(ddp_overlap)
    first = CalibrationKey.current(device, profiles[0].name)  # collective: once, the others differ in name only
    keys = [dataclasses.replace(first, profile=p.name) for p in profiles]
    found = None
    if not force and world()[0] == 0:
        found = next((c for c in map(cached_calibration, keys) if c is not None), None)
    found = broadcast_object(found)
    if found is not None:
        if found.details.get("busy"):
            log(f"the calibration of this job was measured on a busy machine (a fixed step's time varied "
                f"{found.details['busy_spread']:.2f}x): its predictions carry that noise; measure it again when "
                f"the machine is quiet: {calibrate_command(found.key.profile, first.world_size, force=True)}")
        return found
    profile_to_measure, key = profiles[-1], keys[-1]
    others = other_calibrations(key) if world()[0] == 0 else []
    if not measure:
        raise CalibrationError(
            f"no calibration for this job ({key.describe()}) in {calibration_dir()}"
            + (" (there are some for other jobs: " + " | ".join(others) + ")" if others else "")
            + f"; measure one first, in its own run: {calibrate_command(key.profile, key.world_size)}"
        )
    show = Progress("calibrate", progress)
    show(f"no calibration for this job ({key.describe()}) in {calibration_dir()}"
         + (f" (only for other jobs: {' | '.join(others)})" if others else "")
         + f": measuring it once ({profile_to_measure.about} on 2 CPU ranks)")
    record = measure_calibration(device, profile_to_measure, progress=show)
    # Cached even when the machine was busy (a shared cloud VM may stay so): with the noise it was measured
    # under, which every later job is told of, rather than measured again on every run.
    path = _save(record) if world()[0] == 0 else None
    took = f"done in {record.seconds:.0f} s" + (
        f" ({record.details['split_op_s']:.0f} s of it building the C++ split op)"
        if record.details.get("split_op_s", 0) > 5 else "")
    if record.details.get("busy"):
        show.done(f"{took}, {_where(path)} with the noise it was measured under: the machine was busy (a fixed "
                  f"step's time varied {record.details['busy_spread']:.2f}x, quiet is <= "
                  f"{profile_to_measure.busy_spread}x). When it is quiet: "
                  f"{calibrate_command(key.profile, key.world_size, force=True)}")
    else:
        show.done(f"{took}, {_where(path)}")
    return record
