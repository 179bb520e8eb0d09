"""Job orchestration review (round L): each test failed before its fix.

1. A budget below the layout's rows per rank (zigzag: 2) made ``ranks_needed`` search forever
   (submit hung, ranks spun): refused at load by name, and ``ranks_needed`` ends.
2. The warning signal ended an attention job COMPLETED with part of its steps, and a signal on
   one rank left the others waiting in the ring: the stop is agreed and the job FAILED.
3. Ring keys a task does not read (attention: ring.size, ring.max_tokens_per_rank; training:
   ring.ulysses) were accepted and priced by submit's plan: refused by name.
4. ``resume ring.layout=...`` broke a job for good, and resume ran none of submit's checks.
5. ring.ulysses was checked against the heads, not the K/V heads (``ulysses_problem``).
6. A long-document job of more ranks than run.json records (``MAX_WORLD_SIZE``) loaded.
7. On a resume, schedule.json's index was the position among the documents left.
"""

from __future__ import annotations

import json
import os
import signal
import time
import types
from pathlib import Path

import pytest

from ringattn.geometry import ranks_needed, ring_holds
from ringctl.cli import main
from ringctl.config import load_job, to_yaml
from ringctl.errors import UserError
from ringctl.tasks.base import importable
from tests.local_jobs import local_state, submit, wait_for

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
LONGDOC = str(ROOT / "jobs" / "longdoc.yaml")
TRAIN = str(ROOT / "jobs" / "train.yaml")
TINY = "task.model_path=null"  # the bundled tiny Llama: no package model needed


@pytest.fixture
def deadline():
    """Fail, rather than hang, a call that does not return within a few seconds."""

    def expired(signum, frame):
        raise AssertionError("did not return within 5 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# 1 --------------------------------------------------------------------------------------------
def test_ranks_needed_ends_on_a_budget_no_ring_holds(deadline):
    with pytest.raises(ValueError, match="holds no token in the zigzag layout"):
        ranks_needed(50, 1, "zigzag")
    assert ranks_needed(50, 1, "contiguous") == 50
    for tokens in (0, 1, 7, 50):
        need = ranks_needed(tokens, 2, "zigzag")
        assert ring_holds(tokens, need, 2, "zigzag")


def test_a_document_too_long_for_such_a_budget_is_said_in_one_line(deadline):
    """A budget that reaches the scheduler without the config's check (a device's)."""
    from ringctl.scheduler import too_long

    said = too_long("d", 50, [4], 1, "zigzag")
    assert "holds no token in the zigzag layout" in said and "\n" not in said
    assert said.endswith("it needs a larger ring.max_tokens_per_rank")


def test_a_budget_below_the_layouts_rows_is_refused_at_load(deadline):
    with pytest.raises(UserError, match=r"ring.max_tokens_per_rank: must be at least 2"):
        load_job(LONGDOC, [TINY, "ring.size=auto", "ring.max_tokens_per_rank=1"])
    load_job(LONGDOC, [TINY, "ring.layout=contiguous", "ring.max_tokens_per_rank=1"])


# 2 --------------------------------------------------------------------------------------------
def test_a_stop_on_one_rank_fails_the_attention_job_on_every_rank(tmp_path, capsys):
    """The warning signal on rank 1 only: both ranks stop at the same step (no rank waits in
    the ring for the collective timeout), and the job is FAILED saying it was stopped."""
    steps = ["task.steps=100000", "task.seq_len=256", "nodes=2", "timeout=120"]
    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", *steps)
    progress = job_dir / "logs" / "progress.json"
    wait_for(progress.exists, 60, "the steps to start")
    os.kill(int(local_state(job_dir)["ranks"]["1"]["pid"]), signal.SIGUSR1)
    signalled = time.monotonic()
    final = wait_for(
        lambda: local_state(job_dir).get("ended_at") and local_state(job_dir), 60, "end"
    )
    assert time.monotonic() - signalled < 30  # not the 120 s collective timeout
    assert final["state"] == "FAILED", final
    assert "stopped on request after" in final["reason"], final["reason"]
    assert not list((job_dir / "out").glob("rank-*"))  # nothing that looks like a result


# 3 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("job", "override"),
    [
        (SMOKE, "ring.size=2"),
        (SMOKE, "ring.size=auto"),
        (SMOKE, "ring.max_tokens_per_rank=4096"),
        (TRAIN, "ring.ulysses=2"),
        (TRAIN, "ring.ulysses=auto"),
        (LONGDOC, "ring.ulysses=2"),
    ],
)
def test_ring_keys_a_task_does_not_read_are_refused_by_name(job, override):
    key = override.split("=", 1)[0]
    with pytest.raises(UserError, match=rf"{key}: the \w+ task runs .* does not read it"):
        load_job(job, [TINY, override] if job != SMOKE else [override])


