"""What the command line does with hostile or unlucky surroundings (issue 19, "Low"): a full or
read-only disk, a reader that closes the pipe, control characters in logs and document ids,
formula-like CSV cells, NaN in a fetched progress file, a dangling symlink, the umask.

Each test runs the real verb (in this process, or as `python -m ringctl` where a terminal, a
pipe or a mount is the point) on a real job directory: a local job's control files, or a
long-document output written by the same ShardStore a job uses (one rank, contiguous layout).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringctl.atomic import atomic_write_json
from ringctl.cli import main
from ringctl.commands.jobs import follow_to_end, open_job_dir
from ringctl.config import load_job, to_yaml
from ringctl.jobdir import JobDir
from ringctl.longdoc.inputs.documents import doc_key
from ringctl.longdoc.output.names import FORMAT
from ringctl.longdoc.output.store import ShardStore
from tests.local_jobs import submitted_job_dir

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
ESCAPES = "hello \x1b]0;owned\x07 \x1b[31mred\x1b[0m\ttab \x9b2J end"


def _ringctl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringctl", *args], env=ENV, cwd=ROOT, **kw)


def _local_job(base: Path, log: str = "") -> Path:
    """A finished local job's directory, as `ringctl submit` leaves it, with rank 0's log."""
    files = {
        "config.yaml": to_yaml(load_job(SMOKE, [])),
        "job.sh": "#!/bin/bash\nexport HF_TOKEN=hf_secret\n",  # env.vars land here
        "job.json": '{"backend": "local"}',
    }
    job = JobDir.create(files, target=base / "job", base=base, stem="job")
    atomic_write_json(job.state_file, {"state": "COMPLETED", "started_at": 1.0, "ended_at": 3.5})
    (job.logs / "rank-0.out").write_text(log)
    return job.path


def _scored_output(base: Path, ids: list[str], n: int = 5, lp=None) -> Path:
    """A long-document score output of these documents (one rank), as a job writes it."""
    store = ShardStore(base)
    atomic_write_json(
        store.run_file, {"format": FORMAT, "world_size": 1, "task": "score", "layout": "contiguous"}
    )
    docs = [{"id": i, "key": doc_key(i), "source": "in.txt"} for i in ids]
    atomic_write_json(store.documents_file, {"documents": docs, "missing_inputs": []})
    if lp is None:
        lp = -(torch.arange(n) % 4).float() / 3  # -0.333...: numbers that begin with "-"
    for doc in docs:
        store.write_shard(
            doc=doc,
            rank=0,
            world_size=1,
            layout="contiguous",
            task="score",
            n_tokens=n,
            padded_tokens=n,
            stats={},
            seconds=0.25,
            tensors={
                "positions": torch.arange(n),
                "input_ids": torch.arange(n) + 7,
                "token_logprob": lp,
            },
        )
    return base


# ---- 2. a full or read-only disk: one line naming the path ---------------------------------------


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 4096)


def _one_line(err: str, path: Path, reason: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(path) in err and reason in err, err


@pytest.mark.parametrize("verb", ["submit", "run"])
def test_submit_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, verb):
    with _tmpfs(tmp_path / "disk", "size=64k") as disk:
        _fill(disk)
        assert main([verb, SMOKE, f"output_dir={disk}/runs"]) == 1
        _one_line(capsys.readouterr().err, disk / "runs", "No space left on device")
        assert list((disk / "runs").iterdir()) == []  # no half job directory


@pytest.mark.parametrize("force", [False, True])
def test_example_onto_a_full_disk_names_the_file(tmp_path, capsys, force):
    """The write of `ringctl example` failed on close, which names no file: the line said only
    "No space left on device"."""
    with _tmpfs(tmp_path / "disk", "size=64k") as disk:
        _fill(disk)
        if force:
            (disk / "smoke.yaml").write_text("")  # an empty file fits
        assert main(["example", "smoke", str(disk), *(["--force"] if force else [])]) == 1
        _one_line(capsys.readouterr().err, disk / "smoke.yaml", "No space left on device")
        assert (disk / "smoke.yaml").exists() is force  # no half copy of a new file


@pytest.mark.parametrize(
    ("options", "reason"),
    [("size=64k", "No space left on device"), ("ro", "Read-only file system")],
)
def test_gather_onto_a_full_or_read_only_disk_is_one_line(tmp_path, capsys, options, reason):
    job = _scored_output(tmp_path / "job", ["big.txt"], n=20000)  # 160 kB of token ids
    with _tmpfs(tmp_path / "disk", options) as disk:
        out = disk / "out" if options == "ro" else disk / "gathered"
        assert main(["gather", str(job), "-o", str(out)]) == 1
        _one_line(capsys.readouterr().err, out if options != "ro" else disk, reason)
        assert list(disk.iterdir()) == []  # the temporary output is gone too


# ---- 3. CSV cells a spreadsheet would run ------------------------------------------------------

FORMULAS = ['=HYPERLINK("http://x","y")', "+1+2", "-3.2", "@SUM(A1)", "\tx", "\rx", "'quoted"]


def _unquoted(cell: str) -> str:
    return cell[1:] if cell.startswith("'") else cell


def test_csv_text_cells_that_look_like_formulas_get_a_quote(tmp_path, capsys):
    ids = [*FORMULAS, "plain.txt", "a=b"]
    job = _scored_output(tmp_path / "job", ids)
    assert main(["gather", str(job), "-o", str(tmp_path / "g"), "--format", "csv"]) == 0
    with open(tmp_path / "g" / "summary.csv", newline="", encoding="utf-8") as f:
        summary = list(csv.DictReader(f))
    with open(tmp_path / "g" / "tokens.csv", newline="", encoding="utf-8") as f:
        tokens = list(csv.DictReader(f))
    for cells in (
        [r["document"] for r in summary],
        list(dict.fromkeys(r["doc_id"] for r in tokens)),
    ):
        assert cells == [f"'{i}" for i in FORMULAS] + ["plain.txt", "a=b"]
        assert [_unquoted(c) for c in cells] == ids  # one quote dropped: the id again
    assert summary[0]["log_likelihood"].startswith("-")  # numbers stay numbers
    assert {r["token_logprob"] for r in tokens[:3]} == {"", "-0.0", "-0.3333333432674408"}
    json_ids = [
        d["document"]
        for d in json.loads((tmp_path / "g" / "summary.json").read_text())["documents"]
    ]
    assert json_ids == ids  # JSON is not a spreadsheet: unchanged


def test_pooled_csv_quotes_ids_not_vectors(tmp_path):
    from types import SimpleNamespace

    from ringctl.longdoc.output import export

    doc = SimpleNamespace(
        doc_id="-x", tensors={"input_ids": torch.arange(3), "pooled": torch.tensor([-1.5, 2.0])}
    )
    export.write_table(tmp_path, "csv", "embed", [doc])
    rows = (tmp_path / "pooled.csv").read_text().splitlines()
    assert rows[1] == "'-x,3,-1.5,2.0"


# ---- 4. status --json: strict JSON, checked fields ---------------------------------------------


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_status_json_is_strict_and_names_what_it_dropped(tmp_path, capsys):
    job = _local_job(tmp_path)
    logs = job / "logs"
    (logs / "progress.json").write_text('{"done": 3, "total": 7, "eta_s": NaN, "rate": Infinity}')
    (logs / "rings").mkdir()
    (logs / "rings" / "a.json").write_text('{"done": 1, "total": 4, "eta_s": -Infinity}')
    (logs / "rings" / "b.json").write_text('{"done": 2, "total": 3, "members": [0, 1]}')
    assert main(["status", str(job), "--json"]) == 0
    (row,) = _strict(capsys.readouterr().out)
    assert row["progress"] == {
        "done": 3,
        "total": 7,
        "unit": "documents",
        "rings": 2,
        "rings_done": 0,
        "eta_s": None,
    }
    assert row["rings"][0]["eta_s"] is None and row["rings"][1]["members"] == [0, 1]
    assert row["notes"] == [f"{logs}/rings/a.json: eta_s: not a finite number; shown as null"]
    shutil.rmtree(logs / "rings")
    assert main(["status", str(job), "--json"]) == 0
    (row,) = _strict(capsys.readouterr().out)
    assert row["progress"]["done"] == 3 and row["progress"]["eta_s"] is None
    assert row["progress"]["rate"] is None and len(row["notes"]) == 2


def test_summary_json_is_strict_with_an_impossible_token(tmp_path, capsys):
    """A token the model gave probability 0 (log-probability -inf) made the document's
    log_likelihood -Infinity and its perplexity Infinity: bare words summary.json's readers
    (jq, JSON.parse) refuse. Now null, and the file's notes say where."""
    lp = torch.tensor([-0.5, float("-inf"), -1.0, 0.0, -2.0])
    job = _scored_output(tmp_path / "job", ["zero.txt"], lp=lp)
    assert main(["gather", str(job), "-o", str(tmp_path / "g")]) == 0
    assert "summary.json: 2 non-finite value(s) written as null" in capsys.readouterr().out
    summary = _strict((tmp_path / "g" / "summary.json").read_text())
    (doc,) = summary["documents"]
    assert doc["log_likelihood"] is None and doc["perplexity"] is None and doc["tokens"] == 5
    assert summary["notes"] == [
        "documents[0].log_likelihood: not a finite number; written as null",
        "documents[0].perplexity: not a finite number; written as null",
    ]


