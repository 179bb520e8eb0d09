"""`ringctl topo probe`: record what one node looks like, for planning elsewhere.

The job template runs this once per allocated node before the workers start; the plan is then
made from the collected JSON files, so planning needs neither GPUs nor the nodes themselves.
A tool that is missing or fails is recorded as null: a CPU-only node is a valid node.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from ..atomic import atomic_write
from ..errors import UserError

__all__ = ["collect_probe", "node_name", "write_probe"]

PROBE_VERSION = 1
TIMEOUT_S = 30


def node_name() -> str:
    """Slurm's node name when inside a Slurm job step (several emulated nodes can share one
    real hostname), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _run(argv: list[str], errors: dict[str, str]) -> str | None:
    """Output of a tool, or None (with the reason in `errors`) when missing or failing."""
    tool = argv[0]
    if shutil.which(tool) is None:
        errors[tool] = "not found"
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        errors[tool] = str(err)
        return None
    if done.returncode != 0:
        errors[tool] = (done.stderr or done.stdout).strip()[:500] or f"exit {done.returncode}"
        return None
    return done.stdout


def collect_probe() -> dict[str, Any]:
    """The probe record: node name, raw tool outputs (or null), CPU count."""
    errors: dict[str, str] = {}
    smi = _run(["nvidia-smi", "topo", "-m"], errors)
    if smi is not None and "GPU0" not in smi:
        errors["nvidia-smi"] = "no GPU in its output"
        smi = None
    ibstat = _run(["ibstat"], errors)
    devinfo = None if ibstat else _run(["ibv_devinfo"], errors)
    return {
        "version": PROBE_VERSION,
        "node": node_name(),
        "hostname": socket.gethostname(),
        "nvidia_smi_topo": smi,
        "ibstat": ibstat or None,
        "ibv_devinfo": devinfo or None,
        "cpu_count": os.cpu_count(),
        "errors": errors,
    }


def write_probe(path: str | Path | None) -> dict[str, Any]:
    """Collect and write the probe to `path` (stdout when None or '-'), as a new file renamed
    into place: a link planted at path (a job directory is writable from every node) is
    replaced, never written through."""
    record = collect_probe()
    text = json.dumps(record, indent=2) + "\n"
    if path in (None, "-"):
        print(text, end="")
    else:
        try:
            atomic_write(path, text)
        except OSError as err:
            raise UserError(f"{path}: cannot write ({err.strerror})") from None
    return record