# 4 --------------------------------------------------------------------------------------------
def test_resume_refuses_what_changes_the_outputs_and_what_submit_refuses(tmp_path, capsys):
    """ring.layout is no resume key; a resume's overrides go through submit's checks (here the
    package check of RINGATTN_KERNEL=flash) before anything is written or moved."""
    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", "task.steps=1")
    wait_for(lambda: local_state(job_dir).get("ended_at"), 120, "the job to end")
    before = (job_dir / "config.yaml").read_bytes(), (job_dir / "job.sh").read_bytes()
    capsys.readouterr()
    assert main(["resume", str(job_dir), "--force", "ring.layout=contiguous"]) == 2
    err = capsys.readouterr().err
    assert "a resume may not change ring.layout" in err and err.count("\n") == 1, err
    if not importable("flash_attn"):
        assert main(["resume", str(job_dir), "--force", "env.vars.RINGATTN_KERNEL=flash"]) == 2
        err = capsys.readouterr().err
        assert "needs flash_attn" in err and err.count("\n") == 1, err
    after = (job_dir / "config.yaml").read_bytes(), (job_dir / "job.sh").read_bytes()
    assert after == before and not (job_dir / "attempts").exists()


def test_resume_sizes_ring_size_auto_as_submit_does(tmp_path):
    """The review's case: `resume ... ring.size=auto tasks_per_node=2` on a job with neither
    a budget nor a device: submit refuses it in one line; resume did not (its ranks failed)."""
    from ringctl.submission import resumed_config

    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(load_job(LONGDOC, [TINY, "tasks_per_node=4"])))
    job = types.SimpleNamespace(config=config)
    with pytest.raises(UserError, match="ring.size=auto needs a per-rank token budget"):
        resumed_config(job, ["ring.size=auto", "tasks_per_node=2"])
    # 8192 a rank: a ring of 4 holds the bundled samples' longest (29,800 bytes, the bytes
    # model's tokens), which submit now checks too (4096 passed, then failed on the ranks)
    budget = resumed_config(job, ["ring.size=auto", "ring.max_tokens_per_rank=8192"])
    assert budget is not None and budget[0].ring.max_tokens_per_rank == 8192


# 5 --------------------------------------------------------------------------------------------
def test_a_ulysses_degree_the_kv_heads_do_not_allow_is_refused_at_load():
    with pytest.raises(UserError, match=r"ring.ulysses: 2 and the K/V heads \(3\) must divide"):
        load_job(SMOKE, ["ring.ulysses=2", "task.heads=12", "task.kv_heads=3"])
    load_job(SMOKE, ["ring.ulysses=2", "task.heads=12", "task.kv_heads=4"])


def test_ulysses_auto_asks_the_planners_rule():
    from ringctl.rings import ulysses_degree

    # 4 ranks a node, 12 heads, 3 K/V heads: 4 and 2 split the heads but not the K/V heads
    assert ulysses_degree("auto", ranks_per_node=4, world=4, heads=12, kv_heads=3) == 1
    assert ulysses_degree("auto", ranks_per_node=4, world=4, heads=12, kv_heads=6) == 2


# 6 --------------------------------------------------------------------------------------------
def test_a_long_document_job_larger_than_run_json_records_is_refused():
    from ringctl.longdoc.output.manifest import MAX_WORLD_SIZE

    with pytest.raises(UserError, match=f"nodes: .* at most {MAX_WORLD_SIZE:,}"):
        load_job(LONGDOC, [TINY, "nodes=8750", "tasks_per_node=8"])
    load_job(LONGDOC, [TINY, f"nodes={MAX_WORLD_SIZE // 8}", "tasks_per_node=8"])


# 7 --------------------------------------------------------------------------------------------
def test_a_resumed_schedule_indexes_documents_in_input_order(tmp_path):
    from ringctl.longdoc.inputs.documents import list_documents
    from ringctl.longdoc.schedule import RingOptions, plan_schedule, write_job_schedule
    from ringctl.scheduler import read_schedule

    for name in ("doc1.txt", "doc2.txt", "doc3.txt"):
        (tmp_path / name).write_text(name * 10)
    listing = list_documents([str(tmp_path)]).documents
    todo = listing[1:]  # doc1 is complete: a resume schedules the other two
    byte = types.SimpleNamespace(name="bytes")
    options = RingOptions(size=1, max_tokens_per_rank=1000)
    schedule = plan_schedule(
        todo, options, world=2, layout="zigzag", tokenizer=byte, listing=listing
    )
    path = tmp_path / "schedule.json"
    write_job_schedule(path, schedule, todo)
    entries = read_schedule(path).entries
    assert sorted((e.index, e.doc_id) for e in entries) == [(1, todo[0].id), (2, todo[1].id)]
    rows = json.loads(path.read_text())["documents"]
    assert [Path(r["source"]).name for r in rows] == ["doc2.txt", "doc3.txt"]
