"""`ringctl plan JOB`: what it reads from a job config (ring.size, model.shard, a long-document
job's model config.json and documents) and the preflight `submit` runs."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from ringctl.cli import main
from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.sizing import Sizing, job_shard, ring_size

LLAMA_8B = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "model_type": "llama",
}


def test_ring_size_and_model_shard_are_read_with_defaults():
    today = OmegaConf.create({"ring": {"layout": "zigzag"}})
    assert ring_size(today) is None and job_shard(today, None, 8, False) == ("none", None)
    cfg = OmegaConf.create({"ring": {"size": 4}, "model": {"shard": "ring"}})
    assert ring_size(cfg) == 4
    assert job_shard(cfg, 4, 16, trains=False) == ("weights", 4)
    assert job_shard(cfg, 4, 16, trains=True) == ("full", 4)
    job = OmegaConf.create({"ring": {"size": "auto"}, "model": {"shard": "job"}})
    assert ring_size(job) is None and job_shard(job, None, 16, False) == ("weights", 16)
    with pytest.raises(UserError, match="model.shard: expected none, ring or job"):
        job_shard(OmegaConf.create({"model": {"shard": "all"}}), 4, 16, False)
    with pytest.raises(UserError, match="ring.size: expected auto or a number"):
        ring_size(OmegaConf.create({"ring": {"size": "big"}}))


def test_plan_of_a_long_document_job_reads_the_model_directory(tmp_path, capsys):
    model = tmp_path / "llama-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    (model / "tokenizer_config.json").write_text("{}")  # the job check wants a tokenizer
    argv = [
        "plan",
        "jobs/longdoc.yaml",
        f"task.model_path={model}",
        "task.dtype=bfloat16",
        "device=H100-SXM",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ring_size"] == 2 and report["documents"] >= 1
    # an 8B model in bf16 leaves (78 - 16) GiB for one layer's activations at ~100 kB/token
    assert 300_000 < report["max_tokens_per_rank"] < 700_000
    assert main([*argv[:-1], "--seq", "65536", "--json"]) == 0
    sized = json.loads(capsys.readouterr().out)
    assert sized["model"]["layers"] == 32 and sized["mode"] == "score" and sized["ranks"] == 2


def test_preflight_of_an_attention_job_is_the_plan_of_its_ranks():
    cfg = load_job(
        "jobs/attention.yaml",
        [
            "nodes=2",
            "tasks_per_node=4",
            "device=H100-SXM",
            "task.seq_len=1048576",
            "task.dtype=bfloat16",
        ],
    )
    verdict = Sizing(cfg).preflight()
    assert verdict.device == "H100-SXM" and verdict.estimate.ranks == 8
    assert verdict.estimate.tokens_per_rank == 1048576 // 8
    byte_model = load_job("jobs/longdoc.yaml", ["task.model_path=bundled:demo-byte-llama"])
    assert Sizing(byte_model).preflight() is None  # lengths unknown up front


@pytest.mark.parametrize("ulysses, degree", [("16", 16), ("auto", 8)])  # auto: a node's 8
def test_preflight_of_a_hybrid_job_prices_its_grid_as_plan_does(ulysses, degree, capsys):
    """submit priced ring.ulysses=16 as a flat ring: `ringctl plan JOB` said 100.1 GiB a rank,
    does not fit, and submit's preflight 52.6 GiB, fits (one rule: sizing.job_ulysses, the
    degree the ranks will run with, auto's too)."""
    overrides = [
        "device=H100-SXM",
        "task.heads=16",
        "task.kv_heads=2",
        "task.seq_len=20971520",
        f"ring.ulysses={ulysses}",
        "ring.nvlink_blocks=true",  # groups of 16 span two nodes of 8: an NVLink domain's
    ]
    verdict = Sizing(load_job("jobs/attention.yaml", overrides)).preflight()
    assert verdict.estimate.ulysses == degree and not verdict.estimate.fits
    assert main(["plan", "jobs/attention.yaml", *overrides, "--json"]) == 1
    planned = json.loads(capsys.readouterr().out)
    assert planned["memory_total_gib"] == pytest.approx(verdict.estimate.memory_total_gib)
    assert planned["memory_total_gib"] > 78


def test_plan_of_a_windowed_job_prices_its_window_unless_the_job_overrides_it(tmp_path, capsys):
    """A Mistral-type model's sliding window reaches the plan of its job (priced as a window:
    far below full causal attention at 1M tokens), and `task.model_overrides.sliding_window=
    null`, which makes the job run full causal attention, makes the plan price it so."""
    config = dict(LLAMA_8B, model_type="mistral", vocab_size=256, sliding_window=4096)
    (tmp_path / "mistral.json").write_text(json.dumps(config))
    model = f"task.model_path={tmp_path / 'mistral.json'}"
    job = ["plan", "jobs/longdoc.yaml", model, "task.dtype=bfloat16", "device=H100-SXM"]
    flags = ["--seq", "1048576", "--ranks", "8", "--json"]

    def forward_s(*overrides: str) -> float:
        assert main([*job, *overrides, *flags]) == 0
        return json.loads(capsys.readouterr().out)["total_s"]["forward"]

    windowed = forward_s()
    full = forward_s("task.model_overrides.sliding_window=null")
    assert windowed < full / 20
    plain = dict(config, sliding_window=None)
    (tmp_path / "mistral.json").write_text(json.dumps(plain))
    assert forward_s() == pytest.approx(full, rel=1e-9)


