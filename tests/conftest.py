import os

# One thread per process: the test machines have 2 cores and multi-rank tests run several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
