"""Sharding layouts: positions, round trips, the divisibility rule, and zigzag's balance."""

from __future__ import annotations

import pytest
import torch

import ringattn
from ringattn import block_plan


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shards_cover_every_position_once_and_round_trip(layout, world):
    n = 2 * world * 3
    x = torch.arange(n).reshape(1, n, 1) * 10
    shards = [
        ringattn.shard_sequence(x, world_size=world, rank=r, layout=layout) for r in range(world)
    ]
    positions = [
        ringattn.sequence_positions(n, world_size=world, rank=r, layout=layout)
        for r in range(world)
    ]
    for shard, pos in zip(shards, positions, strict=True):
        assert torch.equal(shard[0, :, 0], pos * 10)  # positions name exactly what the shard holds
    assert sorted(torch.cat(positions).tolist()) == list(range(n))
    assert torch.equal(ringattn.unshard_sequence(shards, layout=layout), x)


def test_zigzag_rank_holds_chunks_r_and_2p_minus_1_minus_r():
    pos = ringattn.sequence_positions(16, world_size=4, rank=1, layout="zigzag")
    assert pos.tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize(
    ("n", "world", "layout", "multiple"),
    [(10, 4, "contiguous", 4), (12, 4, "zigzag", 8), (7, 2, "zigzag", 4)],
)
def test_indivisible_length_is_a_clear_error(n, world, layout, multiple):
    x = torch.zeros(1, n, 1)
    with pytest.raises(ValueError) as err:
        ringattn.shard_sequence(x, world_size=world, rank=0, layout=layout)
    msg = str(err.value)
    assert f"N={n}" in msg and f"P={world}" in msg and layout in msg and str(multiple) in msg
    assert ringattn.padded_length(n, world_size=world, layout=layout) % multiple == 0


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="unknown layout 'zig'"):
        ringattn.sequence_positions(8, world_size=2, rank=0, layout="zig")


def _computed_pairs(world: int, rank: int, layout: str, seq_local: int) -> int:
    pairs = 0
    for step in range(world):
        for blk in block_plan(
            step=step, rank=rank, world_size=world, seq_local=seq_local, causal=True, layout=layout
        ):
            rows = len(range(seq_local)[blk.q])
            cols = len(range(seq_local)[blk.kv])
            pairs += rows * (rows + 1) // 2 if blk.causal else rows * cols
    return pairs


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_causal_blocks_are_skipped_and_zigzag_balances_work(world):
    seq_local = 64
    n = world * seq_local
    for layout in ("contiguous", "zigzag"):
        work = [_computed_pairs(world, r, layout, seq_local) for r in range(world)]
        # Every (query, key <= query) pair is computed exactly once across the ring, and no
        # fully masked block is computed at all: the total is exactly the causal triangle.
        assert sum(work) == n * (n + 1) // 2
        if layout == "contiguous":
            assert work[-1] > work[0]
        else:
            assert len(set(work)) == 1, work  # identical work on every rank
