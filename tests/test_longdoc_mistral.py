"""A Mistral-family model (no sliding window) with ringattn: hidden states of a 2-rank zigzag
ring equal the unsharded model's with stock sdpa attention (float32: within 1e-5 relative)."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed

CONFIG = dict(
    model_type="mistral",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    sliding_window=None,
)


def _build(attn_implementation: str):
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    config = AutoConfig.for_model(**CONFIG)
    return build_random(
        config, seed=0, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()


def _ring_hidden(rank: int, world: int, ids: torch.Tensor):
    from ringattn import padded_length, sequence_positions, shard_sequence

    n = padded_length(ids.numel(), world_size=world, layout="zigzag")
    padded = torch.cat([ids, torch.zeros(n - ids.numel(), dtype=ids.dtype)])  # pad at the end
    positions = sequence_positions(n, world_size=world, rank=rank, layout="zigzag")
    shard = shard_sequence(padded[None], world_size=world, rank=rank, layout="zigzag")
    with torch.no_grad():
        out = _build("ringattn").model(
            input_ids=shard, position_ids=positions[None], use_cache=False, ring_layout="zigzag"
        )
    return positions, out.last_hidden_state[0]


def test_mistral_ring_hidden_states_match_one_process():
    ids = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _build("sdpa").model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    per_rank = run_distributed(_ring_hidden, 2, ids)
    got = torch.empty(sum(p.numel() for p, _ in per_rank), want.shape[-1])
    for positions, hidden in per_rank:
        got[positions] = hidden
    err = (got[: ids.numel()] - want).abs().max() / want.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"
