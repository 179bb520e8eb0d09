"""`ringctl gather --format`, the loss-by-position curve and `--partial`, on real job outputs.

One spawn (2 gloo processes) runs a score job and an embed job over the inputs of
test_gather.py (a 330-byte document, a 1-byte one, an empty one, ...). The tables are checked
value for value against the docs/*.safetensors files (exact equality: CSV floats are written
with their round-trip repr, Parquet stores float32), the curve against a direct float64
computation from those files (math.fsum per bucket; the tool sums with torch in another order:
<= 1e-12 relative, far above float64 rounding of a few hundred terms of size <= 20 and far
below any real error), and --partial against a job directory with one document's rank-1 entry
missing and a live local supervisor (a real process the local backend reports RUNNING).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ringctl.errors import UserError
from ringctl.longdoc.output import export
from ringctl.longdoc.output.curve import LossCurve, bucket_of
from ringctl.longdoc.output.gather import gather
from tests.distributed import run_distributed
from tests.test_gather import DOC_IDS, _cli, _copy_job, _make_inputs, _real_job_dir

EXACT_MEAN_TOL = 1e-12


def _jobs(rank: int, world: int, base: str, inputs: list[str]) -> dict:
    from ringctl.longdoc.run import run_longdoc

    def run(params: dict, out: str):
        return run_longdoc(params, rank, world, None, Path(base) / out, lambda _: None)

    run({"inputs": inputs, "chunk_size": 7}, "score/out")
    run({"inputs": inputs, "task": "embed"}, "embed/out")
    return {}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("longdoc-out")
    inputs = _make_inputs(base)
    run_distributed(_jobs, 2, str(base), inputs)
    return {"base": base, "inputs": inputs}


def _docs(out: Path) -> dict[str, dict]:
    """doc id -> its docs/*.safetensors tensors, in summary order."""
    summary = json.loads((out / "summary.json").read_text())
    return {row["document"]: load_file(out / row["file"]) for row in summary["documents"]}


# --- tables --------------------------------------------------------------------------------------


def _check_token_rows(docs: dict, rows: dict[str, list[tuple]]) -> None:
    """rows: doc id -> [(position, token_id, token_logprob or None)], as read back."""
    assert list(rows) == [d for d in docs if docs[d]["input_ids"].numel()]
    for doc_id, t in docs.items():
        got = rows.get(doc_id, [])
        n = t["input_ids"].numel()
        assert [r[0] for r in got] == list(range(n)), doc_id
        assert torch.equal(torch.tensor([r[1] for r in got], dtype=torch.int64), t["input_ids"])
        if n:
            assert got[0][2] is None  # nothing predicts position 0
        values = torch.tensor([r[2] for r in got[1:]], dtype=torch.float32)
        assert torch.equal(values, t["token_logprob"]), doc_id  # exact, not close


def _read_tokens_csv(path: Path) -> dict[str, list[tuple]]:
    rows: dict[str, list[tuple]] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == ["doc_id", "position", "token_id", "token_logprob"]
        for doc_id, pos, tok, lp in reader:
            rows.setdefault(doc_id, []).append((int(pos), int(tok), float(lp) if lp else None))
    return rows


def _read_tokens_parquet(path: Path) -> dict[str, list[tuple]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.schema.field("position").type == pa.int64()
    assert table.schema.field("token_id").type == pa.int64()
    assert table.schema.field("token_logprob").type == pa.float32()
    rows: dict[str, list[tuple]] = {}
    for r in table.to_pylist():
        rows.setdefault(r["doc_id"], []).append((r["position"], r["token_id"], r["token_logprob"]))
    return rows


def test_token_tables_equal_the_safetensors_values(jobs: dict, tmp_path: Path, capsys) -> None:
    job = jobs["base"] / "score"
    assert _cli([str(job), "-o", str(tmp_path / "csv"), "--format", "csv"]) == 0
    assert "tokens.csv" in capsys.readouterr().out
    docs = _docs(tmp_path / "csv")
    assert list(docs) == DOC_IDS
    _check_token_rows(docs, _read_tokens_csv(tmp_path / "csv" / "tokens.csv"))

    pytest.importorskip("pyarrow")
    assert _cli([str(job), "-o", str(tmp_path / "pq"), "--format", "parquet"]) == 0
    pq_docs = _docs(tmp_path / "pq")
    assert all(torch.equal(pq_docs[d]["token_logprob"], docs[d]["token_logprob"]) for d in docs)
    _check_token_rows(docs, _read_tokens_parquet(tmp_path / "pq" / "tokens.parquet"))


def test_tables_cross_slice_boundaries(tmp_path: Path) -> None:
    """Tables are written 65536 rows at a time; a long document crosses those boundaries (the
    real documents above are too short to)."""
    n = 2 * export._SLICE + 11
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50000, (n,), generator=gen)
    lp = -torch.rand(n - 1, generator=gen, dtype=torch.float32) * 12
    long = SimpleNamespace(doc_id="long", tensors={"input_ids": ids, "token_logprob": lp})
    docs = {"long": long.tensors}
    export.write_table(tmp_path, "csv", "score", [long])
    _check_token_rows(docs, _read_tokens_csv(tmp_path / "tokens.csv"))
    pytest.importorskip("pyarrow")
    export.write_table(tmp_path, "parquet", "score", [long])
    _check_token_rows(docs, _read_tokens_parquet(tmp_path / "tokens.parquet"))


def test_embed_tables_hold_the_pooled_vectors(jobs: dict, tmp_path: Path, capsys) -> None:
    job = jobs["base"] / "embed"
    assert _cli([str(job), "-o", str(tmp_path / "csv"), "--format", "csv"]) == 0
    assert "per-token hidden states stay in docs/" in capsys.readouterr().out
    docs = _docs(tmp_path / "csv")
    width = next(iter(docs.values()))["pooled"].numel()
    with (tmp_path / "csv" / "pooled.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["doc_id", "tokens", *(f"pooled_{j}" for j in range(width))]
    assert [r[0] for r in rows[1:]] == list(docs)
    for r in rows[1:]:
        t = docs[r[0]]
        assert int(r[1]) == t["input_ids"].numel()
        got = torch.tensor([float(v) for v in r[2:]], dtype=torch.float32)
        assert torch.equal(got, t["pooled"]) or (got.isnan().all() and t["pooled"].isnan().all())
    assert not (tmp_path / "csv" / export.CURVE_JSON).exists()  # no loss without scores

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    assert _cli([str(job), "-o", str(tmp_path / "pq"), "--format", "parquet"]) == 0
    table = pq.read_table(tmp_path / "pq" / "pooled.parquet")
    assert table.schema.field("pooled").type == pa.list_(pa.float32(), width)
    for r in table.to_pylist():
        got, want = torch.tensor(r["pooled"], dtype=torch.float32), docs[r["doc_id"]]["pooled"]
        assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())


def test_refusals_name_the_reason(jobs: dict, tmp_path: Path, capsys, monkeypatch) -> None:
    job, _ = _copy_job(jobs, tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    assert _cli([str(job), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "--format parquet needs pyarrow" in err and "pip install pyarrow" in err
    assert len(err.strip().splitlines()) == 1 and not (job / "gathered").exists()
    with pytest.raises(UserError, match="choose one of safetensors, parquet, csv"):
        gather(job, fmt="xlsx")
    from ringctl.commands.gather import FORMATS

    assert FORMATS == export.FORMATS  # the verb's choices (kept apart to import nothing)


# --- the loss curve ------------------------------------------------------------------------------


def test_bucket_edges_are_exact_powers_of_two() -> None:
    positions = [1, 2, 3, 4, 7, 8, 255, 256, 1023, 1024, (1 << 20) - 1, 1 << 20]
    got = bucket_of(torch.tensor(positions)).tolist()
    assert got == [p.bit_length() - 1 for p in positions]


def test_loss_curve_equals_a_direct_computation(jobs: dict, tmp_path: Path) -> None:
    result = gather(jobs["base"] / "score", tmp_path / "out")
    out = tmp_path / "out"
    docs = _docs(out)
    record = json.loads((out / export.CURVE_JSON).read_text())
    assert record["partial"] is False and record["documents"] == len(DOC_IDS)
    lps = {d: t["token_logprob"].double().tolist() for d, t in docs.items()}
    assert record["tokens"] == sum(len(v) for v in lps.values())
    longest = max(len(v) for v in lps.values())  # positions 1 .. longest
    assert len(record["buckets"]) == longest.bit_length()
    for k, b in enumerate(record["buckets"]):
        assert (b["first"], b["last"]) == (2**k, 2 ** (k + 1) - 1)
        # token_logprob[i] predicts position i + 1
        nll = [
            -v[p - 1] for v in lps.values() for p in range(b["first"], b["last"] + 1) if p <= len(v)
        ]
        reaching = sum(1 for v in lps.values() if len(v) >= b["first"])
        assert (b["tokens"], b["documents"]) == (len(nll), reaching)
        assert b["mean_nll"] == pytest.approx(math.fsum(nll) / len(nll), rel=EXACT_MEAN_TOL)
    assert export.CURVE_JSON in result.files
    pytest.importorskip("matplotlib")
    png = (out / export.CURVE_PNG).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (700, 500)  # figsize 7x5 at 100 dpi


def test_curve_accumulates_across_documents() -> None:
    """Two documents of different lengths: each bucket is the mean over every token in it."""
    curve = LossCurve()
    curve.add(torch.tensor([-1.0, -2.0, -3.0]))  # positions 1, 2, 3
    curve.add(torch.tensor([-5.0]))  # position 1
    curve.add(torch.zeros(0))  # an empty or 1-token document: counted, no tokens
    got = [(b["first"], b["tokens"], b["documents"], b["mean_nll"]) for b in curve.buckets()]
    assert got == [(1, 2, 2, 3.0), (2, 2, 1, 2.5)] and curve.documents == 3


def test_an_infinite_loss_is_reported_as_null() -> None:
    """A log-probability of -inf (a token the model gives probability 0) makes its bucket's
    mean infinite: null in the JSON (json.dumps would write the invalid `Infinity`)."""
    curve = LossCurve()
    curve.add(torch.tensor([-1.0, float("-inf")]))
    assert [b["mean_nll"] for b in curve.buckets()] == [1.0, None]
    json.loads(json.dumps(curve.record(partial=False), allow_nan=False))


def test_png_skipped_with_a_note_without_matplotlib(
    jobs: dict, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _cli([str(jobs["base"] / "score"), "-o", str(tmp_path / "out")]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "loss-by-position.png not drawn: matplotlib is missing" in shown
    assert "pip install matplotlib" in shown
    assert (tmp_path / "out" / export.CURVE_JSON).is_file()
    assert not (tmp_path / "out" / export.CURVE_PNG).exists()


# --- --partial -----------------------------------------------------------------------------------


def _running(job: Path) -> subprocess.Popen:
    """A live process the local backend takes for the job's supervisor, and state RUNNING."""
    from ringctl.backends.local import ProcessRecord
    from ringctl.jobdir import JobDir

    marker = f"supervise {job.resolve()}"
    argv = [sys.executable, "-c", "import time; time.sleep(300)", *marker.split(" ", 1)]
    proc = subprocess.Popen(argv)  # the marker's words as whole arguments, as a supervisor's
    deadline = time.monotonic() + 10
    record = ProcessRecord.of(proc.pid, marker)
    while not record.alive() and time.monotonic() < deadline:  # until exec has happened
        time.sleep(0.05)
        record = ProcessRecord.of(proc.pid, marker)
    (job / "supervisor.pid").write_text(json.dumps(asdict(record)) + "\n")
    JobDir(job).write_state({"state": "RUNNING", "started_at": time.time(), "ranks": {}})
    return proc


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_partial_gather_of_a_running_job(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.jobdir import JobDir
    from ringctl.longdoc.inputs.documents import doc_key

    job = _real_job_dir(jobs, tmp_path, "jobs/longdoc.yaml", "running")
    entry = job / "out/longdoc/shards" / doc_key("docs.jsonl#1") / "rank-00001.json"
    kept = entry.read_bytes()
    entry.unlink()  # rank 1 has not written this document yet
    proc = _running(job)
    try:
        assert _cli([str(job)]) == 3  # without --partial: as before
        assert str(entry) in capsys.readouterr().err and not (job / "gathered").exists()
        assert _cli([str(job), "--partial", "--format", "csv"]) == 0
    finally:
        proc.kill()
        proc.wait()
    shown = " ".join(capsys.readouterr().out.split())
    assert "partial: 4 of 5 documents complete" in shown and "docs.jsonl#1" in shown
    assert "the job is still RUNNING" in shown and "again when it ends" in shown
    out = job / "gathered"
    summary = _summary(out)
    assert summary["partial"] is True and summary["job_state"] == "RUNNING"
    assert [r["document"] for r in summary["documents"]] == [
        d for d in DOC_IDS if d != "docs.jsonl#1"
    ]
    (left,) = summary["incomplete"]
    assert left["document"] == "docs.jsonl#1" and "rank 1's manifest entry" in left["reason"]
    assert json.loads((out / ".ringctl-gather").read_text())["partial"] is True
    assert json.loads((out / export.CURVE_JSON).read_text())["partial"] is True
    assert "docs.jsonl#1" not in _read_tokens_csv(out / "tokens.csv")
    with (out / "summary.csv").open(newline="") as f:
        status = {r["document"]: r["status"] for r in csv.DictReader(f)}
    assert status["docs.jsonl#1"].startswith("incomplete: ") and status["one.txt"] == "complete"

    # Replacing a partial output takes the job's lock, as --force does.
    with JobDir(job).lock("resume"):
        assert _cli([str(job), "--partial"]) == 2
        assert "is in use (ringctl resume" in capsys.readouterr().err
    # The job ends, every document complete: a plain gather replaces the partial output.
    entry.write_bytes(kept)
    JobDir(job).write_state({"state": "COMPLETED", "started_at": time.time(), "ended_at": 1.0})
    assert _cli([str(job)]) == 0
    summary = _summary(out)
    assert summary["partial"] is False and summary["incomplete"] == []
    assert [r["document"] for r in summary["documents"]] == DOC_IDS
    assert json.loads((out / ".ringctl-gather").read_text())["partial"] is False
    assert not (out / "tokens.csv").exists()  # nothing left over from the partial one
    capsys.readouterr()
    assert _cli([str(job)]) == 2 and "--force" in capsys.readouterr().err  # a full one stays


def test_partial_of_an_ended_job_and_of_a_bare_directory(jobs: dict, tmp_path: Path, capsys):
    from ringctl.jobdir import JobDir
    from ringctl.longdoc.inputs.documents import doc_key

    job = _real_job_dir(jobs, tmp_path, "jobs/longdoc.yaml", "failed")
    shutil.rmtree(job / "out/longdoc/shards" / doc_key("one.txt"))
    JobDir(job).write_state({"state": "FAILED", "reason": "rank 1 exited 1", "ended_at": 1.0})
    assert _cli([str(job), "--partial"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "the job is FAILED (rank 1 exited 1)" in shown and "ringctl resume" in shown
    assert "one.txt: no shards at all" in shown

    bare, shards = _copy_job(jobs, tmp_path, name="bare")
    shutil.rmtree(shards / doc_key("one.txt"))
    assert _cli([str(bare / "out"), "--partial", "-o", str(tmp_path / "b")]) == 0
    assert "job state unknown" in capsys.readouterr().out
    assert _summary(tmp_path / "b")["partial"] is True and "job_state" not in _summary(
        tmp_path / "b"
    )

    complete, _ = _copy_job(jobs, tmp_path, name="complete")
    assert _cli([str(complete / "out"), "--partial", "-o", str(tmp_path / "c")]) == 0
    assert "all 5 documents are complete: this is a full gather" in capsys.readouterr().out
    assert _summary(tmp_path / "c")["partial"] is False


def test_partial_still_refuses_what_is_wrong(jobs: dict, tmp_path: Path, capsys) -> None:
    """--partial leaves out what is not complete; it never lets through a wrong list, a
    complete document of the wrong length, or a shard that leads outside the job."""
    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.output.expected import write_expected
    from ringctl.longdoc.output.names import EXPECTED_FILE

    job, _ = _copy_job(jobs, tmp_path)
    root = job / "out" / "longdoc"
    index = json.loads((root / "documents.json").read_text())
    (root / EXPECTED_FILE).unlink(missing_ok=True)
    write_expected(root, index["documents"], tokens={"one.txt": 2})
    assert _cli([str(job), "--partial"]) == 3
    assert "expected.json says 2" in capsys.readouterr().err and not (job / "gathered").exists()

    index["documents"] = index["documents"][:2]
    (root / "documents.json").write_text(json.dumps(index))
    assert _cli([str(job), "--partial"]) == 3
    assert "3 expected document(s) are not listed" in capsys.readouterr().err

    job, shards = _copy_job(jobs, tmp_path, name="symlink")
    shard = shards / doc_key("docs.jsonl#1") / "rank-00001.safetensors"
    shutil.move(shard, tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    assert _cli([str(job), "--partial"]) == 3
    assert f"{shard} leads outside" in capsys.readouterr().err and not (job / "gathered").exists()


def test_another_jobs_partial_output_is_not_replaced_without_force(tmp_path):
    """A --partial output is replaced by a later gather without --force: only one of the same
    job (-o shared between jobs replaced the other job's partial output)."""
    from ringctl.errors import UserError
    from ringctl.output_dir import check_target, write_marker

    out = tmp_path / "out"
    out.mkdir()
    write_marker(out, tmp_path / "job-a", "longdoc", partial=True)
    check_target(out, tmp_path / "job-a", force=False)
    with pytest.raises(UserError, match="exists already"):
        check_target(out, tmp_path / "job-b", force=False)


def test_the_same_job_is_the_same_however_its_directory_is_typed(tmp_path, monkeypatch):
    """The marker kept the job's path as typed: `gather p2 --partial` then `gather
    /abs/p2` was refused ("exists already"), and d1/p3's partial output under a shared -o was
    replaced by d2/p3's gather (another job, the same relative name), no --force."""
    from ringctl.output_dir import check_target, write_marker

    for d in ("d1/p3", "d2/p3"):
        (tmp_path / d).mkdir(parents=True)
    out = tmp_path / "shared"
    out.mkdir()
    monkeypatch.chdir(tmp_path / "d1")
    write_marker(out, Path("p3"), "train", partial=True)
    check_target(out, tmp_path / "d1" / "p3", force=False)  # the same job, typed otherwise
    monkeypatch.chdir(tmp_path / "d2")
    with pytest.raises(UserError, match="exists already"):
        check_target(out, Path("p3"), force=False)  # another job of the same name


@pytest.mark.parametrize("inside", ["checkpoints/latest", "checkpoints/step-0000009", "logs/g"])
def test_a_gather_into_the_job_s_own_folders_is_refused(tmp_path, inside):
    """-o JOBDIR/checkpoints/step-0000009 made a folder every later resume, prune and
    gather took for a checkpoint (gather then refused the job: "step-0000009, which is
    missing, incomplete"); checkpoints/latest made the pointer a folder. JOBDIR/gathered and
    other new folders there stay allowed."""
    from ringctl.output_dir import check_target

    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match=f": inside the job's own {inside.split('/')[0]}; "):
        check_target(job / inside, job, force=False)
    check_target(job / "gathered", job, force=False)
    check_target(job / "exported", job, force=False)
