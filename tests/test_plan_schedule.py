"""The planner's side of many rings per job: per-rank budgets, a document's cost, the makespan
of a schedule, and the job's own scheduler priced by it (`ringctl.makespan`; the planner's
separate power-of-two "reference" schedule is gone: plan prices what the job runs)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.makespan import auto_budget, corpus_comparison, price_job
from ringctl.planner.cost import GIB, Workload, memory_per_rank, usable_gib
from ringctl.planner.devices import get_device
from ringctl.planner.model import presets
from ringctl.planner.pricing import (
    document_cost,
    lognormal_lengths,
    max_tokens_per_rank,
)
from ringctl.rings import divisors
from ringctl.scheduler import (
    DocLength,
    Schedule,
    ring_for,
    schedule_documents,
)

L8 = presets()["llama3-8b"]
H100 = get_device("H100-SXM")
SCORE = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, model=L8, mode="score")


@pytest.mark.parametrize("ring", [1, 4])
def test_budget_fits_and_one_more_unit_does_not(ring):
    n = max_tokens_per_rank(SCORE, H100, ring)
    cap = usable_gib(H100) * GIB
    unit = 2 * ring  # zigzag

    def total(tokens_per_rank):
        return sum(memory_per_rank(replace(SCORE, seq_len=tokens_per_rank * ring), ring).values())

    assert n > 0 and (n * ring) % unit == 0
    assert total(n) <= cap < total(n + unit // ring)


def test_sharding_over_the_ring_raises_the_budget():
    plain = max_tokens_per_rank(SCORE, H100, 8)
    sharded = max_tokens_per_rank(replace(SCORE, shard="weights"), H100, 8)
    assert sharded > plain


def test_document_cost_grows_as_n_squared_for_attention_and_n_for_the_rest():
    attention = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, mode="score")
    long = document_cost(1 << 20, 8, attention, H100) / document_cost(1 << 19, 8, attention, H100)
    assert long == pytest.approx(4, rel=0.02)
    short = document_cost(8192, 1, SCORE, H100) / document_cost(4096, 1, SCORE, H100)
    assert 2 <= short < 2.5  # projections and MLP dominate at 4-8k tokens


def test_makespan_is_the_sum_over_phases_of_the_busiest_ring():
    docs = [DocLength(i, f"d{i}", n) for i, n in enumerate([4000, 300, 400, 500, 100])]
    s = schedule_documents(docs, world=4, size="auto", budget=1000, layout="zigzag")
    by_phase: dict = {}
    for e in s.entries:
        by_phase.setdefault(e.ring_size, {}).setdefault(e.ring, 0.0)
        by_phase[e.ring_size][e.ring] += e.predicted_s
    assert s.makespan == pytest.approx(sum(max(r.values()) for r in by_phase.values()))
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))).makespan == s.makespan


def _listed(lengths):
    return [(f"#{i}", n) for i, n in enumerate(lengths)]


def test_plan_prices_the_schedule_the_job_runs():
    """The same assignments as the job's scheduler (relative costs decide), each priced in
    seconds by the planner; a phase lasts as long as its busiest ring."""
    lengths = lognormal_lengths(200, 4096, 1 << 21, seed=3)
    budget = auto_budget(SCORE, H100, 16, 8)
    assert budget == min(max_tokens_per_rank(SCORE, H100, s, min(s, 8)) for s in divisors(16))
    where = {"work": SCORE, "device": H100, "nodes": 2}
    priced = price_job(_listed(lengths), world=16, size="auto", budget=budget, **where)
    docs = [DocLength(i, f"#{i}", n) for i, n in enumerate(lengths)]
    job = schedule_documents(docs, world=16, size="auto", budget=budget, layout="zigzag")
    decided = lambda s: [(e.index, e.ring_size, e.ring, e.order) for e in s.entries]  # noqa: E731
    assert decided(priced) == decided(job) and job.cost_unit == "relative"
    assert priced.cost_unit == "seconds" and sorted(e.index for e in priced.entries) == list(
        range(200)
    )
    for e in priced.entries:
        assert e.predicted_s == document_cost(e.tokens, e.ring_size, SCORE, H100, nodes=2)
        assert e.ring_size >= ring_for(e.tokens, divisors(16), budget, "zigzag")  # only grows
        assert 0 <= e.ring < 16 // e.ring_size
    loads = {}
    for e in priced.entries:
        loads[e.ring_size, e.ring] = loads.get((e.ring_size, e.ring), 0.0) + e.predicted_s
    phases = {size: max(v for (s, _), v in loads.items() if s == size) for size, _ in loads}
    assert priced.makespan == pytest.approx(sum(phases.values()))


def test_a_document_no_ring_can_hold_is_refused_by_name():
    budget = auto_budget(SCORE, H100, 16, 8)
    big = 16 * budget + 4096
    with pytest.raises(UserError, match=rf"'#1' has {big:,} tokens: no ring of this job holds it"):
        where = {"work": SCORE, "device": H100, "nodes": 2}
        price_job(_listed([4096, big]), world=16, size="auto", budget=budget, **where)


def test_auto_beats_one_ring_on_a_heavy_tailed_corpus():
    result = corpus_comparison(SCORE, H100, 64, nodes=8, count=300, low=4096, high=1 << 20)
    assert result["auto_makespan_s"] < result["one_ring_makespan_s"]
    assert result["gpu_seconds"]["auto"] < result["gpu_seconds"]["one ring"]
    assert sum(result["auto_documents_per_ring_size"].values()) == 300
    assert result["budget_tokens_per_rank"] == auto_budget(SCORE, H100, 64, 8)


def test_plan_corpus_cli(capsys):
    argv = "plan --model llama3-8b --ranks 64 --nodes 8 --mode score --corpus lognormal:100:4096:1048576 --json".split()
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 100 and report["speedup"] > 1
    assert main(["plan", "--ranks", "8", "--corpus", "normal:1:2:3"]) == 2
    assert "expected lognormal:COUNT:LOW:HIGH" in capsys.readouterr().err


def test_plan_prints_the_makespan_of_the_schedule_a_job_wrote(tmp_path, capsys):
    """schedule.json as the job writes it (``scheduler.write_schedule``) read by `ringctl plan`
    (issue 27: plan read another format, so `plan JOBDIR` failed on every job's file): in the
    scheduler's relative units without a device, in seconds once priced."""
    from ringctl.scheduler import priced, write_schedule

    docs = [DocLength(i, f"d{i}", n) for i, n in enumerate([100, 2000, 50, 900])]
    s = schedule_documents(docs, world=4, size="auto", budget=600, layout="zigzag")
    path = tmp_path / "schedule.json"
    write_schedule(path, s)
    assert main(["plan", "--schedule", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"documents": 4, "makespan_relative": s.makespan}
    seconds = priced(s, lambda n, size: n / size / 1000)
    seconds.cost_unit = "seconds"
    write_schedule(path, seconds)
    assert main(["plan", str(tmp_path), "--json"]) == 0  # a job directory with its schedule
    assert json.loads(capsys.readouterr().out)["makespan_s"] == pytest.approx(seconds.makespan)
    assert main(["plan", str(tmp_path), "--model", "llama3-8b"]) == 2  # dropped, exit 0
    assert "--model: a job directory's schedule is priced as its job runs it" in (
        capsys.readouterr().err
    )
    path.write_text(json.dumps([{"ring": 0}]))
    assert main(["plan", "--schedule", str(path)]) == 2
    assert "not a schedule" in capsys.readouterr().err
