"""The bundled trained byte-level model says something true (the training demo's model, and
the one the tests run jobs on since the job's default became SmolLM2, tests/test_smollm2.py).

It is named by its reserved name (`bundled:demo-byte-llama`, resolved in
`ringctl.longdoc.model.load`); `model_path: null` keeps meaning the random tiny Llama that the
other tests compare against. The model must know English: on a sample story it never saw, far
below the random model's ~8 bits per byte and a byte bigram's 3.6 (fitted on its training
text), with a loss that falls as the context grows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ringctl.config import load_job
from ringctl.longdoc.model.load import load_model
from ringctl.longdoc.model.names import BUNDLED_TRAINED, resolve_model_path, samples_dir
from ringctl.longdoc.output.gather import bits_per_byte
from ringctl.longdoc.params import LongDocParams
from ringctl.tasks.longdoc import LongDocTask

ROOT = Path(__file__).resolve().parents[1]


def _nll(model, raw: bytes) -> torch.Tensor:
    """Per-byte next-byte losses (nats), the model's own forward pass."""
    ids = torch.tensor(list(raw), dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    return -logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.fixture(scope="module")
def trained():
    return load_model(resolve_model_path(BUNDLED_TRAINED), attn_implementation="sdpa")


def test_the_jobs_default_model_knows_english(trained) -> None:
    story = (samples_dir() / "lighthouse-keeper.txt").read_bytes()
    nll = _nll(trained, story)
    bits = float(nll.mean()) / math.log(2)
    assert bits < 3.0, f"{bits:.3f} bits per byte on a story it never saw"
    # more context, lower loss: the first 64 bytes cost more than the rest of the story
    assert float(nll[:64].mean()) > float(nll[256:].mean()) + 0.5


def test_past_its_training_context_more_context_costs_nothing(trained) -> None:
    # Trained on 2048-byte sequences, the model attends within a sliding window of 2048 bytes
    # (config.json), so no query meets a key farther than training did: bytes far into a
    # long document cost what they cost scored on their own. Without the window (the model
    # as first shipped, a plain Llama) bytes 8192-12287 of this held-out English cost 2.59
    # nats in place against 1.99 alone; with it, 2.00.
    config = trained.config
    assert config.sliding_window == config.max_position_embeddings == 2048
    text = (samples_dir() / "jargon-file-excerpts.txt").read_bytes()[:12288]
    in_place = float(_nll(trained, text)[8191:].mean())
    alone = float(_nll(trained, text[8191:]).mean())
    assert in_place < alone + 0.05, (in_place, alone)


def test_the_shipped_weights_are_small_and_load_in_the_jobs_dtype(trained) -> None:
    folder = Path(resolve_model_path(BUNDLED_TRAINED))
    weights = folder / "model.safetensors"
    assert weights.stat().st_size < 5 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 256 and config["dtype"] == "float16"
    assert all(p.dtype == torch.float32 for p in trained.parameters())  # upcast on load
    assert (folder / "README.md").is_file()  # the model card ships with the weights


def test_reserved_name_resolves_and_null_stays_the_random_model() -> None:
    assert resolve_model_path(None) is None
    assert resolve_model_path("/models/x") == "/models/x"
    with pytest.raises(ValueError, match=BUNDLED_TRAINED):
        resolve_model_path("bundled:gpt-5")
    params = LongDocParams.from_any({"model_path": BUNDLED_TRAINED})
    assert params.model_path == resolve_model_path(BUNDLED_TRAINED)
    assert Path(params.model_path, "config.json").is_file()
    # the job's saved config keeps the name: each node resolves it in its own install
    cfg = LongDocTask().prepare(
        load_job(ROOT / "jobs" / "longdoc.yaml", [f"task.model_path={BUNDLED_TRAINED}"])
    )
    assert cfg["task"]["model_path"] == BUNDLED_TRAINED


def test_bits_per_byte_is_the_loss_over_the_scored_bytes() -> None:
    ll = -math.log(2) * 3.0 * 9  # 3 bits for each of 9 scored bytes (10 byte tokens)
    assert bits_per_byte(ll, 9) == pytest.approx(3.0)
    assert bits_per_byte(ll, 27) == pytest.approx(1.0)  # tokens of 3 bytes each
    assert bits_per_byte(ll, None) is None  # the scored bytes are not known
    assert bits_per_byte(0.0, 0) is None  # nothing scored
