"""The `ssh` backend through the test cluster's loopback sshd (127.0.0.1:2222): host-key
checking, one-line connection errors, quoting, and submit/status/logs/cancel/fetch of jobs on
the real Slurm behind it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ringctl.backends.base import JobState
from ringctl.backends.ssh import SSHBackend, SSHSettings, connect
from ringctl.errors import NotSubmitted, RemoteGone, UserError

pytestmark = pytest.mark.ssh

RANK_LOGS = "--output=logs/rank-%t.out --error=logs/rank-%t.err"
# The job template's line before the ranks' srun: status reads srun's rank lines after it only.
STARTING = "echo '00:00:00 ringctl-job: starting 1 rank'\n"


@pytest.fixture
def settings(ssh_login, tmp_path) -> SSHSettings:
    return SSHSettings(
        host=ssh_login.host,
        port=ssh_login.port,
        user=ssh_login.user,
        key=ssh_login.key,
        known_hosts=ssh_login.known_hosts,
        remote_dir=str(tmp_path / "remote-base"),  # not the local job dir: fetch is real
        connect_timeout=5,
    )


def test_unknown_host_refused_with_how_to_trust(settings, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(UserError) as err:
        connect(replace(settings, known_hosts=str(empty)))
    msg = str(err.value)
    assert "\n" not in msg
    assert f"host [127.0.0.1]:{settings.port} is not in {empty}" in msg
    assert f"ssh-keyscan -p {settings.port} 127.0.0.1 >> {empty}" in msg
    assert "SHA256:" in msg and "trust_unknown_host" in msg
    assert empty.read_text() == ""  # nothing was trusted


def test_the_trust_command_for_the_default_known_hosts_works_as_given(
    settings, tmp_path, monkeypatch
):
    """With ssh.known_hosts unset, the command said `... >> '~/.ssh/known_hosts'`: a quoted
    ~ is no home to the shell ("No such file or directory"). The path is expanded; the
    command, run as given, makes the host known."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(UserError) as err:
        connect(replace(settings, known_hosts=None))
    command = str(err.value).split("trust it with: ", 1)[1].split(" (or set", 1)[0]
    assert f">> {home}/.ssh/known_hosts" in command and "~" not in command, command
    subprocess.run(["bash", "-c", command], check=True, capture_output=True, timeout=30)
    connect(replace(settings, known_hosts=None)).close()


def test_trust_unknown_host_when_asked(settings, tmp_path):
    known = tmp_path / "new" / "known_hosts"
    client = connect(replace(settings, known_hosts=str(known), trust_unknown_host=True))
    client.close()
    assert known.read_text().startswith(f"[127.0.0.1]:{settings.port} ssh-ed25519 ")
    # and from now on the key is known: a strict connection passes
    connect(replace(settings, known_hosts=str(known))).close()


def test_changed_host_key_refused(settings, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = tmp_path / "known_hosts"
    key = " ".join((tmp_path / "other_key.pub").read_text().split()[:2])
    wrong.write_text(f"[127.0.0.1]:{settings.port} {key}\n")
    with pytest.raises(UserError, match="does not match the one in") as err:
        connect(replace(settings, known_hosts=str(wrong)))
    assert "ssh-keygen -R" in str(err.value) and "\n" not in str(err.value)


def test_wrong_port_is_one_line_error(settings):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError) as err:
        connect(replace(settings, port=port))
    msg = str(err.value)
    assert msg.startswith(f"ssh root@127.0.0.1:{port}: cannot connect")
    assert "refused" in msg.lower() and "\n" not in msg


def test_silent_server_times_out(settings):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(UserError) as err:
            connect(replace(settings, port=server.getsockname()[1], connect_timeout=1))
    finally:
        server.close()
        for conn, _ in held:
            conn.close()
    assert time.monotonic() - t0 < 10
    assert "\n" not in str(err.value)
    assert "banner" in str(err.value).lower() or "timed out" in str(err.value)


def test_wrong_key_refused(settings, tmp_path):
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(UserError, match="authentication failed") as err:
        connect(replace(settings, key=str(stranger)))
    assert "\n" not in str(err.value)


def test_remote_commands_are_quoted(settings, tmp_path):
    nasty = f"x; touch {tmp_path}/pwned $(id) `id` '\" \\ *"
    with SSHBackend(settings) as b:
        rc, out, err = b.shell.run(["printf", "%s", nasty])
    assert (rc, out, err) == (0, nasty, "")
    assert not (tmp_path / "pwned").exists()


def test_a_command_ending_with_no_exit_status_is_an_error(settings):
    """A command killed by a signal on the login node (sshd sends exit-signal, no status)
    read as exit status -1, which callers took for the command's own answer (squeue's,
    sacct's, sbatch's 'refusal'). It is an error naming the command; a plain exit is not."""
    with SSHBackend(settings) as b:
        assert b.shell.run(["sh", "-c", "exit 3"])[0] == 3
        with pytest.raises(UserError, match=r"`sh` ended with no exit status") as err:
            b.shell.run(["sh", "-c", "echo 'Submitted 42'; kill -KILL $$"])
        assert "\n" not in str(err.value) and str(err.value).endswith(": Submitted 42")
        assert b.shell.run(["true"])[0] == 0  # the connection serves on
        shell = b.shell
        shell.client.get_transport().close()  # nothing can start: NotSubmitted
        with pytest.raises(NotSubmitted, match="the connection is closed"):
            shell.run(["sbatch", "job.sh"])
        assert b.shell.run(["true"])[0] == 0  # the backend connects again


