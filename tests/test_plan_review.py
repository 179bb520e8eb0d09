"""The planner review's findings, each against the truth it got wrong: published parameter
counts of mixtures of experts, transformers' own window layers, the Ulysses grid's ranks,
device and topology files checked by field, a config's sizes read by the job's rule."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.planner.cost import Link, ModelShape, Workload, estimate, fewest_ranks
from ringctl.planner.devices import get_device, load_devices
from ringctl.planner.memory import state_parts
from ringctl.planner.model import (
    from_hf_config,
    linear_flops_per_token,
    lm_head_flops_per_token,
    total_params,
)

ROOT = Path(__file__).resolve().parents[1]

# --- 1. mixtures of experts -------------------------------------------------------------

# The size fields of each model's config.json on the Hugging Face Hub, and its published
# total parameter count (model cards; gpt-oss: its model card's 20.9B).
MOE = {
    "Mixtral-8x7B": (
        dict(
            model_type="mixtral",
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            sliding_window=None,
        ),
        46.7e9,
    ),
    "gpt-oss-20b": (
        dict(
            model_type="gpt_oss",
            hidden_size=2880,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=24,
            num_local_experts=32,
            num_experts_per_tok=4,
            vocab_size=201088,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 12,
        ),
        20.9e9,
    ),
    "Qwen1.5-MoE-A2.7B": (
        dict(
            model_type="qwen2_moe",
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_hidden_layers=24,
            num_experts=60,
            num_experts_per_tok=4,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            vocab_size=151936,
        ),
        14.3e9,
    ),
    "Qwen3-30B-A3B": (
        dict(
            model_type="qwen3_moe",
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=48,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            vocab_size=151936,
        ),
        30.5e9,
    ),
}


@pytest.mark.parametrize("name", MOE)
def test_a_mixture_of_experts_counts_every_expert(name):
    """Before: the experts were not read; Mixtral-8x7B counted 7.24B, gpt-oss-20b 2.39B.
    Biases (gpt-oss's experts, Qwen's q/k/v) are left out: within 0.2% of the totals."""
    data, published = MOE[name]
    m = from_hf_config(data, name)
    assert total_params(m, m.heads, m.kv_heads, m.head_dim) == pytest.approx(published, rel=0.005)


def test_a_token_runs_its_experts_only():
    """Mixtral-8x7B's 12.9B active parameters (its model card): two experts a token, the
    router, attention and lm_head in matmuls; the input embedding is a lookup."""
    m = from_hf_config(MOE["Mixtral-8x7B"][0], "mixtral")
    per_token = linear_flops_per_token(m, 32, 8, 128) + lm_head_flops_per_token(m)
    assert per_token / 2 + m.vocab * m.hidden == pytest.approx(12.9e9, rel=0.01)


def test_plan_of_mixtral_holds_all_its_experts(tmp_path, capsys):
    """Before: `ringctl plan --model MIXTRAL` said 14.7 GiB per GPU and fits; its bf16
    weights alone are 87 GiB, more than an H100 holds unsharded."""
    (tmp_path / "config.json").write_text(json.dumps(MOE["Mixtral-8x7B"][0]))
    argv = ["plan", "--model", str(tmp_path), "--seq", "65536", "--ranks", "8", "--mode", "score"]
    assert main([*argv, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["memory_bytes"]["weights (bfloat16)"] == pytest.approx(2 * 46.7e9, rel=0.005)
    assert not report["fits"]


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(model_type="deepseek_v3", n_routed_experts=256), "model type 'deepseek_v3' has ex"),
        (dict(decoder_sparse_step=2), "'decoder_sparse_step' / 'mlp_only_layers': dense layers"),
        (dict(num_experts_per_tok=9), "'num_experts_per_tok' (9) is more than the 8 experts"),
    ],
)
def test_experts_the_planner_cannot_lay_out_are_refused_by_name(change, said):
    data = MOE["Mixtral-8x7B"][0] | change
    with pytest.raises(UserError) as err:
        from_hf_config(data, "x/config.json")
    assert str(err.value).startswith("x/config.json: ") and said in str(err.value)


# --- 2. Ulysses -------------------------------------------------------------------------


def test_a_hybrid_plan_searches_multiples_of_its_ulysses_degree(capsys):
    """Before: ZeroDivisionError (fewest_ranks tried P = 1 with U = 2: a ring of 0)."""
    argv = "plan --seq 65536 --ranks 8 --heads 32 --kv-heads 8 --ulysses 2 --mode score --json"
    assert main(argv.split()) == 0
    assert json.loads(capsys.readouterr().out)["fewest_ranks"] % 2 == 0
    device = get_device("H100-SXM")
    model = from_hf_config(MOE["Mixtral-8x7B"][0], "mixtral")
    work = Workload(1 << 22, 32, 8, 128, model=model, mode="score", shard="weights", ulysses=4)
    fewest = fewest_ranks(work, device)
    assert fewest is not None and fewest % 4 == 0
    assert estimate(work, fewest, device, Link("x", 400)).fits
    assert not estimate(work, fewest - 4, device, Link("x", 400)).fits


def test_a_job_with_ring_ulysses_is_planned(capsys):
    argv = [
        "plan",
        "jobs/attention.yaml",
        "device=H100-SXM",
        "task.seq_len=65536",
        "tasks_per_node=8",
        "gpus_per_node=8",
        "backend=slurm",
        "ring.ulysses=2",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ulysses"] == 2 and report["fewest_ranks"] % 2 == 0


def test_one_ulysses_rule_for_flags_estimate_and_layouts(capsys):
    """U = 2 with 3 K/V heads: neither divides the other (ringattn.hybrid refuses it on the
    ranks). Before: only the hybrid comparison knew; the flag and estimate took it."""
    from ringctl.planner.hybrid import ulysses_degrees

    argv = "plan --seq 65536 --ranks 8 --heads 12 --kv-heads 3 --ulysses 2 --mode score"
    assert main(argv.split()) == 2
    assert "--ulysses 2 and the K/V heads (3) must divide one another" in capsys.readouterr().err
    work = Workload(seq_len=65536, heads=12, kv_heads=3, head_dim=128, ulysses=2)
    with pytest.raises(ValueError, match="K/V heads"):
        estimate(work, 8, get_device("H100-SXM"), Link("x", 400))
    assert 2 not in ulysses_degrees(work, 8, 8) and 3 in ulysses_degrees(work, 6, 6)


# --- 3, 4. device and topology files ------------------------------------------------------

BASE = {"mem_gib": 80, "tflops": {"bfloat16": 989}}
TABLE = {"64": {k: {"1024": [0.01, 0.02]} for k in ("full", "diag", "half")}}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"tflops": {"bfloat16": 0}}, "tflops.bfloat16"),
        ({"tflops": {"bfloat16": -989}}, "tflops.bfloat16"),
        ({"tflops": {"bfloat16": "989"}}, "tflops.bfloat16"),
        ({"reserve_gib": 100}, "reserve_gib"),
        ({"reserve_gib": -1}, "reserve_gib"),
        ({"nvlink_gbps": -450}, "nvlink_gbps"),
        ({"net_gbit": 0}, "net_gbit"),
        ({"nvlink_latency_s": -1.0}, "nvlink_latency_s"),
        ({"gpus_per_node": 8.7}, "gpus_per_node"),
        ({"cores": "2", "block_seconds": TABLE}, "cores"),
        ({"cores": 0, "block_seconds": TABLE}, "cores"),
        ({"p2p_gbytes_s": "10"}, "p2p_gbytes_s"),
        ({"p2p_gbytes_s": -10}, "p2p_gbytes_s"),
        ({"step_overhead_s": {"2": [-5, -5]}}, "step_overhead_s"),
        ({"threads_per_rank": 0}, "threads_per_rank"),
        ({"cores": 2, "block_seconds": {"64": {k: {} for k in TABLE["64"]}}}, "block_seconds"),
        (
            {"cores": 2, "block_seconds": {"64": {k: {"1024": [0, 0]} for k in TABLE["64"]}}},
            "block",
        ),
        ({"attention_efficiency": [1e-320, 1e-320]}, "attention_efficiency"),
    ],
)
def test_a_device_field_out_of_its_range_is_refused_by_name(tmp_path, change, field):
    """Before: tflops -989 planned negative seconds (exit 0), 0 divided by zero, "2" cores or
    an empty table raised a traceback, a reserve over the memory fitted nothing."""
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"X": BASE | change}))
    with pytest.raises(UserError) as err:
        load_devices(path)
    said = str(err.value)
    assert said.startswith(f"{path}: device 'X': ") and field in said and "\n" not in said


def _fifo(tmp_path):
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


def test_a_device_or_topology_file_that_is_no_file_is_one_line(tmp_path, capsys, monkeypatch):
    """Before: a FIFO hung the plan (RINGCTL_DEVICES: every plan and submit), a folder,
    binary bytes or deep nesting raised a traceback."""
    import ringctl.planner.devices as devices

    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00{")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    plan = "plan --model llama3-8b --seq 65536 --ranks 8 --mode score".split()
    for path in (_fifo(tmp_path), tmp_path, tmp_path / "binary.json", tmp_path / "deep.json"):
        for flag in ("--devices", "--topology"):
            assert main([*plan, flag, str(path)]) == 2
            said = capsys.readouterr().err
            assert said.count("\n") == 1 and f"error: {path}" in said, said
    monkeypatch.setattr(devices, "USER_DEVICES", tmp_path / "fifo.json")
    with pytest.raises(UserError, match="not a regular file"):
        load_devices()


@pytest.mark.parametrize("gbps", ["0", "-100", "NaN", "Infinity", '"10"'])
def test_a_topology_bottleneck_must_be_a_finite_positive_rate(tmp_path, capsys, gbps):
    """Before: 0 raised ZeroDivisionError, NaN / Infinity / -100 were planned."""
    path = tmp_path / "topo.json"
    path.write_text('{"bottleneck": {"link": "IB", "gbps": ' + gbps + "}}")
    argv = "plan --model llama3-8b --seq 65536 --ranks 8 --mode score --topology".split()
    assert main([*argv, str(path)]) == 2
    assert f"{path}: bottleneck.gbps must be a finite positive" in capsys.readouterr().err


@pytest.mark.parametrize("shares", ["1e-320,1e-320", "inf,0.5", "0.0001,0.5"])
def test_an_attention_efficiency_that_makes_no_finite_time_is_refused(capsys, shares):
    """Before: 1e-320 planned a total of Infinity with exit 0 (and --json wrote Infinity,
    which is no JSON)."""
    argv = "plan --model llama3-8b --seq 65536 --ranks 8 --mode score --json".split()
    assert main([*argv, "--attention-efficiency", shares]) == 2
    assert "must be shares of peak in [0.001, 1]" in capsys.readouterr().err


# --- 5. a config's sizes ------------------------------------------------------------------

LLAMA = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
)


@pytest.mark.parametrize("head_dim", [None, 0])
def test_a_null_head_dim_is_hidden_over_heads(head_dim):
    """transformers (and the job: compat.size_refusal) read null and 0 as hidden / heads.
    Before: "missing key 'head_dim'"."""
    m = from_hf_config(LLAMA | {"head_dim": head_dim}, "x")
    assert m.head_dim == 128


@pytest.mark.parametrize(
    "change",
    [
        {"hidden_size": 4096.9},
        {"vocab_size": "128256"},
        {"num_hidden_layers": True},
        {"num_hidden_layers": math.inf},
        {"num_hidden_layers": 1e30},
        {"num_hidden_layers": 10**30},
        {"tie_word_embeddings": "false"},
    ],
)
def test_a_size_the_job_refuses_is_refused_by_the_planner(tmp_path, capsys, change):
    """Before: 4096.9 was truncated to 4096, "128256" and true (1 layer) were taken, inf and
    1e30 raised OverflowError; 10**30 layers overflowed (the job's check: MAX_PARAMS)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | change))
    argv = ["plan", "--model", str(tmp_path), "--seq", "65536", "--ranks", "8", "--mode", "score"]
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and f"{tmp_path / 'config.json'}: " in said
    key = next(iter(change))
    assert key in said or "no machine has room" in said


# --- 6. --heads keeps the model's K/V heads ----------------------------------------------


def test_heads_given_with_a_model_keep_its_kv_heads(capsys):
    """Before: --heads 32 with llama3-8b (8 K/V heads) planned 32 K/V heads, 1.5 GiB more."""
    argv = "plan --model llama3-8b --seq 65536 --ranks 8 --mode score --json".split()
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--heads", "32"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["workload"]["kv_heads"] == 8
    assert given["memory_total_gib"] == plain["memory_total_gib"]


# --- 7. the window's layers: one rule, transformers' ---------------------------------------


@pytest.mark.parametrize("first", [0, 20, 28])
def test_qwen2_windows_the_layers_from_max_window_layers_on(first):
    """Qwen2Config: layer i is windowed when i >= max_window_layers. Before, the job's
    compat.sliding_layers said every layer, so trained_context dropped its warning."""
    from transformers import Qwen2Config

    from ringctl.longdoc.model import compat

    data = dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=28,
        vocab_size=256,
        sliding_window=4096,
        use_sliding_window=True,
        max_window_layers=first,
        max_position_embeddings=32768,
    )
    built = Qwen2Config(**{k: v for k, v in data.items() if k != "model_type"})
    truth = sum(t == "sliding_attention" for t in built.layer_types)
    assert truth == 28 - first
    assert compat.sliding_layers(data) == truth
    m = from_hf_config(data, "qwen2")
    assert (m.window_layers or (28 if m.window else 0)) == truth
    assert compat.trained_context(data) == (None if truth == 28 else 32768)