@pytest.mark.parametrize("as_json", [True, False])
def test_status_survives_wrong_types_in_progress_files(tmp_path, capsys, as_json):
    job = _local_job(tmp_path)
    logs = job / "logs"
    (logs / "rings").mkdir()
    (logs / "rings" / "a.json").write_text('{"done": "1", "total": 4}')
    (logs / "rings" / "b.json").write_text('{"done": 1, "total": 3, "members": "all", "unit": 5}')
    (logs / "rings" / "c.json").write_text('{"done": 1e999, "total": 3, "eta_s": "soon"}')
    (logs / "progress.json").write_text("[1, 2]")
    assert main(["status", str(job), *(["--json"] if as_json else [])]) == 0
    out, err = capsys.readouterr()
    notes = [
        f"{logs}/rings/a.json: done='1': not a count; shown as null",
        f"{logs}/rings/a.json: no done/total counts; progress not shown",
        f"{logs}/rings/b.json: members='all': not a list of ranks; shown as null",
        f"{logs}/rings/b.json: unit=5: not a string; shown as null",
        f"{logs}/rings/c.json: done: not a finite number; shown as null",
        f"{logs}/rings/c.json: eta_s='soon': not a number >= 0; shown as null",
        f"{logs}/rings/c.json: no done/total counts; progress not shown",
        f"{logs}/progress.json: not a JSON object; ignored",
    ]
    if as_json:
        (row,) = _strict(out)
        assert row["notes"] == notes and row["progress"] is None
        assert row["rings"] == [{"done": 1, "total": 3, "members": None, "unit": None, "ring": "b"}]
    else:
        assert "COMPLETED" in out and err == "".join(f"note: {n}\n" for n in notes)