def test_submit_status_logs_fetch_over_ssh(settings, make_job_dir, tmp_path):
    job_dir = make_job_dir(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --time=2\n"
        'echo "SLURM_CONF=$SLURM_CONF"\n'
        f"srun {RANK_LOGS} bash -c '"
        'echo "rank $SLURM_PROCID on $SLURMD_NODENAME"; '
        'echo "result of rank $SLURM_PROCID" > out/part-$SLURM_PROCID.txt'
        "'\n",
        name="ssh-job-1",
    )
    (job_dir / "config.yaml").write_text("name: ssh-job\n")
    with SSHBackend(settings, poll_s=0.3) as b:
        job_id = b.submit(job_dir)
        remote = tmp_path / "remote-base" / "ssh-job-1"
        assert (remote / "job.sh").read_text() == (job_dir / "job.sh").read_text()
        recorded = json.loads((job_dir / "job.json").read_text())
        assert recorded["backend"] == "ssh" and recorded["job_id"] == job_id
        assert recorded["remote"] == {
            "host": "127.0.0.1",
            "port": settings.port,
            "user": "root",
            "dir": str(remote),
        }
        lines = list(b.logs(job_dir, follow=True))
        st = b.status(job_dir)
        assert st.state is JobState.COMPLETED, st
        # status and logs read the remote files; they copy nothing back
        assert not (job_dir / "out" / "part-1.txt").exists()
        assert "fetched_at" not in json.loads((job_dir / "job.json").read_text())
        kept = remote / "attempts" / f"requeue-{job_id}-1" / "logs"  # as a Slurm requeue keeps
        kept.mkdir(parents=True)
        (kept / "rank-0.out").write_text("the first run\n")
        # status says where that run's logs are: on the login node until fetched
        where = b.requeue_kept(job_id, str(remote))(1)
        assert (
            where
            == f"attempts/requeue-{job_id}-1 on {settings.target} (`ringctl fetch` copies it here)"
        )
        fetched = b.fetch(job_dir)
    assert "out/part-1.txt" in fetched and "job.sh" not in fetched
    kept_here = job_dir / "attempts" / f"requeue-{job_id}-1" / "logs" / "rank-0.out"
    assert kept_here.read_text() == "the first run\n"  # an earlier run's logs come back too
    assert "[rank 0] rank 0 on n1" in lines and "[rank 1] rank 1 on n2" in lines
    # results and logs came back into the local job directory
    assert (job_dir / "out" / "part-1.txt").read_text() == "result of rank 1\n"
    assert (job_dir / "logs" / "rank-0.out").read_text() == "rank 0 on n1\n"
    assert (
        f"SLURM_CONF={settings.known_hosts.rsplit('/ssh/', 1)[0]}/slurm.conf"
        in (job_dir / "logs" / f"batch-{job_id}.out").read_text()
    )
    assert "fetched_at" in json.loads((job_dir / "job.json").read_text())
    # a second backend (a later `ringctl status`) finds the job from job.json alone
    with SSHBackend(replace(settings, remote_dir="elsewhere")) as later:
        assert later.status(job_dir).state is JobState.COMPLETED
        assert list(later.logs(job_dir, rank=1)) == ["rank 1 on n2"]


def test_failure_and_cancel_over_ssh(settings, make_job_dir):
    failing = make_job_dir(
        "#!/bin/bash\n#SBATCH --time=2\n"
        f"{STARTING}srun {RANK_LOGS} bash -c 'echo \"RuntimeError: no GPU here\" >&2; exit 4'\n",
        name="ssh-fail",
    )
    sleeper = make_job_dir(f"#!/bin/bash\n#SBATCH --time=5\nsrun {RANK_LOGS} sleep 300\n", "zz")
    with SSHBackend(settings, poll_s=0.3) as b:
        b.submit(failing)
        b.submit(sleeper)
        st = b.wait(failing, timeout=60)
        assert st.state is JobState.FAILED
        assert st.reason == "rank 0 exited with exit code 4 (n1): RuntimeError: no GPU here"
        deadline = time.monotonic() + 30
        while b.status(sleeper).state is not JobState.RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        b.cancel(sleeper)
        assert b.wait(sleeper, timeout=60).state is JobState.CANCELLED


def test_remote_dir_collision_refused(settings, make_job_dir, tmp_path):
    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name="same-name")
    (tmp_path / "remote-base" / "same-name").mkdir(parents=True)
    with SSHBackend(settings) as b, pytest.raises(UserError, match="already exists"):
        b.submit(job_dir)


