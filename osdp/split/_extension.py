"""Which implementation of the split loop runs: the C++ extension in csrc/, or osdp/split/_loop.py.

The extension is compiled on first use with ``torch.utils.cpp_extension.load``
(a JIT build against the installed torch, so installing osdp never builds
anything and never asks pip for another torch) and cached under
``$OSDP_EXTENSIONS_DIR`` or ``~/.cache/osdp/torch_extensions``, one folder per
Python version, torch version and source text; later processes load it in a
fraction of a second.
It needs a C++ compiler and ``ninja``, not a CUDA toolkit: its stream path
(used for CUDA tensors) is written against c10's device-generic streams and
events.

``OSDP_SPLIT_BACKEND`` (or ``set_backend``) chooses: ``auto`` (default: the
extension, or the Python loop with a warning if it cannot be built),
``python`` (never build), ``cpp`` (the extension or an error).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from osdp.split import _loop

MODES = ("auto", "python", "cpp")
SOURCES = [Path(__file__).resolve().parents[2] / "csrc" / "split_linear.cpp"]

_lock = threading.Lock()
_mode: str | None = None  # None: from the environment
_ext: ModuleType | None = None
_error: BaseException | None = None


def _current_mode() -> str:
    mode = _mode or os.environ.get("OSDP_SPLIT_BACKEND", "auto")
    if mode not in MODES:
        raise ValueError(f"OSDP_SPLIT_BACKEND={mode!r}: use one of {', '.join(MODES)}")
    return mode


def build_directory() -> Path:
    """One folder per Python, torch and source text: checkouts with different sources (two branches
    at once, say) never rebuild over each other's library."""
    root = os.environ.get("OSDP_EXTENSIONS_DIR") or Path.home() / ".cache" / "osdp" / "torch_extensions"
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES if s.exists())).hexdigest()[:12]
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    return Path(root) / f"{version}_{digest}"


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (once, then from the cache) and load the extension; raise if that fails."""
    global _ext, _error
    with _lock:
        if _ext is not None:
            return _ext
        from torch.utils import cpp_extension

        missing = [str(s) for s in SOURCES if not s.exists()]
        if missing:
            raise FileNotFoundError(f"extension sources not found: {missing} (osdp installed without csrc/)")
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        _ext = cpp_extension.load(
            name="osdp_split",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O2"],
            with_cuda=False,  # no CUDA headers: streams and events through c10's device-generic API
            build_directory=str(directory),
            verbose=verbose,
        )
        _error = None
        return _ext


def set_backend(mode: str) -> None:
    """``auto``, ``python`` or ``cpp``; overrides ``OSDP_SPLIT_BACKEND`` in this process."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"backend mode {mode!r}: use one of {', '.join(MODES)}")
    _mode = mode


def implementation():
    """The module whose ``forward``/``backward`` run the loop under the current mode."""
    global _error
    mode = _current_mode()
    if mode == "python":
        return _loop
    if _ext is not None:
        return _ext
    if mode == "cpp":
        return build_extension()
    if _error is None:
        try:
            return build_extension()
        except Exception as e:  # noqa: BLE001 - any build failure falls back to the Python loop
            _error = e
            warnings.warn(
                f"osdp.split: C++ extension unavailable ({type(e).__name__}: {str(e).strip()[:500]}); "
                "using the PyTorch loop (same semantics). Set OSDP_SPLIT_BACKEND=python to silence this.",
                stacklevel=3,
            )
    return _loop


def backend() -> str:
    """The implementation that runs now (may build the extension): ``"python"``, or the extension:
    ``"cuda"`` where CUDA is available (CUDA tensors take its stream path; CPU tensors its CPU path),
    else ``"cpp"``."""
    if implementation() is _loop:
        return "python"
    return "cuda" if torch.cuda.is_available() else "cpp"


def memory_stats() -> dict[str, int]:
    """Live and peak bytes of gathered weight slices and unreduced gradient slices, measured by the
    active implementation when its buffers' storage is allocated and freed: ``gathered_bytes``,
    ``peak_gathered_bytes``, ``grad_bytes``, ``peak_grad_bytes``."""
    return dict(implementation().memory_stats())


def reset_peak_memory_stats() -> None:
    """Set the peaks of both implementations to their live bytes."""
    if _ext is not None:
        _ext.reset_peak_memory_stats()
    _loop.reset_peak_memory_stats()
