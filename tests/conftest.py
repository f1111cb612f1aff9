import os

# One thread per process: the test machines have 2 cores and multi-rank tests run several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def split_library():
    """The C++ split op's library, built once (or found in the user's cache) for the whole session."""
    from pathlib import Path

    import osdp.split as split

    return Path(split.build_extension().__file__)