def test_fetch_never_trusts_the_remote_directory(settings, make_job_dir, tmp_path):
    """A remote job directory that was changed (by the job, or by anyone who can write there)
    cannot change local control files, write outside the job directory, or crash the fetch."""
    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name="hostile-remote")
    (job_dir / "config.yaml").write_text("name: mine\n")
    with SSHBackend(settings, poll_s=0.3) as b:
        job_id = b.submit(job_dir)
        # The job's own files first (Slurm writes its batch log when the job starts): then the
        # hostile changes below are the only others, and what is fetched is exactly known.
        assert b.wait(job_dir, timeout=120).state.finished
        remote = tmp_path / "remote-base" / "hostile-remote"
        (remote / "config.yaml").write_text("name: theirs\nssh:\n  trust_unknown_host: true\n")
        (remote / "job.json").write_text('{"backend": "local"}')
        (remote / "state.json").write_text("{}")
        (remote / "out").mkdir(exist_ok=True)
        (remote / "out" / "ok.txt").write_text("fine\n")
        outside = tmp_path / "outside.txt"
        outside.write_text("untouched\n")
        (remote / "out" / "link").symlink_to(outside)  # a symlink is never followed
        (remote / "logs" / "escape").mkdir()
        (remote / "logs" / "escape" / "x.txt").write_text("x")
        (job_dir / "logs").mkdir(exist_ok=True)
        (job_dir / "logs" / "escape").symlink_to(tmp_path)  # a local symlink is not entered
        os.makedirs(os.fsencode(remote / "out") + b"/bad-\xff-name", exist_ok=True)
        (remote / "out" / ("n" * 240)).write_text("too long for a temporary suffix")
        # a checkpoint's DCP index is a dot file: none other comes back (a training job
        # fetched over SSH could never be gathered without it). Of checkpoints/, the folder
        # `latest` names, then `latest` (not the pruned or staging folders: a gather
        # --partial of a running job read half folders, or a latest naming none here)
        for name in ("step-0000001", "step-0000002", "step-0000003.tmp-feedface"):
            (remote / "checkpoints" / name).mkdir(parents=True)
            (remote / "checkpoints" / name / ".metadata").write_bytes(b"dcp")
        state = {"step": 2, "cursor": {}, "scheduler": {}, "run": {}}
        (remote / "checkpoints" / "step-0000002" / "train_state.json").write_text(json.dumps(state))
        (remote / "checkpoints" / "latest").write_text("step-0000002\n")
        (remote / "checkpoints" / ".metadata").write_bytes(b"not a checkpoint's")
        (remote / "logs" / ".metadata").write_bytes(b"not a checkpoint's")
        # what an earlier fetch brought (the job pruned it since), and a link here
        (job_dir / "checkpoints" / "step-0000001").mkdir(parents=True)
        (job_dir / "checkpoints" / "step-0000001" / ".metadata").write_bytes(b"dcp")
        (job_dir / "checkpoints" / "step-0000000").symlink_to(tmp_path)
        fetched = b.fetch(job_dir)
    checkpoints = [f for f in fetched if f.startswith("checkpoints/")]
    assert sorted(checkpoints[:-1]) == [
        "checkpoints/step-0000002/.metadata",
        "checkpoints/step-0000002/train_state.json",
    ]
    assert checkpoints[-1] == "checkpoints/latest"  # last: it names a folder already here
    # the local copy is the newest only: gigabytes a fetch otherwise (a link is not followed)
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-0000000",
        "step-0000002",
    ]
    assert outside.read_text() == "untouched\n"
    # latest naming a folder that did not arrive (the job moved on and pruned it there):
    # nothing here is pruned, the last whole checkpoint stays
    (remote / "checkpoints" / "latest").write_text("step-0000009\n")
    with SSHBackend(settings) as b:
        b.fetch(job_dir)
    assert (job_dir / "checkpoints" / "step-0000002" / "train_state.json").is_file()
    assert sorted(f for f in fetched if f not in checkpoints) == [
        f"logs/batch-{job_id}.out",
        "out/ok.txt",
    ], fetched
    assert (job_dir / "config.yaml").read_text() == "name: mine\n"
    assert json.loads((job_dir / "job.json").read_text())["backend"] == "ssh"
    assert not (job_dir / "state.json").exists()
    assert outside.read_text() == "untouched\n" and not (tmp_path / "x.txt").exists()
    assert not (job_dir / "out" / "link").exists()


def test_known_hosts_markers_are_honoured_not_fatal(settings, tmp_path, capsys):
    """Sites with host certificates have @cert-authority lines; @revoked keys are refused."""
    real = Path(settings.known_hosts).read_text().strip().splitlines()[0]
    host, keytype, key = real.split()[:3]
    marked = tmp_path / "marked_known_hosts"
    marked.write_text(
        f"@cert-authority *.example.org {keytype} {key}\n# a comment\n{real}\n"
        f"@revoked other.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyFakeKeyFakeKey\n"
    )
    with SSHBackend(replace(settings, known_hosts=str(marked))) as b:
        assert b.shell.run(["true"])[0] == 0
    assert "@cert-authority lines are not used" in capsys.readouterr().err
    revoked = tmp_path / "revoked_known_hosts"
    revoked.write_text(f"@revoked {host} {keytype} {key}\n")
    for trust in (False, True):  # revoked wins even over trust_unknown_host
        with pytest.raises(UserError, match="marked @revoked") as err:
            connect(replace(settings, known_hosts=str(revoked), trust_unknown_host=trust))
        assert "\n" not in str(err.value)