def test_each_family_windows_the_layers_its_config_class_does():
    """A config.json without layer_types: the layers each family's config class (transformers
    5) windows, counted by compat.sliding_layers (the job's rule) and so by the planner."""
    import transformers

    from ringctl.longdoc.model import compat

    window = dict(sliding_window=64)
    cases = [
        ("qwen2_moe", "Qwen2MoeConfig", dict(use_sliding_window=True, max_window_layers=13)),
        ("qwen3", "Qwen3Config", dict(use_sliding_window=True, max_window_layers=5)),
        ("gemma3_text", "Gemma3TextConfig", dict(sliding_window_pattern=6)),
        ("cohere2", "Cohere2Config", {}),
        ("olmo3", "Olmo3Config", {}),
        ("gpt_oss", "GptOssConfig", {}),
        ("mistral", "MistralConfig", {}),
    ]
    for kind, name, kw in cases:
        for layers in (7, 24):
            built = getattr(transformers, name)(num_hidden_layers=layers, **window, **kw)
            types = getattr(built, "layer_types", None) or ["sliding_attention"] * layers
            truth = sum(t == "sliding_attention" for t in types)
            data = dict(model_type=kind, num_hidden_layers=layers, **window, **kw)
            assert compat.sliding_layers(data) == truth, (kind, layers)


