"""Building the split op of csrc/ into a cache that every process of a job can share.

The op is compiled against the torch that is installed (``torch.utils.cpp_extension``
in a child process, so a hung or failing compiler is bounded and reported, and the
builder does not load a second copy), once per cache key:

    osdp version, Python ABI, torch version and build, sources hash, compiler flags

each key in its own directory under ``OSDP_EXTENSIONS_DIR`` (default
``~/.cache/osdp/torch_extensions``), so builds for another torch, Python or osdp
never meet. A directory holds ``osdp_split.so`` and ``manifest.json`` (the key and
the library's sha256), both moved into place by atomic renames, manifest last: a
library is loaded only when its manifest names the current key and its hash
matches, so a half-written, corrupted or foreign library is rebuilt, never loaded.
Building takes an exclusive ``flock`` on the directory's ``.lock`` (released by the
kernel if the builder dies); processes that arrive meanwhile wait for it, find the
library and load it. Loading a valid library writes nothing, so a read-only cache
built ahead of time (``osdp build-ext``) works.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from osdp._version import __version__

NAME = "osdp_split"  # the module name compiled into the library (PyInit_osdp_split)
FLAGS = ("-O2",)
BUILD_TIMEOUT_S = 900.0  # a compile takes 30-50 s on 2 busy cores
LOCK_POLL_S = 0.2
LOCK_MARGIN_S = 60.0  # a waiting process gives up this long after the builder's own time limit
SOURCE_FILES = ("split_linear.cpp",)
# An installed osdp carries the sources in the package (pyproject maps csrc/ to osdp/_csrc/);
# a source checkout (PYTHONPATH or an editable install) has them in the top-level csrc/.
SOURCE_DIRS = (Path(__file__).resolve().parents[1] / "_csrc", Path(__file__).resolve().parents[2] / "csrc")


class ExtensionUnavailable(RuntimeError):
    """The op cannot be built or loaded here; the message says what is missing and what would work."""


def sources() -> list[Path]:
    for directory in SOURCE_DIRS:
        found = [directory / name for name in SOURCE_FILES]
        if all(p.is_file() for p in found):
            return found
    raise ExtensionUnavailable(
        f"the split op's sources ({', '.join(SOURCE_FILES)}) are in neither {' nor '.join(map(str, SOURCE_DIRS))}: "
        "this osdp was installed without them; reinstall osdp-torch from its wheel or sdist (both carry them)"
    )


def cache_root() -> Path:
    return Path(os.environ.get("OSDP_EXTENSIONS_DIR") or Path.home() / ".cache" / "osdp" / "torch_extensions")


def cache_key(source_files: list[Path]) -> dict[str, str]:
    """Everything the compiled library depends on; a change in any field is another directory."""
    digest = hashlib.sha256()
    for path in source_files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {
        "osdp": __version__,
        "python": sysconfig.get_config_var("SOABI") or f"{sys.implementation.cache_tag}-{sys.platform}",
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "torch_cxx11_abi": str(torch.compiled_with_cxx11_abi()),
        "sources": digest.hexdigest(),
        "flags": " ".join(FLAGS),
    }


def key_directory(root: Path, key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    readable = f"osdp{key['osdp']}-{sys.implementation.cache_tag}-torch{key['torch']}".replace("+", "_")
    return Path(root) / f"{readable}-{digest}"


def cached_library(directory: Path, key: dict[str, str]) -> tuple[Path | None, str]:
    """(the library, "") if ``directory`` holds a complete build for ``key``, else (None, why not)."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        if (directory / f"{NAME}.so").exists():
            return None, f"{directory / f'{NAME}.so'} has no manifest (an interrupted build)"
        return None, "not built yet"
    try:
        manifest = json.loads(manifest_path.read_text())
        library = directory / manifest["library"]
        expected_hash = manifest["sha256"]
        built_for = manifest["key"]
        if not isinstance(built_for, dict):
            raise TypeError(f"its key is {type(built_for).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{manifest_path} is unreadable ({type(e).__name__}: {e})"
    if built_for != key:
        differs = sorted(k for k in set(key) | set(built_for) if key.get(k) != built_for.get(k))
        theirs = ", ".join(f"{k}={built_for.get(k)!r}" for k in differs)
        ours = ", ".join(f"{k}={key.get(k)!r}" for k in differs)
        return None, f"{directory} was built for {theirs}, not {ours}"
    try:
        actual_hash = _sha256(library)
    except OSError as e:
        return None, f"{library} is unreadable ({type(e).__name__}: {e})"
    if actual_hash != expected_hash:
        return None, f"{library} is corrupted (its sha256 differs from the one recorded when it was built)"
    return library, ""


def missing_build_tools() -> list[str]:
    """What this machine lacks to compile the op (empty if nothing), each with how to get it."""
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler.split()[0], path=_tool_path()):
        missing.append(
            f"no C++ compiler: {compiler!r} is not on PATH (install one, e.g. `apt-get install g++`, or set CXX to its path)"
        )
    if not shutil.which("ninja", path=_tool_path()):
        missing.append("no ninja: `ninja` is not on PATH (`pip install ninja`; osdp-torch depends on it, "
                       "so it is missing only after an install with --no-deps)")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        missing.append(f"no Python headers: {headers} does not exist (install your Python's development "
                       "package, e.g. `apt-get install python3-dev`)")
    return missing


