"""Which implementation of the split loop runs: the C++ extension in csrc/, or osdp/split/_loop.py.

The extension is built against the installed torch on first use, or ahead of
time with ``osdp build-ext``, into a cache shared by every process of a job
(``$OSDP_EXTENSIONS_DIR``, default ``~/.cache/osdp/torch_extensions``, one
directory per osdp, torch and Python; see ``_build``); later processes load it
in a fraction of a second. Building needs a C++ compiler and ``ninja``, not a
CUDA toolkit: the stream path (used for CUDA tensors) is written against c10's
device-generic streams and events.

``OSDP_SPLIT_BACKEND`` (or ``set_backend``) chooses: ``auto`` (default: the
extension, or the Python loop with a warning saying why it cannot be built),
``python`` (never build), ``cpp`` (the extension or an error).
"""

from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType

import torch

from osdp.split import _build, _loop

MODES = ("auto", "python", "cpp")

_lock = threading.Lock()
_mode: str | None = None  # None: from the environment
_ext: ModuleType | None = None
_error: BaseException | None = None


def _current_mode() -> str:
    mode = _mode or os.environ.get("OSDP_SPLIT_BACKEND", "auto")
    if mode not in MODES:
        raise ValueError(f"OSDP_SPLIT_BACKEND={mode!r}: use one of {', '.join(MODES)}")
    return mode


def build_extension(verbose: bool = False) -> ModuleType:
    """Build (once, then from the cache) and load the extension; raise ``ExtensionUnavailable`` saying
    what is missing if that cannot be done here."""
    global _ext, _error
    with _lock:
        if _ext is None:
            _ext = _build.load(_build.ensure_built(verbose=verbose))
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
            why = str(e).strip() if isinstance(e, _build.ExtensionUnavailable) else f"{type(e).__name__}: {e}"
            warnings.warn(
                f"osdp.split: C++ extension unavailable ({why[:2000]}); using the PyTorch loop (same "
                "semantics). Set OSDP_SPLIT_BACKEND=python to silence this.",
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