def test_revoked_key_refused_where_also_listed_plainly(settings, tmp_path, monkeypatch):
    """OpenSSH refuses a key marked @revoked even where another line (or file) lists it
    plainly ("REVOKED HOST KEY DETECTED"): an admin revokes it in the system file while the
    user's known_hosts still has it. Before the fix the plain line won and ssh connected."""
    import ringctl.backends.ssh as ssh_module

    real = Path(settings.known_hosts).read_text().strip().splitlines()[0]
    host, keytype, key = real.split()[:3]
    system = tmp_path / "ssh_known_hosts"  # stands for /etc/ssh/ssh_known_hosts
    monkeypatch.setattr(ssh_module, "SYSTEM_KNOWN_HOSTS", (str(system),))
    both = tmp_path / "both_known_hosts"  # the same file lists and revokes it
    both.write_text(f"{real}\n@revoked * {keytype} {key}\n")
    user = tmp_path / "user_known_hosts"
    user.write_text(f"{real}\n")
    home = tmp_path / "home"  # ssh.known_hosts unset: ~/.ssh/known_hosts and the system file
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"{real}\n")
    monkeypatch.setenv("HOME", str(home))
    cases = [(both, ""), (user, f"@revoked {host} {keytype} {key}\n")]
    cases.append((None, f"{host} {keytype} {key}\n@revoked * {keytype} {key}\n"))
    for known, system_text in cases:
        system.write_text(system_text)
        for trust in (False, True):
            cfg = replace(settings, known_hosts=known and str(known), trust_unknown_host=trust)
            with pytest.raises(UserError, match="marked @revoked in") as err:
                connect(cfg)
            where = str(both) if known == both else str(system)
            assert where in str(err.value) and "\n" not in str(err.value)
    system.write_text("")  # the same files without the revocation connect
    for known in (both.with_name("user_known_hosts"), None):
        connect(replace(settings, known_hosts=known and str(known))).close()
    assert "@revoked" not in (home / ".ssh" / "known_hosts").read_text()  # nothing recorded


def test_private_key_readable_by_others_is_refused(settings, tmp_path):
    loose = tmp_path / "loose_key"
    loose.write_bytes(Path(settings.key).read_bytes())
    loose.chmod(0o644)
    with pytest.raises(UserError, match="accessible by others.*chmod 600"):
        connect(replace(settings, key=str(loose)))


def _remote_job(settings, make_job_dir, tmp_path, name: str) -> tuple[Path, Path]:
    """(local job dir, its remote copy) without a submission: fetch finds the remote copy
    under remote_dir by the local directory's name, as after `submit`."""
    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name=name)
    remote = Path(settings.remote_dir) / name
    (remote / "out").mkdir(parents=True)
    (remote / "out" / "ok.txt").write_text("fine\n")
    return job_dir, remote


def test_fetch_follows_no_symlink_at_the_top_of_a_folder(settings, make_job_dir, tmp_path, capsys):
    """`attempts`, `logs`, `probes` or placement.json made a symlink on the login node brought
    back files from wherever it pointed (the folder was opened as a directory). Before the
    fix: attempts/secret.txt and logs/key.txt came back from outside the remote job."""
    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "linked-tops")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deeper").mkdir(parents=True)
    (elsewhere / "secret.txt").write_text("not the job's\n")
    (elsewhere / "deeper" / "key.txt").write_text("not the job's either\n")
    (remote / "attempts").symlink_to(elsewhere)
    (remote / "logs").symlink_to(elsewhere / "deeper")
    (remote / "probes").symlink_to(elsewhere / "missing")  # dangling
    (remote / "placement.json").symlink_to(elsewhere / "secret.txt")
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert fetched == ["out/ok.txt"]
    err = capsys.readouterr().err
    for top in ("attempts/", "logs/", "probes/", "placement.json"):
        assert f"did not fetch {top}: on the login node it is not a" in err, err
    assert err.count("(a symbolic link)") == 4
    assert not (job_dir / "attempts").exists() and not (job_dir / "placement.json").exists()
    assert list((job_dir / "logs").iterdir()) == []


def test_fetch_says_which_remote_entries_inside_a_folder_it_passes_over(
    settings, make_job_dir, tmp_path, capsys
):
    """A shard or log made a link (or a FIFO) on the login node was passed over without a
    word: gather then called it missing, nothing saying why. Still never followed."""
    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "linked-inside")
    (tmp_path / "secret.txt").write_text("not the job's\n")
    (remote / "out" / "shard.safetensors").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(remote / "out" / "pipe")
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert fetched == ["out/ok.txt"] and not (job_dir / "out" / "shard.safetensors").exists()
    err = capsys.readouterr().err
    assert "did not fetch out/shard.safetensors: on the login node it is a symbolic link" in err
    assert "did not fetch out/pipe: on the login node it is not a regular file" in err