def ensure_built(
    root: Path | None = None,
    *,
    force: bool = False,
    verbose: bool = False,
    timeout_s: float = BUILD_TIMEOUT_S,
    compile_fn: Callable[..., Path] | None = None,
) -> Path:
    """The path of a valid library for this osdp, torch and Python under ``root``: the cached one,
    or one built now (once, whatever the number of processes asking at the same time).
    ``compile_fn(sources, build_dir, timeout_s=, verbose=)`` returns the library it wrote under
    ``build_dir``; tests pass a cheap one. Raises ExtensionUnavailable saying what would work."""
    root = Path(root) if root is not None else cache_root()
    source_files = sources()
    key = cache_key(source_files)
    directory = key_directory(root, key)
    if not force:
        library, _ = cached_library(directory, key)
        if library is not None:
            return library  # the common case: no lock, no write (a read-only cache works)
    if compile_fn is None:
        missing = missing_build_tools()
        if missing:
            raise ExtensionUnavailable(
                "cannot build the C++ split op here: " + "; ".join(missing) + ". With them installed, run "
                "`osdp build-ext` (or build once where they are, into a shared OSDP_EXTENSIONS_DIR)"
            )
        compile_fn = compile_in_subprocess
    with _exclusive(directory, timeout_s + LOCK_MARGIN_S):
        library, why = cached_library(directory, key)  # built by another process while this one waited?
        if library is not None and not force:
            return library
        for leftover in directory.glob("build-*"):  # of builders that died; none runs while we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        if why not in ("", "not built yet"):
            print(f"osdp: rebuilding the C++ split op: {why}", file=sys.stderr)
        print(f"osdp: building the C++ split op into {directory} (about a minute; "
              "`osdp build-ext` does this ahead of time)", file=sys.stderr)
        return _build_into(directory, key, source_files, compile_fn, timeout_s, verbose)


