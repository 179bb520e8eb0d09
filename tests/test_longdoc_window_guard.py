"""A config that names a sliding window its layers never pass to the attention call (here a
Llama, which ignores the field) cannot be windowed by the ring: a document longer than the
window is refused by name, with the override that lifts it; a shorter one is scored."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    sliding_window=32,
)


def _score(rank: int, world: int, lengths: list[int]) -> list[str]:
    from transformers import AutoConfig

    from ringattn.hf import register
    from ringctl.longdoc.compute.scoring import run_task
    from ringctl.longdoc.model.load import build_random

    register()
    config = AutoConfig.for_model("llama", **CONFIG)
    model = build_random(config, seed=1, dtype=torch.float32, attn_implementation="ringattn")
    said = []
    for n in lengths:
        try:
            with torch.no_grad():
                run_task(
                    "score",
                    model.eval(),
                    torch.arange(n) % 256,
                    group=None,
                    layout="zigzag",
                    chunk_size=64,
                )
            said.append("scored")
        except RuntimeError as err:
            said.append(str(err))
    return said


@pytest.mark.parametrize("world", [1, 2])
def test_a_window_no_layer_passes_is_refused_beyond_it(world):
    short, long = run_distributed(_score, world, [32, 33])[0]
    assert short == "scored"
    assert "its config gives 2 layers a sliding window of 32, but 0 passed it" in long, long
    assert "task.model_overrides.sliding_window=null" in long


def test_the_probe_crosses_a_sliding_window():
    """The probe is longer than any window up to PROBE_WINDOW_MAX, so the ring's windowed
    blocks meet the model's own forward pass before any document; a length limit still cuts."""
    from types import SimpleNamespace as Config

    from ringctl.longdoc.probe import PROBE_TOKENS, probe_length

    def length(**cfg) -> int:
        return probe_length(Config(config=Config(model_type="t", **cfg)))

    assert length() == PROBE_TOKENS
    assert length(sliding_window=64) == PROBE_TOKENS  # 251 crosses it already
    assert length(sliding_window=4096) == 4177  # Mistral 7B v0.1: the first prime past 4163
    assert length(sliding_window=4096, attention_chunk_size=1000) == 1000