def test_fetch_without_remote_latest_brings_the_newest_published_checkpoint(
    settings, make_job_dir, tmp_path, capsys
):
    """A login node's checkpoints/latest lost (or a kill between a folder's publish and
    latest's write) while published folders are there: a resume there takes the newest
    (CheckpointDir.unpointed), but fetch brought none, and a latest an earlier fetch left here
    named an older step, which gather read. Now the newest published folder comes back, said,
    and the stale latest and older folders here go."""
    from ringctl.train.checkpoint import CheckpointDir

    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "lost-latest")
    for name in ("step-0000002", "step-0000005", "step-0000009.tmp-feedface"):
        (remote / "checkpoints" / name).mkdir(parents=True)
        state = {"step": int(name[5:12]), "cursor": {}, "scheduler": {}, "run": {}}
        (remote / "checkpoints" / name / "train_state.json").write_text(json.dumps(state))
        (remote / "checkpoints" / name / ".metadata").write_bytes(b"dcp")
    (tmp_path / "step-0000007").mkdir()  # a link named as a later step is not a folder
    (remote / "checkpoints" / "step-0000007").symlink_to(tmp_path / "step-0000007")
    (remote / "checkpoints" / "step-00000008").mkdir()  # not a name publish writes
    # an earlier fetch's copy: step 2 and the latest that named it
    (job_dir / "checkpoints" / "step-0000002").mkdir(parents=True)
    (job_dir / "checkpoints" / "step-0000002" / ".metadata").write_bytes(b"dcp")
    (job_dir / "checkpoints" / "latest").write_text("step-0000002\n")
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert sorted(f for f in fetched if f.startswith("checkpoints/")) == [
        "checkpoints/step-0000005/.metadata",
        "checkpoints/step-0000005/train_state.json",
    ]
    assert "checkpoints/latest is missing on the login node" in capsys.readouterr().err
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == ["step-0000005"]
    assert CheckpointDir(job_dir / "checkpoints").latest().step == 5
    # (second reading) the login node lost step 5 too: the folder fetched is the copy here,
    # not the higher one an earlier fetch left (the fresh one was deleted, step 5 kept)
    shutil.rmtree(remote / "checkpoints" / "step-0000005")
    (job_dir / "checkpoints" / "latest").write_text("step-0000005\n")
    with SSHBackend(settings) as b:
        b.fetch(job_dir)
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == ["step-0000002"]
    assert CheckpointDir(job_dir / "checkpoints").latest().step == 2


def test_fetch_of_a_latest_that_names_no_step_leaves_no_older_one_here(
    settings, make_job_dir, tmp_path, capsys
):
    """(hostile-input review) The login node's checkpoints/latest holding no step name was
    passed over without a word: the latest an earlier fetch left here named step 2, and gather
    read it, exit 0. It comes as it is, said, and gather refuses it by name (as a resume there
    does). A folder here in latest's place (refused by the fetch) was taken for a login node
    with no latest: its removal raised IsADirectoryError after the files were written."""
    from ringctl.train.checkpoint import CheckpointDir

    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "garbage-latest")
    for name in ("step-0000002", "step-0000005"):
        for where in (remote, job_dir) if name == "step-0000002" else (remote,):
            (where / "checkpoints" / name).mkdir(parents=True)
            state = {"step": int(name[5:12]), "cursor": {}, "scheduler": {}, "run": {}}
            (where / "checkpoints" / name / "train_state.json").write_text(json.dumps(state))
            (where / "checkpoints" / name / ".metadata").write_bytes(b"dcp")
    (job_dir / "checkpoints" / "latest").write_text("step-0000002\n")
    (remote / "checkpoints" / "latest").write_text("garbage\n")
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert "checkpoints/latest" in fetched
    assert "checkpoints/latest on the login node names no checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a checkpoint name"):
        CheckpointDir(job_dir / "checkpoints").latest()
    # a folder in latest's place here, latest naming step 5 there: no IsADirectoryError
    (job_dir / "checkpoints" / "latest").unlink()
    (job_dir / "checkpoints" / "latest").mkdir()
    (remote / "checkpoints" / "latest").write_text("step-0000005\n")
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert "checkpoints/step-0000005/.metadata" in fetched
    assert "checkpoints/latest" not in fetched and (job_dir / "checkpoints" / "latest").is_dir()


def test_fetch_skips_a_file_that_went_away_while_fetching(
    settings, make_job_dir, tmp_path, capsys, monkeypatch
):
    """A requeued run's script moves the earlier logs while a fetch runs: a listed file is gone
    by the time it is read. Before the fix the FileNotFoundError ended the whole fetch and
    left logs/.rank-0.out.fetch.tmp behind."""
    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "racing-requeue")
    (remote / "logs").mkdir()
    for name in ("rank-0.out", "rank-1.out"):
        (remote / "logs" / name).write_text(f"{name}\n")
    listed = SSHBackend._fetchable

    def moved_meanwhile(self, rdir, *rest):
        for rpath, rel in listed(self, rdir, *rest):
            if rel == "logs/rank-0.out":
                os.unlink(rpath)  # after the listing, before the read
            yield rpath, rel

    monkeypatch.setattr(SSHBackend, "_fetchable", moved_meanwhile)
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert sorted(fetched) == ["logs/rank-1.out", "out/ok.txt"]
    assert "did not fetch logs/rank-0.out: it was removed or moved" in capsys.readouterr().err
    assert sorted(p.name for p in (job_dir / "logs").iterdir()) == ["rank-1.out"]  # no .tmp