# --- 8. autocast's cast of a tied embedding -----------------------------------------------


def test_the_cast_of_a_tied_embedding_is_the_whole_matrix():
    """Llama-3.2-1B-like (tied, vocab 128256 x 2048): autocast casts the one matrix whole.
    Before: half of it (embedding_params // 2)."""
    m = ModelShape(16, 2048, 8192, 128256, heads=32, kv_heads=8, head_dim=64, tied_embeddings=True)
    w = Workload(8192, 32, 8, 64, model=m, mode="train", optimizer="adam")
    assert state_parts(w, 1)["weight casts (mixed precision, one unit)"] == 128256 * 2048 * 2


# --- 9. one layer priced, times the layers ------------------------------------------------


def test_the_model_time_prices_one_layer_times_the_layers():
    """Before: a list of 7 matmuls per layer (10**13 layers: MemoryError)."""
    device = get_device("H100-SXM")
    one = ModelShape(1, 64, 128, 256, heads=4, kv_heads=2, head_dim=16)
    work = Workload(4096, 4, 2, 16, model=one, mode="score")
    many = replace(work, model=replace(one, layers=10**13))
    single = estimate(work, 2, device, Link("x", 400), overlap_threshold=False)
    est = estimate(many, 2, device, Link("x", 400), overlap_threshold=False)
    part = "projections + MLP (forward)"
    assert est.model_s[part] == pytest.approx(10**13 * single.model_s[part])


