"""Files osdp keeps between runs (descriptions, calibrations): written whole or not at all, never fatal.

A reader never sees half a file: the text goes to a temporary file beside the target, which then replaces it
in one rename (an interrupted write leaves only the temporary file, which no reader looks for). A cache that
cannot be written (a read-only home, a path that is not a directory) costs the next run a measurement, not
this run: one warning line says where and what to set, and the run goes on.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def cache_dir() -> Path:
    """Where osdp keeps what it measured: ``$OSDP_CACHE_DIR``, default ``~/.cache/osdp``."""
    return Path(os.environ.get("OSDP_CACHE_DIR") or Path.home() / ".cache" / "osdp")


def write_atomically(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` in one rename; False (with a warning) if the directory cannot be written."""
    tmp = path.with_suffix(f"{path.suffix}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
        return True
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        warnings.warn(f"osdp: cannot write {path} ({type(e).__name__}: {e.strerror or e}): this run goes on "
                      "without caching it, and the next one measures it again; point OSDP_CACHE_DIR at a writable "
                      "directory", stacklevel=2)
        return False
