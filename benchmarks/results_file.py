"""The JSON every ring benchmark writes: what ran, where, and its rows, replaced whole."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path


def write_results(path: Path, benchmark: str, argv: list[str], results: list) -> dict:
    """Write {benchmark, host, cpus, argv, results} to path through a temporary file (a
    killed run never leaves half a file); return the payload. Rows are dataclasses or dicts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": benchmark,
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "argv": argv,
        "results": [r if isinstance(r, dict) else asdict(r) for r in results],
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    return payload
