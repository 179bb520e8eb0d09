"""A model whose numbers are not finite is refused before any document is scored (issue 26,
"High"), on 2 real ranks (``run_longdoc`` over gloo):

* a checkpoint with one ``+inf`` weight, or one NaN weight: "non-finite weights", naming the
  parameter (a NaN one said "ranks hold different model weights ([nan, nan] vs [nan, nan])",
  an inf one passed that check);
* ``task.model_overrides={rms_norm_eps: nan}``: the model's own forward pass is not finite; the
  probe said "... = inf (tolerance inf)" and passed, and ``embed`` ended with NaN hidden states;
* a ring whose log-probabilities are not finite while the model's own are: the ring is named.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
POISONED = "model.layers.1.mlp.down_proj.weight"


def _model_dir(root: Path, name: str, value: float | None) -> Path:
    """A saved tiny Llama; with value, one weight of POISONED set to it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    d = root / name
    config = AutoConfig.for_model("llama", **TINY)
    build_random(config, seed=3, dtype=torch.float32, attn_implementation="eager").save_pretrained(
        d
    )
    if value is not None:
        (weights,) = d.glob("*.safetensors")
        tensors = load_file(weights)
        tensors[POISONED][1, 2] = value
        save_file(tensors, weights, metadata={"format": "pt"})
    return d


def _run(rank: int, world: int, root: str, name: str, mode: str, extra: dict) -> tuple[str, bool]:
    """(the run's error, or "completed"; whether any shard was written) on this rank."""
    from ringctl.longdoc.run import run_longdoc

    base = Path(root)
    params = {"inputs": [str(base / "docs")], "mode": mode, **extra}
    out = base / f"out-{name}-{rank}"
    try:
        run_longdoc(params, rank, world, None, out, lambda line: None)
        error = "completed"
    except RuntimeError as err:
        error = str(err)
    return error, (out / "longdoc" / "shards").exists()


def _ranks(rank: int, world: int, root: str) -> dict:
    base = Path(root)
    out = {
        "clean": _run(
            rank, world, root, "clean", "embed", {"model_path": str(base / "model-clean")}
        )
    }
    for name in ("inf", "nan"):
        extra = {"model_path": str(base / f"model-{name}")}
        out[name] = _run(rank, world, root, name, "embed", extra)
    eps = {"model_path": str(base / "model-clean"), "model_overrides": {"rms_norm_eps": math.nan}}
    out["eps"] = _run(rank, world, root, "eps", "embed", eps)
    out["ring"] = _with_a_ring_that_gives_nan(rank, world, root)
    return out


def _with_a_ring_that_gives_nan(rank: int, world: int, root: str) -> tuple[str, bool]:
    """A scorer whose head gives NaN (the model's own forward pass is untouched): the probe
    must blame the ring."""
    from ringctl.longdoc.compute import scoring

    def broken(model):
        head = model.get_output_embeddings()
        return lambda h: head(h).float() * math.nan

    kept = scoring.output_head
    scoring.output_head = broken
    try:
        extra = {"model_path": str(Path(root) / "model-clean")}
        return _run(rank, world, root, "ring", "score", extra)
    finally:
        scoring.output_head = kept


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("finite")
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_bytes(bytes(range(40, 120)))
    _model_dir(root, "model-clean", None)
    _model_dir(root, "model-inf", math.inf)
    _model_dir(root, "model-nan", math.nan)
    return run_distributed(_ranks, 2, str(root))


@pytest.mark.parametrize("name", ["inf", "nan"])
def test_a_weight_that_is_not_finite_is_named(results, name) -> None:
    for r in results:
        error, written = r[name]
        assert "non-finite weights" in error and POISONED in error, error
        assert "different model weights" not in error and "\n" not in error
        assert not written


def test_a_model_whose_own_forward_is_not_finite_is_refused(results) -> None:
    """rms_norm_eps=NaN: the first hidden state after the embeddings is NaN at token 0."""
    for r in results:
        error, written = r["eps"]
        assert "the model's own forward pass" in error and "non-finite values" in error, error
        assert "at token 0, first in layer 1's output" in error, error
        assert "tolerance inf" not in error and "\n" not in error
        assert not written


def test_a_ring_that_is_not_finite_is_blamed(results) -> None:
    for r in results:
        error, written = r["ring"]
        assert "the ring's log-probability of probe token 1 is nan" in error, error
        assert "ringattn, not the model's" in error
        assert not written


def test_the_noise_never_makes_the_tolerance_infinite() -> None:
    from ringctl.longdoc.probe import FLOOR, probe_tolerance

    for noise in (math.inf, math.nan, None):
        assert probe_tolerance("float32", noise) == FLOOR["float32"]
    assert probe_tolerance("float32", 1.0) == 4.0


def test_a_finite_model_still_runs(results) -> None:
    """The control: the same model without the poison scores its document."""
    for r in results:
        assert r["clean"] == ("completed", True)
