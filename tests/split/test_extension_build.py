"""The split op's build cache: keys, the race of ranks on an empty cache, corruption, no compiler, read-only.

Compiling costs 30-50 s on 2 cores, so only ``split_library`` (once per session,
usually from the user's cache) and tests/test_install.py compile for real; here
a stand-in "compiler" writes a copy of that real library slowly, chunk by chunk,
so that a half-written file would be seen, and the copies are really loaded.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import osdp
import osdp.split as split
from osdp.split import _build, _extension
from osdp.split._build import ExtensionUnavailable, cache_key, cached_library, ensure_built, key_directory

REPO = Path(__file__).resolve().parents[2]


def _slow_copy(library, log, source_files, build_dir, *, timeout_s, verbose, seconds=0.0):
    """A stand-in compiler: log the call, then write ``library`` into ``build_dir`` in 16 chunks."""
    start = time.time()
    data = Path(library).read_bytes()
    out = Path(build_dir) / f"{_build.NAME}.so"
    with open(out, "wb") as f:
        for i in range(16):
            f.write(data[i * len(data) // 16:(i + 1) * len(data) // 16])
            f.flush()
            time.sleep(seconds / 16)
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "start": start, "end": time.time()}) + "\n")
    return out


def _builds(log) -> list[dict]:
    return [json.loads(line) for line in Path(log).read_text().splitlines()] if Path(log).exists() else []


def _race(root, library, log, barrier, results):
    barrier.wait(timeout=60)  # start together, on an empty cache
    entered = time.time()
    path = ensure_built(Path(root), compile_fn=functools.partial(_slow_copy, library, log, seconds=2.0))
    module = _build.load(path)
    results.put(dict(entered=entered, path=str(path), stats=sorted(module.memory_stats()), sha=_build._sha256(path)))


def test_four_ranks_on_an_empty_cache_build_once_and_all_load(tmp_path, split_library):
    # Forked, not spawned: the processes only lock, copy files and load the library, and a fork skips
    # four imports of torch (30 s on 2 busy cores).
    root, log = tmp_path / "cache", tmp_path / "builds.jsonl"
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(root, split_library, log, barrier, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * 4
    builds = _builds(log)
    assert len(builds) == 1, builds
    assert len({r["path"] for r in results}) == 1
    assert all(r["sha"] == _build._sha256(split_library) for r in results)  # no process saw a half-written file
    assert all(r["stats"] == ["gathered_bytes", "grad_bytes", "peak_gathered_bytes", "peak_grad_bytes"] for r in results)
    waited = [r for r in results if r["entered"] < builds[0]["end"]]
    assert len(waited) >= 2, (results, builds)  # the builder and at least one process that arrived mid-build
    assert sorted(p.name for p in Path(results[0]["path"]).parent.iterdir()) == [".lock", "manifest.json", "osdp_split.so"]


def test_corrupted_or_interrupted_builds_are_rebuilt_never_loaded(tmp_path, split_library, capfd):
    root, log = tmp_path / "cache", tmp_path / "builds.jsonl"
    compile_fn = functools.partial(_slow_copy, split_library, log)
    library = ensure_built(root, compile_fn=compile_fn)
    assert ensure_built(root, compile_fn=compile_fn) == library and len(_builds(log)) == 1  # cached
    key = cache_key(_build.sources())
    good = library.read_bytes()

    def damaged(why):
        found, reason = cached_library(library.parent, key)
        assert found is None and why in reason, reason
        assert ensure_built(root, compile_fn=compile_fn) == library
        assert library.read_bytes() == good and cached_library(library.parent, key) == (library, "")
        assert f"rebuilding the C++ split op: {reason}" in capfd.readouterr().err

    corrupted = bytearray(good)
    corrupted[len(good) // 2] ^= 0xFF
    library.write_bytes(corrupted)
    damaged("is corrupted")
    library.write_bytes(good[: len(good) // 3])  # half-written
    damaged("is corrupted")
    (library.parent / "manifest.json").unlink()  # a build interrupted before its manifest
    damaged("has no manifest")
    (library.parent / "manifest.json").write_text("{not json")
    damaged("is unreadable")
    (library.parent / "build-x1y2").mkdir()  # left by a builder that died
    library.unlink()
    damaged("is unreadable")
    assert not list(library.parent.glob("build-*"))
    assert len(_builds(log)) == 6


def test_cache_keyed_by_osdp_torch_python_and_sources(tmp_path, split_library, monkeypatch, capfd):
    root, log = tmp_path / "cache", tmp_path / "builds.jsonl"
    compile_fn = functools.partial(_slow_copy, split_library, log)
    key = cache_key(_build.sources())
    assert key["osdp"] == osdp.__version__ and key["torch"] == torch.__version__
    for field, other in [("osdp", "0.0.9"), ("torch", "2.12.0+cpu"), ("torch_git", "0" * 40),
                         ("python", "cpython-310-x86_64-linux-gnu"), ("sources", "f" * 64), ("flags", "-O3")]:
        assert key_directory(root, dict(key, **{field: other})) != key_directory(root, key), field

    # Two osdp versions share one cache: each builds once and keeps loading its own library.
    mine = ensure_built(root, compile_fn=compile_fn)
    monkeypatch.setattr(_build, "__version__", "0.2.0")
    theirs = ensure_built(root, compile_fn=compile_fn)
    assert theirs.parent != mine.parent and "osdp0.2.0-" in theirs.parent.name
    assert ensure_built(root, compile_fn=compile_fn) == theirs
    monkeypatch.undo()
    assert ensure_built(root, compile_fn=compile_fn) == mine
    assert len(_builds(log)) == 2

    # Other sources (an edited checkout, another installed copy): another directory, built from them.
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "split_linear.cpp").write_text(_build.sources()[0].read_text() + "\n// edited\n")
    monkeypatch.setattr(_build, "SOURCE_DIRS", (edited, *_build.SOURCE_DIRS))
    assert _build.sources() == [edited / "split_linear.cpp"]
    edited_library = ensure_built(root, compile_fn=compile_fn)
    assert edited_library.parent not in (mine.parent, theirs.parent)
    monkeypatch.undo()

    # A directory whose manifest says another torch (copied or renamed by hand) is rebuilt, never loaded.
    manifest_path = mine.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["key"]["torch"] = "2.12.0+cpu"
    manifest_path.write_text(json.dumps(manifest))
    found, why = cached_library(mine.parent, key)
    assert found is None and "built for torch='2.12.0+cpu'" in why and f"not torch={key['torch']!r}" in why
    assert ensure_built(root, compile_fn=compile_fn) == mine
    assert json.loads(manifest_path.read_text())["key"] == key
    assert len(_builds(log)) == 4
    capfd.readouterr()


def test_a_stuck_builder_makes_the_others_give_up_not_hang(tmp_path, split_library, monkeypatch):
    root = tmp_path / "cache"
    directory = key_directory(root, cache_key(_build.sources()))
    monkeypatch.setattr(_build, "LOCK_MARGIN_S", 0.5)
    with _build._exclusive(directory, 1.0):  # another open file description: a second holder conflicts
        start = time.monotonic()
        with pytest.raises(ExtensionUnavailable, match="another process has been building the split op"):
            ensure_built(root, compile_fn=functools.partial(_slow_copy, split_library, tmp_path / "log"), timeout_s=0.5)
        assert time.monotonic() - start < 10


def _processes_mentioning(text):
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            pass  # exited meanwhile
    return found


def test_a_compile_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    root = tmp_path / "cache"
    start = time.monotonic()
    with pytest.raises(ExtensionUnavailable, match="took more than 2 s and was stopped"):
        ensure_built(root, timeout_s=2.0)  # the real compile: its child process alone takes longer to start
    assert time.monotonic() - start < 30
    directory = key_directory(root, cache_key(_build.sources()))
    assert not list(directory.glob("build-*")) and not (directory / "manifest.json").exists()
    assert not _processes_mentioning(str(directory))  # the compile's process group was killed


def test_no_compiler_or_ninja_says_what_is_missing_and_the_pytorch_loop_runs(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CXX", "g++-13")
    monkeypatch.setattr(sys, "executable", str(empty / "python"))  # no ninja beside the interpreter either
    monkeypatch.setattr(_build.sysconfig, "get_paths", lambda: {"include": str(tmp_path / "include")})
    monkeypatch.setenv("OSDP_EXTENSIONS_DIR", str(tmp_path / "cache"))
    with pytest.raises(ExtensionUnavailable) as e:
        ensure_built()
    message = str(e.value)
    assert "no C++ compiler: 'g++-13' is not on PATH" in message
    assert "no ninja" in message and "pip install ninja" in message
    assert "no Python headers" in message and "python3-dev" in message
    assert "osdp build-ext" in message
    assert not (tmp_path / "cache").exists()  # nothing half-made

    monkeypatch.setattr(_extension, "_ext", None)
    monkeypatch.setattr(_extension, "_error", None)
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "auto")
    with pytest.warns(UserWarning, match=re.escape("no C++ compiler: 'g++-13'") + ".*using the PyTorch loop"):
        assert split.backend() == "python"
    monkeypatch.setenv("OSDP_SPLIT_BACKEND", "cpp")
    with pytest.raises(ExtensionUnavailable, match=re.escape("no C++ compiler")):
        split.backend()


_READ_ONLY_CHECK = """
import json, sys, warnings
from pathlib import Path
import osdp.split as split
from osdp.split import _build

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend = split.backend()  # OSDP_EXTENSIONS_DIR: read-only and empty
try:
    _build.ensure_built()
    error = None