def test_listing_a_remote_folder_is_empty_only_when_it_is_missing(settings, tmp_path):
    """SSHShell.listdir answered [] to every SFTP error: a logs/ that cannot be read looked
    like a job without logs. Now only a missing folder is [] (OpenSSH's sftp-server says "no
    such file" for a file or a link loop too); the rest is a one-line error. As root the test
    cannot be refused permission: a name too long for the file system stands in for it."""
    (tmp_path / "remote-file").write_text("not a folder\n")
    too_long = f"{tmp_path}/{'x' * 300}"
    with SSHBackend(settings) as b:
        assert b.shell.listdir(str(tmp_path / "absent")) == []
        assert b.shell.listdir(str(tmp_path / "remote-file")) == []
        with pytest.raises(UserError, match=f"listing {too_long}: ") as err:
            b.shell.listdir(too_long)
    assert "\n" not in str(err.value)


def test_revocations_in_known_hosts2_files_apply(settings, tmp_path, monkeypatch):
    """OpenSSH reads ~/.ssh/known_hosts2 and /etc/ssh/ssh_known_hosts2 by default too: a key
    revoked there is refused (before: only the first system file's revocations applied)."""
    import ringctl.backends.ssh as ssh_module

    real = Path(settings.known_hosts).read_text().strip().splitlines()[0]
    host, keytype, key = real.split()[:3]
    system = (tmp_path / "ssh_known_hosts", tmp_path / "ssh_known_hosts2")
    monkeypatch.setattr(ssh_module, "SYSTEM_KNOWN_HOSTS", tuple(map(str, system)))
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    revoked = f"@revoked * {keytype} {key}\n"
    for where in (home / ".ssh" / "known_hosts2", system[1]):
        where.write_text(revoked)
        for known in (settings.known_hosts, None):  # a configured file, or the default
            if known is None:
                (home / ".ssh" / "known_hosts").write_text(f"{real}\n")
            with pytest.raises(UserError, match=f"marked @revoked in {where}"):
                connect(replace(settings, known_hosts=known))
        where.write_text(f"{host} {keytype} {key}\n")  # listed plainly: no objection
        connect(settings).close()


def test_remote_copy_keeps_the_umask_of_the_job_directory(settings, tmp_path):
    """Under umask 077 the job directory and job.sh (env.vars: tokens) are private; their copy
    on the login node was made 0755 (and job.sh chmod 0755 again on resume)."""
    from ringctl.jobdir import JobDir

    previous = os.umask(0o077)
    try:
        job = JobDir.create(
            {"config.yaml": "name: x\n", "job.sh": "#!/bin/bash\nexport TOKEN=t\n"},
            target=tmp_path / "private-job",
            base=tmp_path,
            stem="private-job",
        )
    finally:
        os.umask(previous)
    remote = tmp_path / "remote-base" / "private-job"
    with SSHBackend(settings) as b:
        b._mkdirs(str(remote.parent))
        b._upload(job.path, str(remote))
        modes = {p.name: p.stat().st_mode & 0o777 for p in [remote, *remote.rglob("*")]}
        assert modes == {
            "private-job": 0o700,
            "logs": 0o700,
            "probes": 0o700,
            "out": 0o700,
            "config.yaml": 0o600,
            "job.sh": 0o700,
        }, modes
        b._resume_attempt = "1"
        b._prepare_resumed(job)
    assert (remote / "job.sh").stat().st_mode & 0o777 == 0o700
    assert (remote / "logs").stat().st_mode & 0o777 == 0o700


def test_revocation_in_the_users_known_hosts_applies_to_another_file(
    settings, tmp_path, monkeypatch
):
    """A key revoked in ~/.ssh/known_hosts is refused when ssh.known_hosts names another file
    that trusts it (before: that file alone was read, and the job was submitted)."""
    import ringctl.backends.ssh as ssh_module

    real = Path(settings.known_hosts).read_text().strip().splitlines()[0]
    keytype, key = real.split()[1:3]
    monkeypatch.setattr(ssh_module, "SYSTEM_KNOWN_HOSTS", ())
    home = tmp_path / "home"  # never the real ~/.ssh
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    user_file = home / ".ssh" / "known_hosts"
    user_file.write_text(f"@revoked * {keytype} {key}\n")
    for trust in (False, True):
        with pytest.raises(UserError, match=f"marked @revoked in {user_file}") as err:
            connect(replace(settings, trust_unknown_host=trust))
        assert "\n" not in str(err.value)
    user_file.write_text("")  # nothing revoked: the configured file's key is used
    connect(settings).close()


# --- from a read-only review of the SSH backend and gathering (each reproduced first) -------


