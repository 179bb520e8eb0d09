"""Every name in a job directory comes from ringctl.jobdir, and a file's writer and reader ask
for it by the same method.

Before, `schedule.json`, `logs/rings/<label>.json`, `logs/rank-<R>.result.json`, `config.yaml`,
`out/` and the remote copy's `logs`/`attempts`/`config.yaml`/`job.sh` were joined by hand in
the worker, the tasks, the status verb, the log reader and the SSH backend (one writer and its
reader in different modules, each with its own literal). The scan below reads the source with
`ast`, so a docstring or an error message naming a file is not a join; a bare name as a string
or a folder name joined with `/` or `*.path.join` is.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ringctl import jobdir
from ringctl.backends import joblogs
from ringctl.jobdir import JobDir

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "config.yaml",
    "job.sh",
    "job.json",
    "state.json",
    "supervisor.pid",
    "placement.json",
    "schedule.json",
    "progress.json",
    "result.json",
    "supervisor.log",
}
FOLDERS = {"logs", "out", "probes", "attempts", "rings", "gathered"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _joined(node: ast.AST) -> list[ast.AST]:
    """The operands a path is built from: `a / b`, os.path.join(...), posixpath.join(...)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.left, node.right]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "join" and getattr(node.func.value, "id", "") != "str":
            return list(node.args)
    return []


def _hand_joined(path: Path) -> list[tuple[str, str, int]]:
    """(file, name, line) of each job-directory name built by hand in one module."""
    tree = ast.parse(path.read_text())
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        for part in _joined(node):
            if isinstance(part, ast.Constant) and part.value in FOLDERS | FILES:
                found.append((str(path.relative_to(ROOT)), part.value, node.lineno))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if (
                text in FILES
                or text.startswith(("logs/", "out/", "attempts/"))
                or (text.endswith("result.json") and text != "result.json")
            ):
                found.append((str(path.relative_to(ROOT)), text, node.lineno))
    return found


def test_no_job_directory_name_is_joined_outside_jobdir():
    paths = sorted((ROOT / "ringctl").rglob("*.py"))
    found = [hit for p in paths if p.name != "jobdir.py" for hit in _hand_joined(p)]
    allowed = {
        ("ringctl/commands/plan.py", "schedule.json"),  # the --schedule metavar, for --help
        (
            "ringctl/longdoc/inputs/saved.py",
            "state.json",
        ),  # a saved HF dataset's file, not the job's
        ("ringctl/train/export.py", "gathered"),  # to ask JobDir.gathered (the lead's file)
    }
    assert [hit for hit in found if hit[:2] not in allowed] == []


def test_the_reader_and_the_writer_of_a_file_name_it_alike(tmp_path):
    """The relative names the remote side joins are the local paths, name for name."""
    job = JobDir(tmp_path)
    assert job.rank_result(3) == tmp_path / jobdir.rank_log_name(3, jobdir.RESULT)
    assert job.rank_result(3).name == jobdir.rank_log_file(3, jobdir.RESULT)
    assert job.ring_progress("ring 2") == tmp_path / "logs" / "rings" / "ring-2.json"
    assert job.progress == tmp_path / "logs" / "progress.json"
    assert job.schedule == tmp_path / "schedule.json"
    assert job.supervisor_log == tmp_path / "logs" / "supervisor.log"
    assert job.gathered == tmp_path / "gathered"
    for ext in ("out", "err"):  # what joblogs lists is what the ranks' logs are named
        assert jobdir.rank_stream_of(job.rank_log(12, ext).name) == (12, ext)
    assert jobdir.rank_stream_of(job.rank_result(12).name) is None
    for name in (*jobdir.FETCHED_DIRS, *jobdir.ARCHIVED_ON_RESUME, *jobdir.RESENT_ON_RESUME):
        assert (tmp_path / name).parent == tmp_path  # one component, joined on either side
    for label in ("a", "ring-2", "x.json"):  # status reads the labels the leads wrote
        assert jobdir.ring_progress_label(job.ring_progress(label).name) == label
    for other in (".tmp.json", ".json", "a.json.tmp", "a"):  # a half-written file, others
        assert jobdir.ring_progress_label(other) is None


def test_the_worker_s_results_are_listed_by_the_names_it_writes(tmp_path, monkeypatch):
    """joblogs lists logs/ for the files the worker writes (worker.write_result): a rank
    without a result, a rank whose result says FAILED (its `.failed` mark: what a listing
    sees where a wrapper swallowed the exit), and reads the error the worker recorded."""
    from ringctl.backends.shell import LocalShell
    from ringctl.worker import write_result

    monkeypatch.delenv("SLURM_PROCID", raising=False)
    JobDir(tmp_path).logs.mkdir()
    for rank, record in ((1, {"state": "FAILED", "error": "ValueError: bad"}), (3, {})):
        monkeypatch.setenv("RANK", str(rank))  # no identity: the worker's index is RANK
        write_result(tmp_path, None, record)
    listing = joblogs.list_results(LocalShell(), str(tmp_path), 4)
    assert (listing.missing, listing.failed) == ([0, 2], [1])
    assert joblogs.rank_error(LocalShell(), str(tmp_path), 1) == "ValueError: bad"


def test_a_rank_log_name_takes_ascii_digits_only():
    """`rank-٣.out` (an Arabic-Indic three) on a login node was shown as rank 3's log beside
    the real rank 3's (`\\d` matches any Unicode digit and int() reads it)."""
    assert jobdir.rank_stream_of("rank-3.out") == (3, "out")
    assert jobdir.rank_stream_of("rank-\u0663.out") is None