# ---- 5. and 6. control characters: logs on a terminal, ids in tables ---------------------------


def _on_a_terminal(*args: str) -> bytes:
    """What `ringctl ARGS` writes to a real terminal (a pty)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringctl", *args],
            env=ENV,
            cwd=ROOT,
            stdout=slave,
            stderr=subprocess.PIPE,
        )
        os.close(slave)
        chunks = []
        with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        os.close(master)
    return b"".join(chunks)


def test_logs_escape_control_characters_on_a_terminal_only(tmp_path):
    job = _local_job(tmp_path, log=ESCAPES + "\nsecond line\n")
    shown = _on_a_terminal("logs", str(job))
    assert b"\x1b" not in shown and b"\x07" not in shown and "\x9b".encode() not in shown
    assert b"hello \\x1b]0;owned\\x07 \\x1b[31mred\\x1b[0m\ttab \\x9b2J end" in shown
    assert b"second line" in shown
    piped = _ringctl("logs", str(job), capture_output=True, check=True).stdout
    assert piped.decode() == f"[rank 0] {ESCAPES}\n[rank 0] second line\n"  # as written


def test_gather_table_shows_control_characters_as_escapes(tmp_path, capsys):
    ids = ["a\nb.txt", "x\x1b[31mred.txt", "\u202eevil.txt"]
    job = _scored_output(tmp_path / "job", ids)
    assert main(["gather", str(job), "-o", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    rows = [line for line in out.splitlines() if "│" in line and "0.25" in line]
    assert len(rows) == 3, out  # one row per document: no id split over two lines
    assert "a\\nb.txt" in rows[0] and "x\\x1b[31mred.txt" in rows[1] and "\\u202eevil" in rows[2]


def test_status_table_shows_control_characters_as_escapes(tmp_path, capsys):
    job = _local_job(tmp_path)
    atomic_write_json(job / "state.json", {"state": "FAILED", "reason": "boom\x1b[2J\nsecond"})
    assert main(["status", str(job)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "boom\\x1b[2J\\nsecond" in out


def test_run_and_resume_print_the_final_reason_escaped(tmp_path, capsys):
    """`ringctl run`/`resume -f` end with the job's reason, which carries a rank's error line
    (remote-writable on a cluster): it was printed raw to stderr, escapes and all."""
    job = _local_job(tmp_path)
    reason = "rank 0 exited 1: boom\x1b]0;owned\x07\x1b[2J\nsecond \u202eevil"
    atomic_write_json(job / "state.json", {"state": "FAILED", "reason": reason})
    _, _, backend = open_job_dir(job)
    assert follow_to_end(job, "local-1", backend, rank=0) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and err.count("\n") == 1, err
    assert "job local-1 FAILED: rank 0 exited 1: boom\\x1b]0;owned\\x07\\x1b[2J\\nsecond" in err
    assert "\\u202eevil" in err


# ---- 6. example: never through a symlink -------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
def test_example_refuses_a_symlink_dangling_or_not(tmp_path, capsys, force):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "smoke.yaml").symlink_to(elsewhere / "new.yaml")  # dangling
    flags = ["--force"] if force else []
    assert main(["example", "smoke", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smoke.yaml is a symbolic link; refused" in err
    assert list(elsewhere.iterdir()) == []  # nothing was created where the link points
    (elsewhere / "new.yaml").write_text("mine\n")  # now it points at a file
    assert main(["example", "smoke", str(tmp_path), *flags]) == 2
    assert (elsewhere / "new.yaml").read_text() == "mine\n"
    (tmp_path / "smoke.yaml").unlink()
    assert main(["example", "smoke", str(tmp_path)]) == 0  # a plain new file is written
    assert (tmp_path / "smoke.yaml").read_text() == Path(SMOKE).read_text()


# ---- 7. files follow the umask -----------------------------------------------------------------


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in root.rglob("*")}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_shards_and_gather_outputs_follow_the_umask(tmp_path, capsys, umask):
    previous = os.umask(umask)
    try:
        job = _scored_output(tmp_path / "job", ["a.txt", "b.txt"])
        assert main(["gather", str(job), "-o", str(tmp_path / "g"), "--format", "csv"]) == 0
        local = _local_job(tmp_path / "local")
    finally:
        os.umask(previous)
    for root in (job / "longdoc", tmp_path / "g"):
        modes = _modes(root)
        files = {p: m for p, m in modes.items() if (root / p).is_file()}
        dirs = {p: m for p, m in modes.items() if (root / p).is_dir()}
        assert len(files) >= 6 and set(files.values()) == {0o666 & ~umask}, files
        assert set(dirs.values()) == {0o777 & ~umask}, dirs
    assert (local / "config.yaml").stat().st_mode & 0o777 == 0o666 & ~umask
    # the job directory and its folders as mkdir would make them; job.sh (env.vars: tokens)
    # executable but no more readable than the umask allows (it was 0755 whatever the umask)
    for path in (local, local / "logs", local / "probes", local / "out", local / "job.sh"):
        assert path.stat().st_mode & 0o777 == 0o777 & ~umask, path


def test_resumed_job_script_follows_the_umask(tmp_path, capsys):
    """A resume with overrides rewrites job.sh: it was chmod 0755 whatever the umask."""
    previous = os.umask(0o077)
    try:
        quick = ["nodes=1", "env.python=/bin/true"]  # ranks that exit at once
        assert main(["submit", SMOKE, f"output_dir={tmp_path}", *quick]) == 0
        job = submitted_job_dir(capsys.readouterr().out)
        _, _, backend = open_job_dir(job)
        assert backend.wait(job, timeout=60, poll_s=0.2).state.finished
        assert main(["resume", str(job), "timeout=61"]) == 0, capsys.readouterr().err
        assert backend.wait(job, timeout=60, poll_s=0.2).state.finished
    finally:
        os.umask(previous)
    assert "timeout: 61" in (job / "config.yaml").read_text()  # rewritten by the resume
    assert (job / "job.sh").stat().st_mode & 0o777 == 0o700
    assert job.stat().st_mode & 0o777 == 0o700


# ---- 8. a closed pipe ------------------------------------------------------------------------


def test_a_reader_that_leaves_ends_the_verb_quietly_with_141(tmp_path):
    job = _local_job(tmp_path, log="".join(f"line {i:06d} {'x' * 60}\n" for i in range(40000)))
    writer = subprocess.Popen(
        [sys.executable, "-m", "ringctl", "logs", str(job)],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    head = subprocess.run(["head", "-1"], stdin=writer.stdout, capture_output=True, check=True)
    writer.stdout.close()
    assert head.stdout == b"[rank 0] line 000000 " + b"x" * 60 + b"\n"
    assert writer.wait(timeout=60) == 141  # 128 + SIGPIPE, as for `yes | head`
    assert writer.stderr.read() == b""  # no traceback, no "Exception ignored"
