import atexit
import os
import shutil
import tempfile

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