# --- 10. small ones -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--model", "", "--seq", "65536"], "--model '': neither a preset"),
        (
            ["--model", "llama3-8b", "--corpus", "lognormal:3:100:200:1:2"],
            "expected lognormal:COUNT:LOW:HIGH[:SEED], got 5 numbers",
        ),
    ],
)
def test_an_empty_model_and_a_corpus_of_extra_fields_are_refused(capsys, extra, said):
    assert main(["plan", "--ranks", "8", "--mode", "score", *extra]) == 2
    assert said in capsys.readouterr().err


def test_a_model_shape_has_no_unused_params_field():
    assert "params" not in ModelShape.__dataclass_fields__


# --- a model the job runs and the planner cannot price -------------------------------------------


def _moe_job(tmp_path, model_type: str, *extra: str):
    """A long-document job on a tiny config.json of ``model_type`` (its experts given), through
    the checks submit runs; returns the checked config."""
    from transformers import AutoConfig

    from ringctl.config import load_job, load_job_from_dict
    from ringctl.submission import checked_for_submission
    from ringctl.tasks import get_task

    small = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=4096,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    config = AutoConfig.for_model(model_type, **small)
    model = tmp_path / f"{model_type}.json"
    model.write_text(config.to_json_string(use_diff=False))
    (tmp_path / "doc.txt").write_text("hello world " * 50)
    job = load_job(
        str(ROOT / "jobs" / "longdoc.yaml"),
        [
            f"task.model_path={model}",
            "task.tokenizer_path=bytes",
            f"task.inputs={tmp_path / 'doc.txt'}",
            f"output_dir={tmp_path}",
            *extra,
        ],
    )
    prepared = get_task("longdoc").prepare(job)
    if prepared is not job:
        job = load_job_from_dict(prepared, source="job")
    return checked_for_submission(job, "job")


