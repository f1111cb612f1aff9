"""OSDP: Optimal Sharded Data Parallel for PyTorch.

``osdp.wrap(model, device_mem=..., example_input=...)`` plans and applies; ``osdp.plan`` (a function) only
plans; ``osdp.Plan`` is the plan's type (``osdp.schema.plan``). The package follows the data flow: a model is
described (``describe``), the machine measured (``machine``, ``calibration``), every plan priced (``cost``),
the fastest that fits searched (``search``, ``planner``), applied with FSDP2 (``fsdp_ext``, ``split``) and
trained (``runtime``, ``cli``, ``integrations``).
"""

from osdp import _moved
from osdp._version import __version__

# the entry points
from osdp.api import plan_of, set_requires_gradient_sync, strategy_plan, wrap
from osdp.planner import plan
from osdp.schema.plan import MODES, Plan, UnitPlan
from osdp.describe.units import Unit, discover_units

# helpers the README documents
from osdp.calibration.measured import calibrate
from osdp.fsdp_ext.compile import compile_units
from osdp.fsdp_ext.gradients import clip_grad_norm_
from osdp.fsdp_ext.replicas import check_replicas
from osdp.machine.device_info import DeviceInfo
from osdp.machine.presets import device_preset, list_presets
from osdp.sizes import parse_size

# what a user may catch
from osdp.calibration.nets import CalibrationError
from osdp.describe.batch import ProfileError
from osdp.distributed import PeerFailure
from osdp.fsdp_ext.budget_check import BudgetExceededWarning
from osdp.fsdp_ext.module_api import WrappedTwiceError
from osdp.fsdp_ext.replicas import ReplicaDivergence
from osdp.fsdp_ext.replicate import UnusedParametersError
from osdp.runtime.dcp import CheckpointError
from osdp.schema.plan import PlanError
from osdp.search import BudgetTooSmall

_moved.install()  # the previous release's import paths, for one more release

__all__ = [
    "__version__", "wrap", "plan", "plan_of", "strategy_plan", "set_requires_gradient_sync", "Plan", "UnitPlan",
    "MODES", "Unit", "discover_units", "calibrate", "compile_units", "clip_grad_norm_", "check_replicas",
    "DeviceInfo", "device_preset", "list_presets", "parse_size", "BudgetExceededWarning", "BudgetTooSmall",
    "CalibrationError", "CheckpointError", "PeerFailure", "PlanError", "ProfileError", "ReplicaDivergence",
    "UnusedParametersError", "WrappedTwiceError",
]
