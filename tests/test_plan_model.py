"""The planner's model of a whole LM: parameter counts, states under sharding and Adam,
activations per mode and checkpointing, whole-model time, and the shapes it reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.longdoc.model.compat import model_shape
from ringctl.planner.cost import (
    GIB,
    Link,
    Workload,
    estimate,
    memory_per_rank,
    memory_phases,
)
from ringctl.planner.devices import get_device
from ringctl.planner.memory import state_parts
from ringctl.planner.model import (
    layer_params,
    linear_flops_per_token,
    lm_head_flops_per_token,
    presets,
    total_params,
)
from ringctl.planner.timing import all_to_all_s

L8 = presets()["llama3-8b"]
L70 = presets()["llama3-70b"]
H100 = get_device("H100-SXM")
NET = Link("net", 400.0, 5e-6)


def work(model=L8, **kw) -> Workload:
    kw.setdefault("seq_len", 65536)
    return Workload(
        heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim, model=model, **kw
    )


def _params(m):
    return total_params(m, m.heads, m.kv_heads, m.head_dim)


@pytest.mark.parametrize(
    ("model", "published"),
    [(L8, 8_030_261_248), (L70, 70_553_706_496)],  # the safetensors index totals on the Hub
)
def test_parameter_count_matches_the_published_checkpoint(model, published):
    assert _params(model) == pytest.approx(published, rel=1e-4)


def test_adam_training_holds_16_bytes_per_parameter_and_shards_divide_them():
    w = work(mode="train", optimizer="adam")
    full = state_parts(w, 1)
    states = sum(v for k, v in full.items() if k.startswith(("weights", "gradients", "Adam")))
    assert states == 16 * _params(L8)  # float32 master + float32 gradient + two moments
    sharded = state_parts(replace(w, shard="full"), 8)
    shard = sum(v for k, v in sharded.items() if k.startswith(("weights", "gradients", "Adam")))
    assert shard == pytest.approx(states / 8)
    weights_only = state_parts(replace(w, shard="weights"), 8)
    grads = next(v for k, v in weights_only.items() if k.startswith("gradients"))
    assert grads == 4 * _params(L8)  # weights-only sharding leaves the gradients whole


def test_inference_keeps_one_layer_and_training_keeps_what_autograd_keeps():
    score = sum(memory_per_rank(work(mode="score"), 8).values())
    embed = sum(memory_per_rank(work(mode="embed"), 8).values())
    train = {
        c: sum(memory_per_rank(work(mode="train", checkpoint=c), 8).values())
        for c in ("none", "selective", "full")
    }
    assert embed < score < train["full"] < train["selective"] < train["none"]  # embed: no head
    # saved activations of all 32 layers grow with the layers; one live layer does not
    deep = replace(L8, layers=64)
    grow_train = sum(memory_per_rank(work(deep, mode="train"), 8).values()) - train["none"]
    grow_score = sum(memory_per_rank(work(deep, mode="score"), 8).values()) - score
    assert grow_score == 2 * 32 * layer_params(L8, 32, 8, 128)  # just the 32 layers' weights
    assert grow_train > 3 * grow_score  # + gradients and 32 layers of saved activations


def test_the_peak_is_what_is_held_plus_the_largest_phase():
    w = work(mode="train", checkpoint="full", shard="full", optimizer="adam")
    held, phases = memory_phases(w, 8)
    peak = sum(memory_per_rank(w, 8).values())
    assert peak == pytest.approx(sum(held.values()) + max(sum(p.values()) for p in phases.values()))
    assert set(phases) == {"attention", "MLP", "lm_head", "optimizer step"}


def test_unchunked_logits_cost_vocab_times_tokens():
    w = work(mode="train", lm_head_chunk=0)
    _, phases = memory_phases(w, 8)
    [logits] = [v for k, v in phases["lm_head"].items() if k.startswith("logits")]
    # bf16 output + float32 upcast + float32 log-softmax + two float32 gradients per logit
    assert logits == 65536 / 8 * L8.vocab * (2 + 4 + 4 + 8)


def test_whole_model_time_adds_up():
    w = work(mode="train", checkpoint="full")
    est = estimate(w, 8, H100, NET)
    parts = est.model_s
    assert est.model_total_s == pytest.approx(sum(parts.values()))  # nothing sharded, flat ring
    tokens = 65536 / 8
    matmul = tokens * linear_flops_per_token(L8, 32, 8, 128) / (989e12 * 0.6)
    assert parts["projections + MLP (forward)"] == pytest.approx(matmul)
    assert parts["projections + MLP (backward)"] == pytest.approx(2 * matmul)
    assert parts["recompute (checkpoint=full)"] == pytest.approx(
        matmul + parts["ring attention (forward)"]
    )
    assert est.tokens_per_s_per_gpu == pytest.approx(tokens / est.model_total_s)
    assert 0 < est.mfu < 0.6
    # 6 N D: the matmuls' FLOPs per token are twice the non-embedding parameters (plus lm_head)
    fwd = linear_flops_per_token(L8, 32, 8, 128) + lm_head_flops_per_token(L8)
    assert fwd == pytest.approx(2 * (_params(L8) - L8.vocab * L8.hidden), rel=1e-3)


def test_fsdp_collectives_hide_on_fast_links_and_show_on_slow_ones():
    w = work(mode="train", shard="full", optimizer="adam")
    fast = estimate(w, 8, H100, NET, ranks_on_host=8)  # the shards' collectives on NVLink
    slow = estimate(w, 8, H100, NET, ranks_on_host=8, intra=Link("slow", 1.0, 5e-6))

    def exposed(est):
        return next(v for k, v in est.model_s.items() if k.startswith("FSDP"))

    assert exposed(fast) < 1e-2 * fast.model_total_s
    assert exposed(slow) > 10 * exposed(fast)


def test_ulysses_all_to_all_volume():
    w = work(ulysses=8, seq_len=1 << 20)
    link = Link("nvlink", 8 * 450.0, 0.0)
    fwd, bwd = all_to_all_s(w, 64, link)
    tokens = (1 << 20) / 64
    qkv_out = tokens * (32 + 2 * 8 + 32) * 128 * 2  # q, k, v in and the output back, bf16
    assert fwd == pytest.approx(7 / 8 * qkv_out / (450e9))
    assert bwd == pytest.approx(fwd)


def test_precision_is_stated_per_tensor_kind():
    est = estimate(work(mode="train", optimizer="adam"), 8, H100, NET)
    p = est.precision
    assert p["weights (stored)"] == "float32" and p["weights (compute)"] == "bfloat16"
    assert p["Adam moments (2 per parameter)"] == "float32" and p["gradients"] == "float32"
    assert p["K/V blocks on the ring"] == "bfloat16"
    inference = estimate(work(mode="score"), 8, H100, NET).precision
    assert "gradients" not in inference and inference["weights (stored)"] == "bfloat16"


def test_model_shape_from_a_model_directory(tmp_path, capsys):
    config = {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "model_type": "llama",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_shape(tmp_path) == replace(L70, name="llama", family="llama")
    argv = [
        "plan",
        "--model",
        str(tmp_path),
        "--seq",
        "1048576",
        "--ranks",
        "64",
        "--nodes",
        "8",
        "--mode",
        "score",
        "--shard",
        "weights",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["layers"] == 80 and report["workload"]["kv_heads"] == 8
    assert report["fits"] and report["memory_total_gib"] < 78


def test_a_bad_model_config_names_file_and_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UserError, match=r"config\.json: missing key 'num_attention_heads'"):
        model_shape(tmp_path)


def test_sharding_makes_70b_fit_at_1m_tokens_on_64_h100(capsys):
    base = "plan --model llama3-70b --seq 1048576 --ranks 64 --nodes 8 --device H100-SXM --json".split()
    for mode in (
        ["--mode", "score"],
        ["--mode", "train", "--checkpoint", "full", "--optimizer", "adam"],
    ):
        assert main([*base, *mode]) == 1
        unsharded = json.loads(capsys.readouterr().out)
        assert not unsharded["fits"] and unsharded["memory_total_gib"] > 78
        assert main([*base, *mode, "--shard", "full" if "train" in mode else "weights"]) == 0
        sharded = json.loads(capsys.readouterr().out)
        assert sharded["fits"] and sharded["memory_total_gib"] < 78
        assert sharded["memory_total_gib"] < unsharded["memory_total_gib"] / 2


def test_attention_only_stays_available(capsys):
    argv = ["plan", "--seq", "65536", "--ranks", "8", "--heads", "32", "--kv-heads", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] is None and report["model_total_s"] is None
    assert report["total_s"]["forward+backward"] > 0
    assert sum(report["memory_bytes"].values()) / GIB == pytest.approx(report["memory_total_gib"])
