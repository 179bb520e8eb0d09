"""Helpers for tests that watch a real local job from outside (no tests here)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for(predicate, timeout: float, what: str):
    """Poll predicate every 0.1 s until it returns something true; fail after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def local_state(job_dir: Path) -> dict:
    """The local supervisor's state.json ({} before it exists or while it is replaced)."""
    try:
        return json.loads((job_dir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def submitted_job_dir(out: str) -> Path:
    """The job directory `ringctl submit` names at the end of its output ("... in DIR")."""
    return Path(out.strip().rsplit(" in ", 1)[1])


def submit(capsys, *argv: str) -> Path:
    """`ringctl submit ARGV`, its exit status 0 (else its stderr shown): the job directory."""
    from ringctl.cli import main

    capsys.readouterr()
    assert main(["submit", *argv]) == 0, capsys.readouterr().err
    return submitted_job_dir(capsys.readouterr().out)


def ssh_overrides(login) -> list[str]:
    """The overrides that send a job to the test cluster's loopback sshd (``ssh_login``)."""
    return [
        "backend=ssh",
        f"ssh.host={login.host}",
        f"ssh.port={login.port}",
        f"ssh.user={login.user}",
        f"ssh.key={login.key}",
        f"ssh.known_hosts={login.known_hosts}",
    ]
