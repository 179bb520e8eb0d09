"""The ssh backend when the login node's network fails mid-exchange: the test sshd behind a
proxy that drops or freezes a connection at a chosen request (tests/fault_proxy.py). Each
failure is one line (never paramiko's traceback), bounded by ssh.command_timeout, keeps what
may have been queued and cleans what surely was not."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ringctl.backends import listing
from ringctl.backends.ssh import SSHBackend, SSHSettings, SSHShell, connect
from ringctl.errors import NotSubmitted, UserError
from tests.fault_proxy import FaultProxy

pytestmark = pytest.mark.ssh


@pytest.fixture
def proxy(ssh_login):
    p = FaultProxy((ssh_login.host, ssh_login.port))
    yield p
    p.close()


@pytest.fixture
def settings(ssh_login, proxy, tmp_path) -> SSHSettings:
    """The test login through the proxy: its host key recorded under the proxy's port."""
    theirs = f"[{ssh_login.host}]:{ssh_login.port} "
    lines = Path(ssh_login.known_hosts).read_text().splitlines()
    known = tmp_path / "known_hosts"
    known.write_text(
        "".join(ln.replace(theirs, f"[127.0.0.1]:{proxy.port} ") + "\n" for ln in lines)
    )
    return SSHSettings(
        host="127.0.0.1",
        port=proxy.port,
        user=ssh_login.user,
        key=ssh_login.key,
        known_hosts=str(known),
        remote_dir=str(tmp_path / "remote-base"),
        connect_timeout=5,
        command_timeout=2,
    )


def _within(seconds: float, fn):
    """fn()'s exception (or None), failing the test if it has not returned in ``seconds``
    (before the fixes these waits had no end)."""
    caught: list[BaseException | None] = []

    def call():
        try:
            fn()
            caught.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            caught.append(err)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert caught, f"still waiting after {seconds}s"
    return caught[0]


def test_a_connection_dropped_as_a_command_is_sent_is_one_line(settings, proxy):
    """The exec request lost with the connection: paramiko's EOFError (no OSError, no
    SSHException) escaped as a traceback, and a submit's `except UserError` with it: the
    directory of a job sbatch had queued was removed. Now a UserError (for sbatch: "may have
    been queued", its directory kept)."""
    shell = SSHShell(connect(settings), settings)
    try:
        proxy.arm("drop", after=1)  # the channel's open passes, its exec is cut
        err = _within(20, lambda: shell.run(["true"]))
        assert type(err) is UserError, repr(err)
        assert f"ssh {settings.target}: running `true` failed: " in str(err)
        assert "\n" not in str(err)
    finally:
        shell.close()


def test_a_dropped_connection_before_a_command_started_nothing(settings, proxy):
    shell = SSHShell(connect(settings), settings)
    try:
        proxy.arm("drop")  # the channel's open itself is cut
        err = _within(20, lambda: shell.run(["true"]))
        assert isinstance(err, NotSubmitted), repr(err)
    finally:
        shell.close()


@pytest.mark.parametrize("what", ["command", "sftp"])
def test_a_login_node_that_stops_answering_is_given_up_on(settings, proxy, what):
    """paramiko waits for an exec's or the SFTP subsystem's answer with no timeout: a login
    node frozen there held `status` past 100 s with ssh.command_timeout=2. Bounded now."""
    shell = SSHShell(connect(settings), settings)
    try:
        proxy.arm("freeze", after=1, forward=True)  # the open passes; then no answer
        start = time.monotonic()
        if what == "command":
            err = _within(20, lambda: shell.run(["true"], timeout=2))
            said = "`true` did not answer within 2s"
        else:
            err = _within(20, lambda: shell.sftp)
            said = "SFTP did not answer within 2s"
        assert type(err) is UserError and said in str(err), repr(err)
        assert time.monotonic() - start < 10
    finally:
        shell.close()


def test_the_backend_connects_again_after_a_drop(settings, proxy):
    """A dropped connection stayed the backend's: every later step of the same verb (a
    resume's undo after its drop) failed on it, leaving the login node's copy half moved."""
    with SSHBackend(settings) as b:
        assert b.shell.run(["true"])[0] == 0
        proxy.arm("drop")
        with pytest.raises(UserError):
            b.shell.run(["true"])
        assert b.shell.run(["true"])[0] == 0  # a new connection
        assert proxy.accepted == 2


def test_an_upload_cut_off_is_one_line_and_leaves_no_partial_copy(settings, proxy, tmp_path):
    """paramiko's SSHException out of the upload was a traceback, and the login node kept a
    half-copied job directory (so the name was taken: "already exists" at the next submit)."""
    local = tmp_path / "job"
    (local / "logs").mkdir(parents=True)
    (local / "big.bin").write_bytes(bytes(2 << 20))  # ~64 sends: the drop lands inside it
    remote = f"{settings.remote_dir}/job"
    with SSHBackend(settings) as b:
        b._mkdirs(settings.remote_dir)
        proxy.arm("drop", after=20)
        with pytest.raises(UserError) as err:
            b._upload(local, remote)
    said = str(err.value)
    assert said.startswith(f"ssh {settings.target}: uploading the job directory to {remote}")
    assert said.endswith("; the partial copy there was removed") and "\n" not in said
    assert not Path(remote).exists()