def test_a_resume_replaces_a_remote_link_and_never_writes_through_it(settings, tmp_path):
    """The job can write its remote directory: config.yaml made a link to a file outside it
    sent the resume's upload (sftp.put) and chmod to that file. Now the upload is a new file
    renamed over the entry: the link is replaced, its target untouched."""
    from ringctl.jobdir import JobDir

    job = JobDir.create(
        {"config.yaml": "name: x\n", "job.sh": "#!/bin/bash\necho new\n"},
        target=tmp_path / "relinked",
        base=tmp_path,
        stem="relinked",
    )
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    remote = tmp_path / "remote-base" / "relinked"
    with SSHBackend(settings) as b:
        b._mkdirs(str(remote.parent))
        b._upload(job.path, str(remote))
        (remote / "config.yaml").unlink()
        (remote / "config.yaml").symlink_to(victim)
        b._resume_attempt = "1"
        b._prepare_resumed(job)
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o600
    assert not (remote / "config.yaml").is_symlink()
    assert (remote / "config.yaml").read_text() == "name: x\n"
    assert [p.name for p in remote.iterdir() if p.name.endswith(".upload")] == []


def test_logs_that_are_pipes_or_links_are_refused_not_read_forever(settings, tmp_path):
    """A rank log made a FIFO blocked `status` and the local supervisor forever; one linked to
    /dev/zero read until memory ran out (locally: MemoryError; over SFTP: for ever). Both
    shells now read a regular file only, at most the limit asked (the tail of stderr)."""
    from ringctl.backends.joblogs import rank_error
    from ringctl.backends.shell import LocalShell

    logs = tmp_path / "job" / "logs"
    logs.mkdir(parents=True)
    os.mkfifo(logs / "rank-0.err")
    (logs / "rank-1.err").symlink_to("/dev/zero")
    (logs / "rank-2.err").write_bytes(b"x" * (1 << 20) + b"\nValueError: the real cause\n")
    with SSHBackend(settings) as b:
        for shell in (LocalShell(), b.shell):
            for rank in (0, 1):
                with pytest.raises(UserError, match="not a regular file") as err:
                    rank_error(shell, str(tmp_path / "job"), rank)
                assert "\n" not in str(err.value)
            assert rank_error(shell, str(tmp_path / "job"), 2) == "ValueError: the real cause"
            tail = shell.read_from(str(logs / "rank-2.err"), limit=10, tail=True)
            assert tail == b"eal cause\n"