def load(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ExtensionUnavailable(
            f"{library} does not load ({e}); rebuild it with `osdp build-ext --force`"
        ) from e
    return module


def compile_in_subprocess(source_files: list[Path], build_dir: Path, *, timeout_s: float, verbose: bool) -> Path:
    """``torch.utils.cpp_extension.load`` in a child process, which also checks that the library imports."""
    code = (
        "import json, sys\n"
        "from torch.utils import cpp_extension\n"
        "cpp_extension.load(name=sys.argv[1], sources=sys.argv[4:], extra_cflags=json.loads(sys.argv[3]),\n"
        "                   with_cuda=False, build_directory=sys.argv[2], verbose=True)\n"
    )  # with_cuda=False: the stream path is written against c10's device-generic API, no CUDA headers
    argv = [sys.executable, "-c", code, NAME, str(build_dir), json.dumps(list(FLAGS)), *map(str, source_files)]
    log_path = build_dir / "build.log"
    env = dict(os.environ, PATH=_tool_path())
    with open(log_path, "w") as log:
        out = None if verbose else log
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                 start_new_session=True)  # its own group: a timeout ends the compiler too
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ExtensionUnavailable(
                f"building the C++ split op took more than {timeout_s:.0f} s and was stopped; "
                "run `osdp build-ext --timeout SECONDS --verbose` to see where it stalls"
            ) from None
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    library = build_dir / f"{NAME}.so"
    if returncode != 0 or not library.exists():
        tail = "" if verbose else "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise ExtensionUnavailable(f"compiling the C++ split op failed (exit code {returncode}):\n{tail}")
    return library


def _build_into(directory, key, source_files, compile_fn, timeout_s, verbose) -> Path:
    build_dir = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
    start = time.perf_counter()
    try:
        built = compile_fn(source_files, build_dir, timeout_s=timeout_s, verbose=verbose)
    except BaseException as e:
        log, kept = build_dir / "build.log", directory / "build-failed.log"
        saved = log.exists() and log.stat().st_size > 0 and shutil.copyfile(log, kept)
        shutil.rmtree(build_dir, ignore_errors=True)
        if saved and isinstance(e, ExtensionUnavailable):
            raise ExtensionUnavailable(f"{e}\n(the compiler's output: {kept})") from None
        raise
    library = directory / f"{NAME}.so"
    _fsync(built)
    os.replace(built, library)  # atomic: a process that loaded the old file keeps its mapping
    manifest = {
        "key": key,
        "library": library.name,
        "sha256": _sha256(library),
        "sources": [str(p) for p in source_files],
        "build_seconds": round(time.perf_counter() - start, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    staged = build_dir / "manifest.json"
    staged.write_text(json.dumps(manifest, indent=2) + "\n")
    _fsync(staged)
    os.replace(staged, directory / "manifest.json")  # last: from now on the library counts as built
    shutil.rmtree(build_dir, ignore_errors=True)
    (directory / "build-failed.log").unlink(missing_ok=True)
    return library


class _exclusive:
    """An exclusive flock on ``directory/.lock``, waited for at most ``timeout_s``."""

    def __init__(self, directory: Path, timeout_s: float):
        self.directory, self.timeout_s, self.fd = directory, timeout_s, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            raise ExtensionUnavailable("building the split op needs POSIX file locks (fcntl)") from None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # read-only is enough for flock, so a lock file made by another user still serves
            self.fd = os.open(self.directory / ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
            probe = tempfile.TemporaryFile(dir=self.directory)
            probe.close()
        except OSError as e:
            if self.fd is not None:
                os.close(self.fd)
            raise ExtensionUnavailable(
                f"the extension cache {self.directory.parent} is not writable ({type(e).__name__}: {e.strerror or e}) "
                "and holds no build for this osdp, torch and Python: set OSDP_EXTENSIONS_DIR to a writable "
                "directory, or run `osdp build-ext` where this one is writable"
            ) from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise ExtensionUnavailable(
                        f"another process has been building the split op in {self.directory} for more than "
                        f"{self.timeout_s:.0f} s; if none is, remove {self.directory} and run `osdp build-ext`"
                    ) from None
                time.sleep(LOCK_POLL_S)

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def _tool_path() -> str:
    """PATH, then the running Python's bin directory (where pip puts ``ninja`` in an environment
    that is used without being activated)."""
    return os.pathsep.join(filter(None, [os.environ.get("PATH", ""), str(Path(sys.executable).parent)]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
