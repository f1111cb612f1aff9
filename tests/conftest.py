import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The helpers every folder of tests shares (rank harness, models, training checks), importable by name; the
# ranks spawned by a test get this path too (multiprocessing sends the parent's sys.path to its children).
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# One thread per process: the test machines have 2 cores and multi-rank tests run several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The first plan on a machine measures its calibration (osdp.calibration); tests measure the tiny one,
# keyed apart from a real one, once per world size per session, in this session's own cache (ranks and
# subprocesses inherit both).
os.environ["OSDP_CALIBRATION_PROFILE"] = "tiny"
_cache = tempfile.mkdtemp(prefix="osdp-test-cache-")
os.environ["OSDP_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, True)

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def split_library():
    """The C++ split op's library, built once (or found in the user's cache) for the whole session."""
    import osdp.split as split

    return Path(split.build_extension().__file__)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it; ``pytest -m gpu`` runs only them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu there, or python experiments/gpu_check.py)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that made the default process group in this process (``osdp.wrap`` makes a one-rank group when
    there is none) destroys it after, so that the next test starts as a fresh process would."""
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