def test_a_model_the_planner_cannot_price_submits_with_a_budget_of_its_own(tmp_path):
    """GraniteMoE runs on the ring (compat.config_refusal: None) but its experts are laid out in
    a way the planner does not read: with the job's own ring.max_tokens_per_rank the submit
    checks need no pricing and pass (they refused it, naming the planner, even with --force);
    with ring.size=auto and a device, the planner's budget is needed: refused, saying how to
    give one. Doge's config names experts with is_moe false: a dense model, priced."""
    from ringctl.longdoc.model.compat import config_refusal

    assert config_refusal({"model_type": "granitemoe"}) is None
    budget = ("ring.size=2", "ring.max_tokens_per_rank=4096", "tasks_per_node=2")
    assert _moe_job(tmp_path, "granitemoe", *budget).ring.max_tokens_per_rank == 4096
    with pytest.raises(UserError, match="give ring.max_tokens_per_rank to size the rings"):
        _moe_job(tmp_path, "granitemoe", "ring.size=auto", "device=H100-SXM", "tasks_per_node=2")
    doge = {"model_type": "doge", "is_moe": False, "num_experts": 16384, **_SMALL_DENSE}
    assert from_hf_config(doge, "doge").experts == 0


_SMALL_DENSE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256)


def test_a_device_without_a_link_figure_names_the_figure_assumed(tmp_path, capsys):
    """A device entry with neither nvlink_gbps nor pcie_gbps was priced at a PCIe figure of
    the planner's own, shown as "PCIe (nominal) 256 Gbit/s" as if the file had said it."""
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps({"x": {"mem_gib": 80, "tflops": {"bfloat16": 1000}}}))
    argv = ["plan", "--devices", str(devices), "--device", "x", "--seq", "65536", "--ranks", "8"]
    assert main(argv) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "PCIe x16 gen4 (assumed: no nvlink_gbps or pcie_gbps) 256 Gbit/s" in shown, shown


def test_embed_is_priced_without_the_output_head(capsys):
    """`--mode embed` returns hidden states before the output head, and was priced with its
    logits (4.9 GiB a rank at 262k tokens of Llama-3-8B on 8 ranks) and its matmul's time."""
    argv = ["plan", "--model", "llama3-8b", "--seq", "262144", "--ranks", "8", "--json"]
    plans = {}
    for mode in ("embed", "score"):
        assert main([*argv, "--mode", mode]) == 0
        plans[mode] = json.loads(capsys.readouterr().out)
    embed, score = plans["embed"], plans["score"]
    assert not any("logits" in k for k in embed["memory_bytes"])
    assert not any("lm_head" in k for k in embed["model_s"])
    assert any("logits" in k for k in score["memory_bytes"])
    assert embed["memory_total_gib"] < score["memory_total_gib"]


def test_a_family_the_planner_prices_as_llama_says_so(tmp_path, capsys):
    """phi-2, gpt_neox, falcon (ungated MLPs, fused projections) were priced as Llama-style
    decoders without a word: phi-2's 2.78B parameters as 3.62B, exit 0."""
    config = {
        "model_type": "phi",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 51200,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--seq", "8192", "--ranks", "2"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "model_type 'phi' is priced as a Llama-style decoder" in shown, shown
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert main(["plan", "--model", str(tmp_path), "--seq", "8192", "--ranks", "2"]) == 0
    assert "Llama-style decoder" not in capsys.readouterr().out


def test_autocast_s_precision_table_says_its_float32_parts():
    """The training job's bfloat16 (autocast over float32 weights) showed "activations:
    bfloat16" while its residual stream and norms stay float32 (priced so: norm_bytes)."""
    from ringctl.planner.memory import precision

    m = ModelShape(2, 64, 128, 256, heads=4, kv_heads=2, head_dim=16)
    job = Workload(1024, 4, 2, 16, model=m, mode="train", optimizer="adam", autocast=True)
    assert precision(job)["activations"] == "bfloat16 (the residual stream and norms float32)"
    assert precision(replace(job, autocast=False))["activations"] == "bfloat16"
