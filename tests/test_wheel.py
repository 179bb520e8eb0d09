"""The package as a user gets it: a wheel installed into a fresh venv, used outside any checkout.

Builds the wheel from this checkout and installs it, with the local CPU torch, into a new virtual
environment without the system's site-packages: first plain (no extras: what `pip install
ringctl-*.whl` gives; its test runs first), then with the `hf` extra added (one venv: a second
one cost the suite 25 s of installing torch again). From an empty temporary directory it runs the
bundled jobs by name: `ringctl run smoke` (4 local ranks) in both, `ringctl run longdoc` (on the
bundled trained byte-level model, read from the installed package: the job's default,
SmolLM2, needs a package these venvs do not have) and `ringctl render smoke backend=slurm`; also `ringctl example` writes a config that then runs. Nothing here may come
from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One pytest-xdist worker runs this file, in order: its tests share the wheel and the venv
# (module fixtures), which a second worker would build again (50 s), and the plain test
# must run before the hf extra is added.
pytestmark = pytest.mark.xdist_group("wheel")
ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"
_NOT_SOURCE = (".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache", "results")


def _pip_install(python: Path) -> list:
    """pip install without byte-compiling every module it installs (torch alone: 16 s of CPU
    of 18; a module is compiled when first imported instead, as in any environment), with the
    suite's pins (scripts/test-constraints.txt: a venv does not inherit scripts/test's -c, and
    took the newest transformers)."""
    pins = ROOT / "scripts" / "test-constraints.txt"
    return [python, "-m", "pip", "install", "-q", "--no-compile", "-c", pins]


def _run(argv, *, cwd, env, timeout=900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, argv))} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the wheel built from this checkout, the environment to install and run it with)."""
    import torch

    if not torch.__version__.startswith(TORCH_VERSION):
        pytest.skip(f"needs the local CPU torch {TORCH_VERSION} build (have {torch.__version__})")
    base = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # Built from a copy: setuptools leaves build/ in the source tree, and a stale build/lib
    # would carry files this checkout no longer has into the wheel.
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", base, source],
        cwd=base,
        env=env,
    )
    wheels = sorted(base.glob("ringctl-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], env


def _venv(wheel: tuple[Path, dict], where: Path, spec: str) -> tuple[Path, dict[str, str]]:
    """A fresh venv (no system site-packages) with the local CPU torch, then `pip install
    spec` (the wheel, with or without extras) resolving everything else from the index."""
    path, env = wheel
    env = dict(env)
    venv = where / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=where, env=env)
    py = venv / "bin" / "python"
    _run([*_pip_install(py), f"torch=={TORCH_VERSION}"], cwd=where, env=env)
    _run([*_pip_install(py), spec.format(wheel=path)], cwd=where, env=env)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env["HF_HUB_OFFLINE"] = "1"
    return venv, env


@pytest.fixture(scope="module")
def plain_venv(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The wheel alone, no extras: what `pip install ringctl-*.whl` gives."""
    return _venv(wheel, tmp_path_factory.mktemp("venv"), "{wheel}")


@pytest.fixture(scope="module")
def wheel_venv(wheel, plain_venv) -> tuple[Path, dict[str, str]]:
    """The same venv with the `hf` extra (transformers, tokenizers) added: the plain test,
    first in this file, has run (run alone after these, it fails: longdoc would then run)."""
    venv, env = plain_venv
    spec = f"{wheel[0]}[hf]"
    _run([*_pip_install(venv / "bin" / "python"), spec], cwd=venv, env=env)
    return venv, env


def test_plain_install_runs_a_job_and_names_what_longdoc_needs(plain_venv, tmp_path):
    """No extras: the core's own dependencies must run a job (the shards are written with
    safetensors, which needs numpy); the long-document job asks for the hf extra by name."""
    venv, env = plain_venv
    smoke = _run(["ringctl", "run", "smoke", "timeout=120"], cwd=tmp_path, env=env)
    assert "COMPLETED" in smoke.stdout
    argv = ["ringctl", "run", "longdoc", "task.model_path=bundled:demo-byte-llama"]
    longdoc = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert longdoc.returncode != 0 and "pip install 'ringctl[hf]'" in longdoc.stderr, longdoc
    assert "Traceback" not in longdoc.stderr


def test_wheel_carries_templates_and_jobs(wheel_venv, tmp_path):
    venv, env = wheel_venv
    probe = (
        "import ringctl, ringctl.resources as r; print(ringctl.__file__); "
        "print(r.template_dir()); print(sorted(r.bundled_jobs()))"
    )
    out = _run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=env).stdout.splitlines()
    site = str(venv)
    assert out[0].startswith(site), f"ringctl imported from {out[0]}, not the venv"
    assert out[1].startswith(site) and (Path(out[1]) / "slurm.sh.j2").is_file()
    assert out[2] == "['attention', 'longdoc', 'smoke', 'train']"


def test_bundled_jobs_run_by_name_outside_a_checkout(wheel_venv, tmp_path):
    _, env = wheel_venv
    smoke = _run(["ringctl", "run", "smoke", "timeout=120"], cwd=tmp_path, env=env)
    assert "COMPLETED" in smoke.stdout
    rendered = _run(["ringctl", "render", "smoke", "backend=slurm"], cwd=tmp_path, env=env)
    assert rendered.stdout.startswith("#!") and "#SBATCH" in rendered.stdout
    byte_model = "task.model_path=bundled:demo-byte-llama"
    longdoc = _run(["ringctl", "run", "longdoc", "job_dir=ld", byte_model], cwd=tmp_path, env=env)
    assert "COMPLETED" in longdoc.stdout
    gathered = _run(["ringctl", "gather", "ld"], cwd=tmp_path, env=env)
    assert "perplexity" in gathered.stdout.lower() and "bits/byte" in gathered.stdout
    # The bundled trained model, read from the installed package: a story it never saw
    # costs less than a byte bigram's ~3.5 bits per byte (random: 8).
    rows = json.loads((tmp_path / "ld" / "gathered" / "summary.json").read_text())["documents"]
    story = next(r for r in rows if r["document"] == "lighthouse-keeper.txt")
    assert story["bits_per_byte"] < 3.0, story


def test_example_writes_a_config_that_runs(wheel_venv, tmp_path):
    _, env = wheel_venv
    listing = _run(["ringctl", "example"], cwd=tmp_path, env=env).stdout
    assert "smoke" in listing and "longdoc" in listing
    _run(["ringctl", "example", "smoke", "cfg"], cwd=tmp_path, env=env)
    assert (tmp_path / "cfg" / "smoke.yaml").is_file()
    done = _run(
        ["ringctl", "run", "cfg/smoke.yaml", "nodes=2", "timeout=120"], cwd=tmp_path, env=env
    )
    assert "COMPLETED" in done.stdout