def test_fetch_refuses_a_login_node_directory_made_a_link(settings, tmp_path, make_job_dir):
    """The remote job directory replaced by a link to another job's: status and logs said it
    is no longer a directory, fetch brought the other job's outputs and logs into this one,
    exit 0 (it asked only when nothing came)."""
    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name="mine")
    base = Path(settings.remote_dir)
    other = base / "other"
    (other / "out").mkdir(parents=True)
    (other / "out" / "theirs.txt").write_text("another job's result\n")
    (base / "mine").symlink_to(other)
    with SSHBackend(settings) as b, pytest.raises(UserError, match="is no longer a directory"):
        b.fetch(job_dir)
    assert not (job_dir / "out" / "theirs.txt").exists()


def test_a_listing_does_not_wait_for_a_down_login_node_once_a_job(tmp_path, settings):
    """Each ssh job's row connected again to a login node that did not answer: 10 jobs took
    52 s at connect_timeout=5 (100 jobs at the default 15 s: 25 minutes). One try a listing."""
    silent = socket.socket()  # accepts, never speaks SSH: the handshake times out
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list = []
    threading.Thread(
        target=lambda: [held.append(silent.accept()) for _ in range(8)], daemon=True
    ).start()
    down = replace(settings, port=silent.getsockname()[1], connect_timeout=1)
    try:
        with listing.listing([]):
            for _ in range(3):
                with pytest.raises(UserError, match="timed out after 1s"):
                    _ = SSHBackend(down).shell
        assert len(held) == 1
    finally:
        silent.close()


def test_a_server_that_closes_the_handshake_is_said_so_without_paramiko_traceback(settings):
    """A busy login node's sshd closing new connections (MaxStartups): paramiko's transport
    thread printed ~20 lines of traceback, then ringctl said "timed out after 5s" for a
    failure of 0.04 s. In a process of its own: pytest's log capture hides the traceback
    from a test in this one (second reading)."""
    closing = socket.socket()
    closing.bind(("127.0.0.1", 0))
    closing.listen(4)

    def close_each():
        while True:
            try:
                conn, _ = closing.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    code = (
        "from ringctl.backends.ssh import SSHSettings, connect\n"
        "from ringctl.errors import UserError\n"
        f"s = SSHSettings(host='127.0.0.1', port={closing.getsockname()[1]}, user='x', "
        f"key={settings.key!r}, known_hosts={settings.known_hosts!r}, connect_timeout=5)\n"
        "try:\n    connect(s)\nexcept UserError as err:\n    print(err)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    finally:
        closing.close()
    assert "the server closed the connection during the SSH handshake after" in done.stdout
    assert "timed out" not in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_the_recorded_cancel_command_reaches_the_login_node(settings, tmp_path):
    """job.json's cancel command left out the job's key and known_hosts file: as printed, it
    failed host-key verification (or asked for a password) where ringctl connected fine."""
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client here to run the recorded command with")
    command = shlex.split(SSHBackend(settings).cancel_command(tmp_path, "4000000000"))
    # -F /dev/null: no ~/.ssh/config of this machine's user decides for it
    argv = [command[0], "-F", "/dev/null", "-o", "BatchMode=yes", *command[1:]]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode != 255, done.stderr  # ssh's own failure (scancel's is its own)
    assert done.returncode == 0 or "scancel: " in done.stderr, done.stderr  # scancel ran there


def test_a_resume_refuses_a_login_node_attempt_folder_that_holds_files(
    settings, tmp_path, make_job_dir
):
    """A resume whose undo could not reach the login node left the last attempt's logs in
    attempts/<n> there; the next resume moved into it and failed with paramiko's bare
    "Failure" while saying "nothing changed". Refused by name, nothing moved."""
    from ringctl.jobdir import JobDir

    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name="resumed")
    remote = Path(settings.remote_dir) / "resumed"
    (remote / "logs").mkdir(parents=True)
    (remote / "logs" / "rank-0.out").write_text("this attempt's\n")
    (remote / "attempts" / "1" / "logs").mkdir(parents=True)
    (remote / "attempts" / "1" / "logs" / "rank-0.out").write_text("left by an undo\n")
    with SSHBackend(settings) as b:
        b._resume_attempt = "1"
        with pytest.raises(UserError, match=r"attempts/1 already holds files \(an earlier"):
            b._prepare_resumed(JobDir(job_dir))
        # the resume's undo then: nothing of this resume's to put back (second reading: it
        # took the earlier leftovers for its own, and moved them or failed on them)
        assert b.undo_resume(JobDir(job_dir), "1") == []
    assert (remote / "logs" / "rank-0.out").read_text() == "this attempt's\n"
    assert (remote / "attempts" / "1" / "logs" / "rank-0.out").read_text() == "left by an undo\n"
    assert not (remote / "config.yaml").exists()  # nothing sent again


def test_a_listing_does_not_wait_again_for_a_login_node_that_stopped_answering(settings, proxy):
    """(second reading) Only a refused connect was remembered: a login node that took the
    connection and then stopped answering cost each ssh job's row the command timeout (120 s
    by default: hours for a listing of 100 jobs). Once a command is given up on, the other
    rows of the listing say so without connecting again."""
    with listing.listing([]):
        first = SSHBackend(settings)
        assert first.shell.run(["true"])[0] == 0
        # the next request the client sends, whichever it is (the last command's channel may
        # still be closing): the channel's open or its exec goes unanswered
        proxy.arm("freeze")
        err = _within(20, lambda: first.shell.run(["true"], timeout=2))
        assert isinstance(err, UserError) and "did not answer within 2s" in str(err), repr(err)
        started = time.monotonic()
        with pytest.raises(UserError, match="did not answer within 2s"):
            _ = SSHBackend(settings).shell
        assert time.monotonic() - started < 1 and proxy.accepted == 1
