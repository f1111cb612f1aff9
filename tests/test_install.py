"""osdp as users install it: an sdist and a wheel built with ``python -m build`` from a clean copy of
the tree, the wheel installed into a fresh virtual environment that reuses this environment's torch (a ``.pth``
naming the running interpreter's site-packages, whether it is the system Python, a venv or a conda
environment; ``pip install --no-deps --no-index``: no network), the split op built
there by ``osdp build-ext`` from the installed copy of its sources, and a 2-rank split Linear step
through it compared with nn.Linear. The one real compile of the suite besides ``split_library``."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

import osdp

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1500)  # a compile takes 30-50 s on 2 cores, several times that when they are busy


def _run(command, timeout, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _running_site_packages():
    """The site-packages of the interpreter running the tests (``sys.executable``): a venv's own (and its
    base's when it was made with ``--system-site-packages``), a conda environment's, or the system
    Python's, plus the user site where that interpreter enables it."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(os.path.realpath(d) for d in dirs) if os.path.isdir(d)]


def _reuse_running_environment(python):
    """Let the venv of ``python`` import this environment's packages (torch, pip, build tools).
    ``--system-site-packages`` would expose the *base* interpreter's, which inside a venv or a conda
    environment lacks torch. The directories go in as plain ``.pth`` lines, appended after the venv's
    own site-packages (so the installed osdp wins) and without running their ``.pth`` files (so an
    editable install of this checkout does not leak in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # the .pth alone
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   timeout=120, env=env).stdout.strip()
    (Path(purelib) / "_osdp_test_running_env.pth").write_text("".join(f"{d}\n" for d in _running_site_packages()))
    probe = "import json, sys, torch; print(json.dumps([sys.prefix, torch.__version__, torch.__file__]))"
    done = _run([str(python), "-c", probe], timeout=300, env=env)
    prefix, version, torch_file = json.loads(done.stdout.strip().splitlines()[-1])
    assert os.path.realpath(prefix) == os.path.realpath(Path(python).parent.parent), (prefix, python)
    assert version == torch.__version__, (version, torch.__version__)
    assert os.path.realpath(torch_file) == os.path.realpath(torch.__file__), (torch_file, torch.__file__)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a clean clone: no build outputs, caches or egg-info of this checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".venv", "*.so", ".osdp_cache", "raw"))
    timings = {}
    start = time.perf_counter()
    # --no-isolation: build with this environment's setuptools instead of fetching one (no network)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(source)], timeout=600)
    timings["build_dists_s"] = time.perf_counter() - start
    sdist, = (tmp / "dist").glob("*.tar.gz")
    wheel, = (tmp / "dist").glob("*.whl")

    start = time.perf_counter()
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=300)  # pip: this environment's
    python = venv / "bin" / "python"
    _reuse_running_environment(python)
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", str(wheel)], timeout=300)
    timings["install_s"] = time.perf_counter() - start

    # As in an activated environment, with nothing of this checkout on the path and an empty op cache.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OSDP_SPLIT_BACKEND", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               OSDP_EXTENSIONS_DIR=str(tmp / "extensions"), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    built = _run([str(venv / "bin" / "osdp"), "build-ext"], timeout=1200, env=env, cwd=tmp)
    timings["build_ext_s"] = time.perf_counter() - start
    print(f"\ninstall test timings: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    return dict(tmp=tmp, sdist=sdist, wheel=wheel, venv=venv, python=python, env=env, built=built.stdout)


def test_sdist_and_wheel_carry_the_op_sources_and_every_module(installed):
    version = osdp.__version__
    with tarfile.open(installed["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"csrc/split_linear.cpp", "pyproject.toml", "README.md"} <= names
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"osdp_torch-{version}.dist-info/METADATA").decode()
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "osdp").rglob("*.py")}
    assert not modules - names, f"modules missing from the wheel (pyproject's package list): {sorted(modules - names)}"
    assert {"osdp/_csrc/split_linear.cpp", "osdp/models/corpus.txt"} <= names
    assert f"\nVersion: {version}\n" in metadata
    assert installed["wheel"].name == f"osdp_torch-{version}-py3-none-any.whl"


def test_version_agrees_with_package_metadata(installed):
    printed = _run([str(installed["venv"] / "bin" / "osdp"), "--version"], timeout=120, env=installed["env"], cwd=installed["tmp"])
    assert printed.stdout.strip() == f"osdp {osdp.__version__}"
    probe = ("import importlib.metadata, json, osdp; "
             "print(json.dumps([importlib.metadata.version('osdp-torch'), osdp.__version__, osdp.__file__]))")
    done = _run([str(installed["python"]), "-c", probe], timeout=120, env=installed["env"], cwd=installed["tmp"])
    metadata_version, module_version, module_file = json.loads(done.stdout.strip().splitlines()[-1])
    assert metadata_version == module_version == osdp.__version__
    assert Path(module_file).is_relative_to(installed["venv"])  # the installed copy, not this checkout


def test_installed_op_is_built_from_its_own_sources_and_a_2_rank_step_equals_linear(installed):
    extensions = installed["tmp"] / "extensions"
    assert installed["built"].startswith("built in "), installed["built"]
    manifest_path, = extensions.glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    site_sources = [Path(p) for p in manifest["sources"]]
    assert all(p.is_relative_to(installed["venv"]) and p.parent.name == "_csrc" for p in site_sources), site_sources
    again = _run([str(installed["venv"] / "bin" / "osdp"), "build-ext"], timeout=300, env=installed["env"], cwd=installed["tmp"])
    assert again.stdout.startswith("already built: "), again.stdout

    env = dict(installed["env"], PYTHONPATH=str(REPO / "tests" / "support"))  # the harness only; osdp comes from the venv
    done = _run([str(installed["python"]), "-m", "installed_split_check"], timeout=600, env=env, cwd=installed["tmp"])
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, done.stdout + done.stderr
    for rank in ranks:
        assert rank["backend"] == ("cuda" if torch.cuda.is_available() else "cpp")  # the op, CPU tensors here
        assert Path(rank["osdp_file"]).is_relative_to(installed["venv"])
        assert Path(rank["library"]) == manifest_path.parent / manifest["library"]
        assert max(rank["errors"].values()) < 1e-5, rank["errors"]
