"""The calibration: what the ideal cost model misses on this machine, measured once and cached.

``osdp calibrate`` (or the first ``osdp.wrap(device_mem=...)`` on a machine
without one) measures, on the live process group:

* the collectives' alpha-beta costs (``osdp.machine.measure.measure_collectives``,
  re-fitted a few times while the jobs below run, the median kept);
* the compute scale: how much longer a model computes in a job of this world
  size, every rank computing at once, than its description says (described on
  rank 0 with the others idle, as the planner describes a model): a plain
  synthetic model's step, all ranks at once against rank 0 alone, in turn;
* the wait of ranks that meet: a plain synthetic model's step, every rank at
  once, meeting at every unit against once a step (``measure_meeting_wait``;
  under FSDP2 every unit's collectives make the ranks meet, and ranks that
  computed the same drift apart as they compute);
* FSDP2's runtime costs: a synthetic model (``CalibrationNet``: units of a few
  Linears, narrow and wide, few and many units, small and large batch) trained under every mode,
  with checkpointing and with split Linears (``calibration_jobs``, side by side
  with ``osdp.runtime.jobs.run_jobs``); what the cost model without overheads does
  not explain is attributed (``fit_calibration``) to fixed costs per step and
  per unit and per-byte costs by mode, per parameter tensor, per checkpointed unit, per split
  slice and byte, the contention of split slices' gathers with compute, the
  optimizer's cost per tensor, and the memory margin.

Nothing of a model being planned enters it. The result (``MachineCalibration``:
the collectives and the cost model's ``Calibration``) is cached under
``$OSDP_CACHE_DIR/calibration``, keyed by everything it depends on
(``CalibrationKey``: hosts, device, backend, world size, threads per rank,
network interface, torch version); ``osdp.plan``, ``osdp.wrap``, ``osdp
validate`` and the experiments read it from there. A calibration for another
key is never used: the lookup is by the whole key, and a file given by hand
whose key differs is refused with the differences named.

Tests use a tiny calibration (``OSDP_CALIBRATION_PROFILE=tiny``: smaller nets,
a few steps each), keyed apart, so it is never taken for a real one.


The package: ``nets`` (the synthetic models and what is measured of them), ``fit`` (the measurements and the
fit), ``store`` (the cached record and its key), ``measured`` (``calibrate``: the cache, else a measurement).
"""

from osdp._moved import old_names

__getattr__ = old_names(__name__)  # the previous release's names of this package (osdp._moved)