except _build.ExtensionUnavailable as e:
    error = str(e)
library = _build.ensure_built(Path(sys.argv[1]))  # read-only, holding a build made ahead of time
print(json.dumps(dict(backend=backend, warning=" ".join(str(w.message) for w in caught), error=error,
                      library=str(library), stats=sorted(_build.load(library).memory_stats()))))
"""


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_read_only_cache_loads_a_prebuilt_op_or_says_why_not(tmp_path, split_library):
    empty, prebuilt = tmp_path / "empty", tmp_path / "prebuilt"
    empty.mkdir()
    shutil.copytree(split_library.parent, prebuilt / split_library.parent.name, ignore=shutil.ignore_patterns(".lock", "build-*"))
    for path in (empty, prebuilt, *prebuilt.rglob("*")):
        path.chmod(0o555 if path.is_dir() else 0o444)
    before = _tree(prebuilt)
    command = [sys.executable, "-c", _READ_ONLY_CHECK, str(prebuilt)]
    if os.geteuid() == 0:  # root ignores permission bits unless it gives up CAP_DAC_OVERRIDE
        assert shutil.which("setpriv"), "running as root, this test needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE"
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    env = dict(os.environ, OSDP_EXTENSIONS_DIR=str(empty), OSDP_SPLIT_BACKEND="auto",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    finally:
        for path in (empty, prebuilt, *prebuilt.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "python"
    for text in (out["warning"], out["error"]):
        assert f"the extension cache {empty} is not writable" in text and "OSDP_EXTENSIONS_DIR" in text, text
    assert "using the PyTorch loop" in out["warning"]
    assert Path(out["library"]).parent == prebuilt / split_library.parent.name
    assert out["stats"] == ["gathered_bytes", "grad_bytes", "peak_gathered_bytes", "peak_grad_bytes"]
    assert _tree(prebuilt) == before and not list(empty.iterdir())  # loading wrote nothing