@pytest.mark.parametrize(
    "flags",
    [
        ["--model", "llama3-8b"],
        ["--checkpoint", "full"],
        ["--shard", "full"],
        ["--dtype", "float32"],
        ["--dtype", "bfloat16"],  # the flag's default, still not the job's float32
        ["--no-causal"],
        ["--seq", "65536"],  # the job sets task.seq_len
    ],
)
def test_workload_flags_beside_a_job_are_refused_not_dropped(flags, capsys):
    """`ringctl plan jobs/train.yaml --model llama3-8b --checkpoint full` printed the tiny
    job's plan (0.01 GiB, "checkpoint none"), exit 0: the flags were dropped."""
    assert main(["plan", "jobs/train.yaml", "--device", "H100-SXM", *flags]) == 2
    err = capsys.readouterr().err
    assert f"ringctl plan: error: {flags[0]}: " in err and "jobs/train.yaml" in err
    assert main(["plan", "jobs/train.yaml", "--device", "H100-SXM", "--ranks", "2"]) == 0
    corpus = ["--model", "llama3-8b", "--ranks", "8", "--corpus", "lognormal:20:4096:65536"]
    assert main(["plan", "jobs/longdoc.yaml", *corpus]) == 0  # a corpus: the flags size it


def test_a_job_split_error_names_the_jobs_key(capsys):
    """It named a flag the user never gave: "--seq 3 cannot be split ..."."""
    assert main(["plan", "jobs/train.yaml", "task.seq_len=3"]) == 2
    assert "error: jobs/train.yaml: task.seq_len 3 cannot be split" in capsys.readouterr().err
    assert main(["plan", "jobs/longdoc.yaml", "--seq", "1048571", "--ranks", "4"]) == 2
    assert "error: --seq 1048571 cannot be split" in capsys.readouterr().err


def test_plan_of_a_job_with_its_own_budget_headlines_that_budget(capsys):
    """A job giving ring.max_tokens_per_rank was headlined with the device's budget ("at most
    2,850,958 tokens per rank; a ring of 2 holds documents up to 5,701,916") where its ranks
    take 5,000 a rank (10,000 a ring); one over what the device holds is warned, exit 1."""
    argv = ["plan", "jobs/longdoc.yaml", "device=H100-SXM", "ring.size=auto"]
    assert main([*argv, "ring.max_tokens_per_rank=5000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ring.max_tokens_per_rank 5,000 (the device holds at most" in out
    assert "a ring of 2 holds documents up to 10,000 tokens" in out and "warning" not in out
    assert main([*argv, "ring.max_tokens_per_rank=5000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job_max_tokens_per_rank"] == 5000 and report["max_tokens_per_rank"] > 10**6
    assert main([*argv, "ring.max_tokens_per_rank=900000000"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: ring.max_tokens_per_rank 900,000,000 is more than one H100-SXM holds" in out
    assert main(argv[:2] + ["device=H100-SXM"]) == 0  # no budget of its own: the device's
    assert "at most 2," in " ".join(capsys.readouterr().out.split())


def test_a_job_that_does_not_fit_is_told_which_key_would_fit_it(capsys):
    """(64-node review, left then) `ringctl plan JOB` said "does not fit: N GiB per rank
    needed" and named nothing to change: the key that sets the ranks a sequence is split
    over (nodes x tasks_per_node for one ring of the job, ring.size for rings), with the fewest
    that fit it, the figure the plan prints above. Checked by planning that many."""
    argv = ["plan", "attention", "task.seq_len=400000000", "--json"]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    hint = report["warnings"][-1]
    assert hint == (
        f"to fit: {report['fewest_ranks']} ranks or more (nodes x tasks_per_node; this job has 16)"
    )
    nodes = report["fewest_ranks"] // 8
    assert main([*argv, f"nodes={nodes}"]) == 0  # 8 a node: that many fit
    assert json.loads(capsys.readouterr().out)["fits"]
    ringed = ["plan", "train", "ring.size=2", "task.seq_len=40000000", "--device", "H100-SXM"]
    assert main([*ringed, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["warnings"][-1] == (
        f"to fit: ring.size={report['fewest_ranks']} or more (ranks a sequence is split over; "
        "the job's nodes x tasks_per_node, 2 now, a multiple of it)"
    )
    size = report["fewest_ranks"]  # (second reading) followed with as many ranks, it loads
    assert load_job("train", [f"ring.size={size}", f"nodes={size}", "task.seq_len=40000000"])


def test_the_plan_offers_a_hybrid_layout_only_to_a_task_that_runs_one(capsys):
    """(training review) `ringctl plan` of a training job on 4 nodes x 8 GPUs recommended
    "hybrid 2x16 (Ulysses x ring)", and ring.ulysses=2 is then refused by the task ("runs
    plain rings"). Only the attention task runs hybrid grids."""
    shape = ["nodes=4", "tasks_per_node=8", "gpus_per_node=8", "device=H100-SXM"]
    for job, hybrid in (("train", False), ("longdoc", False), ("attention", True)):
        seq = [] if job == "longdoc" else ["task.seq_len=65536"]
        code = main(["plan", job, *shape, *seq, "--json"])
        out = capsys.readouterr().out
        if job == "longdoc":  # its documents vary: a budget, never a layout table
            assert code == 0 and "layouts" not in out, out[:200]
            continue
        report = json.loads(out)
        names = [row["name"] for row in report.get("layouts") or []]
        assert any(n.startswith("hybrid") for n in names) is hybrid, (job, names)

    # (re-reading) nor priced with --ulysses: refused by name
    assert main(["plan", "train", *shape, "task.seq_len=65536", "--ulysses", "2"]) == 2
    assert "--ulysses 2: the train task runs plain rings" in capsys.readouterr().err
