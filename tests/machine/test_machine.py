"""osdp.machine: a benchmark record names the machine and the code it ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

import osdp
from osdp.machine.identity import machine_info, source_commit


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_named_and_uncommitted_code_is_marked(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "osdp").mkdir(parents=True)
    (repo / "osdp" / "a.py").write_text("x = 1\n")
    (repo / "notes.md").write_text("notes\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    assert source_commit(repo) == head
    (repo / "notes.md").write_text("other notes\n")  # not code: still that commit
    source_commit.cache_clear()
    assert source_commit(repo) == head
    (repo / "osdp" / "a.py").write_text("x = 2\n")
    source_commit.cache_clear()
    assert source_commit(repo) == head + "+"
    assert source_commit(tmp_path) is None  # not a checkout


def test_a_record_names_osdp_and_its_commit():
    info = machine_info()
    assert info["osdp"] == osdp.__version__
    assert info["osdp_commit"] == source_commit(Path(osdp.__file__).resolve().parent.parent)