def test_fetch_bounds_what_it_reads_and_keeps_going_past_odd_entries(
    settings, make_job_dir, tmp_path, capsys, monkeypatch
):
    """A listed file swapped for a FIFO or a /dev/zero link after the listing hung or streamed
    for ever; a local folder in a file's place aborted the whole fetch and left a .tmp; local
    folders were created through a local link before the path was refused; a remote file
    larger than the local disk's free space was written until the disk filled."""
    import ringctl.backends.ssh as ssh_backend

    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "odd-entries")
    (remote / "logs").mkdir()
    for name in ("rank-0.out", "rank-1.out", "rank-2.out"):
        (remote / "logs" / name).write_text(f"{name}\n")
    (remote / "out" / "folder-here.txt").write_text("remote\n")
    (job_dir / "out" / "folder-here.txt").mkdir()
    (remote / "logs" / "sub" / "deeper").mkdir(parents=True)
    (remote / "logs" / "sub" / "deeper" / "f.txt").write_text("x\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (job_dir / "logs" / "sub").symlink_to(outside)
    listed = SSHBackend._fetchable

    def swapped_meanwhile(self, rdir, *rest):
        for rpath, rel in listed(self, rdir, *rest):
            if rel == "logs/rank-0.out":
                os.unlink(rpath)
                os.mkfifo(rpath)
            elif rel == "logs/rank-1.out":
                os.unlink(rpath)
                os.symlink("/dev/zero", rpath)
            yield rpath, rel

    monkeypatch.setattr(SSHBackend, "_fetchable", swapped_meanwhile)
    with SSHBackend(settings) as b:
        fetched = b.fetch(job_dir)
    assert sorted(fetched) == ["logs/rank-2.out", "out/ok.txt"]
    err = capsys.readouterr().err
    assert err.count("on the login node it is no longer a regular file") == 2, err
    assert "did not fetch out/folder-here.txt: its local path leaves" in err
    assert "did not fetch logs/sub/deeper/f.txt: its local path leaves" in err
    assert list(outside.iterdir()) == []  # nothing created through the local link
    assert not [p for p in job_dir.rglob("*.fetch.tmp")]

    (remote / "out" / "sparse.bin").touch()
    os.truncate(remote / "out" / "sparse.bin", 1 << 40)  # a terabyte that costs nothing
    monkeypatch.setattr(SSHBackend, "_fetchable", listed)
    with SSHBackend(settings) as b, pytest.raises(UserError, match=r"out/sparse.bin holds 1,0"):
        b.fetch(job_dir)
    assert not (job_dir / "out" / "sparse.bin").exists()
    assert not [p for p in job_dir.rglob("*.fetch.tmp")]
    assert ssh_backend.PREFETCH_REQUESTS <= 256  # paramiko's default has no bound


def test_a_fetch_interrupted_by_the_connection_is_one_line(settings, make_job_dir, tmp_path):
    """A connection that drops during a fetch raised paramiko's SSHException (not an OSError)
    as a traceback; a timeout said nothing (its message is empty). The two errors are raised
    where paramiko raises them (the SFTP client's calls; tests/test_ssh_faults.py cuts real
    connections at a chosen request). fetch asks first whether the job's directory is there
    (a link in its place), so that is where these land."""
    import paramiko

    job_dir, remote = _remote_job(settings, make_job_dir, tmp_path, "dropped")
    with SSHBackend(settings) as b:

        def dropped(*_args, **_kwargs):
            raise paramiko.SSHException("Server connection dropped: ")

        b.shell.sftp.lstat = dropped
        with pytest.raises(UserError, match="reading .*/dropped: Server connection dropped"):
            b.fetch(job_dir)

        def silent(*_args, **_kwargs):
            raise TimeoutError()

        b.shell.sftp.lstat = silent
        with pytest.raises(UserError, match=r"timed out \(no answer within"):
            b.fetch(job_dir)


def test_a_remote_dir_under_a_file_is_one_line(settings, make_job_dir, tmp_path):
    (tmp_path / "a-file").write_text("not a folder\n")
    job_dir = make_job_dir("#!/bin/bash\ntrue\n", name="under-a-file")
    bad = replace(settings, remote_dir=str(tmp_path / "a-file" / "jobs"))
    with SSHBackend(bad) as b, pytest.raises(UserError, match="ssh.remote_dir: cannot create"):
        b._prepare(job_dir)


# A line whose key does not decode (a truncated base64): paramiko raises InvalidHostKey, which
# is no SSHException.
UNDECODABLE = "old.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsab\n"


def test_an_undecodable_known_hosts_line_is_skipped(settings, tmp_path):
    """One such line in any known_hosts file read made every ssh connection a traceback
    (submit, status, logs, cancel, gather of every ssh job); OpenSSH skips it, and so does
    ringctl."""
    known = tmp_path / "known_hosts"
    known.write_text(UNDECODABLE + Path(settings.known_hosts).read_text())
    connect(replace(settings, known_hosts=str(known))).close()


def test_trusting_a_host_never_glues_its_key_onto_the_last_line(settings, tmp_path):
    """known_hosts without a final newline: the new entry was appended onto the last line, so
    the host pinned there lost its key (and the merged line broke every later connection)."""
    known = tmp_path / "known_hosts"
    pinned = "login.example.org " + Path(settings.known_hosts).read_text().split(" ", 1)[1]
    known.write_text(pinned.rstrip("\n"))  # no final newline
    connect(replace(settings, known_hosts=str(known), trust_unknown_host=True)).close()
    lines = known.read_text().splitlines()
    assert lines[0] == pinned.rstrip("\n") and lines[1].startswith(f"[127.0.0.1]:{settings.port} ")
    connect(replace(settings, known_hosts=str(known))).close()  # strict, and readable


@pytest.mark.parametrize(
    "remote, key",
    [
        ("login:/scratch/job", "remote"),
        (["x"], "remote"),
        ({"dir": 5}, "remote.dir"),
        ({"dir": "relative/dir"}, "remote.dir"),
        ({"dir": "/a\nb"}, "remote.dir"),
    ],
)
def test_a_damaged_remote_record_is_one_line(settings, tmp_path, remote, key):
    """job.json's `remote` as text (a hand edit) was an AttributeError traceback in status,
    logs, cancel and gather; a dir of another type or not absolute was used as it came."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"backend": "ssh", "remote": remote}))
    with pytest.raises(UserError, match=rf"job\.json: {key}: expected "):
        SSHBackend(settings).cluster_dir(job)


def test_a_job_whose_login_node_directory_is_gone_says_so(settings, make_job_dir, tmp_path):
    """The login node's copy moved or purged: status read every rank as ended without a
    result (FAILED), `logs` printed nothing, exit 0, and a resume (allowed on FAILED) made a
    new directory there and computed every document again."""
    job_dir = make_job_dir(
        f"#!/bin/bash\n#SBATCH --time=2\n{STARTING}srun {RANK_LOGS} echo hi\n", name="purged"
    )
    remote = tmp_path / "remote-base" / "purged"
    with SSHBackend(settings, poll_s=0.3) as b:
        b.submit(job_dir)
        assert b.wait(job_dir, timeout=120).state is JobState.COMPLETED
        remote.rename(tmp_path / "elsewhere")
        said = f"ssh {settings.target}: the job's directory {remote} is gone (moved, or purged)"
        st = b.status(job_dir)
        assert st.state is JobState.UNKNOWN and st.reason.startswith(said), st
        with pytest.raises(UserError, match="is gone"):
            list(b.logs(job_dir))
        from ringctl.jobdir import JobDir

        with pytest.raises(UserError, match="would compute every document again"):
            b.refuse_resume(JobDir(job_dir))  # resume_job asks before anything moves
        with pytest.raises(RemoteGone, match=re.escape(f"{said}: nothing was fetched")):
            b.fetch(job_dir)  # it said "fetched 0 file(s)", exit 0
        (tmp_path / "elsewhere").rename(remote)
        assert b.status(job_dir).state is JobState.COMPLETED
