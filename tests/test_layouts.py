"""Sharding layouts: positions, round trips, the divisibility rule, and zigzag's balance."""

from __future__ import annotations

import math

import pytest
import torch

import ringattn
from ringattn import block_plan
from ringattn import layouts as L


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


# ----------------------------------------------------------------------------- hybrid layouts
GRIDS = [(4, 2), (4, 4), (4, 1), (6, 3), (6, 2), (8, 2), (8, 4), (8, 8), (1, 1)]  # (P, U)


@pytest.mark.parametrize("layout", L.HYBRID_LAYOUTS)
@pytest.mark.parametrize(("world", "degree"), GRIDS)
def test_hybrid_shards_cover_every_position_once_and_round_trip(layout, world, degree):
    n = 3 * L.padded_length(1, world_size=world, layout=layout, ulysses_degree=degree)
    x = torch.arange(n).reshape(1, n, 1) * 10
    args = {"world_size": world, "layout": layout, "ulysses_degree": degree}
    shards = [L.shard_sequence(x, rank=r, **args) for r in range(world)]
    positions = [L.sequence_positions(n, rank=r, **args) for r in range(world)]
    for shard, pos in zip(shards, positions, strict=True):
        assert shard.shape[1] == n // world
        assert torch.equal(shard[0, :, 0], pos * 10)
    assert sorted(torch.cat(positions).tolist()) == list(range(n))
    assert torch.equal(L.unshard_sequence(shards, layout=layout, ulysses_degree=degree), x)


@pytest.mark.parametrize(("world", "degree"), GRIDS)
def test_hybrid_zigzag_group_share_is_the_rings_zigzag_shard(world, degree):
    """After the all-to-all a member holds its group's pieces in ulysses-rank order: that
    must be exactly zigzag's shard of ring rank r over R ranks, so the ring's block skipping
    gives every ring position the same causal work (test above)."""
    ring = world // degree
    n = 4 * math.lcm(world, 2 * ring)
    for ring_rank in range(ring):
        pieces = [
            L.sequence_positions(
                n,
                world_size=world,
                rank=ring_rank * degree + u,
                layout="hybrid-zigzag",
                ulysses_degree=degree,
            )
            for u in range(degree)
        ]
        zigzag = L.sequence_positions(n, world_size=ring, rank=ring_rank, layout="zigzag")
        assert torch.equal(torch.cat(pieces), zigzag)


def test_hybrid_zigzag_positions_2x2():
    # 16 tokens, R = 2 groups: group 0 holds chunks 0 and 3 of 4, group 1 chunks 1 and 2;
    # each group's 8 tokens are cut in two contiguous pieces, one per Ulysses member.
    got = [
        L.sequence_positions(16, world_size=4, rank=r, layout="hybrid-zigzag", ulysses_degree=2)
        for r in range(4)
    ]
    assert [p.tolist() for p in got] == [
        [0, 1, 2, 3],
        [12, 13, 14, 15],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


def test_degree_one_hybrid_is_the_ring_layout():
    x = torch.arange(24).reshape(1, 24, 1)
    for layout in ("zigzag", "contiguous"):
        for r in range(4):
            plain = L.shard_sequence(x, world_size=4, rank=r, layout=layout)
            hybrid = L.shard_sequence(x, world_size=4, rank=r, layout=f"hybrid-{layout}")
            assert torch.equal(plain, hybrid)


@pytest.mark.parametrize(
    ("n", "world", "degree", "layout", "multiple"),
    [
        (12, 4, 2, "hybrid-zigzag", 4),  # lcm(P=4, 2R=4) = 4: fine, see below
        (10, 4, 2, "hybrid-zigzag", 4),
        (12, 6, 2, "hybrid-zigzag", 6),  # R = 3: lcm(6, 6)
        (18, 6, 3, "hybrid-zigzag", 12),  # R = 2: lcm(6, 4)
        (6, 4, 4, "hybrid-zigzag", 4),  # R = 1: lcm(4, 2)
        (10, 4, 2, "hybrid-contiguous", 4),
    ],
)
def test_hybrid_indivisible_length_is_a_clear_error(n, world, degree, layout, multiple):
    args = {"world_size": world, "layout": layout, "ulysses_degree": degree}
    assert L.padded_length(n, **args) == -(-n // multiple) * multiple
    if n % multiple == 0:
        assert L.sequence_positions(n, rank=0, **args).numel() == n // world
        return
    with pytest.raises(ValueError) as err:
        L.shard_sequence(torch.zeros(1, n, 1), rank=0, **args)
    msg = str(err.value)
    assert f"N={n}" in msg and f"P={world}" in msg and f"U={degree}" in msg and layout in msg
    assert f"multiple of {multiple}" in msg


def test_hybrid_degree_must_tile_the_world_and_needs_a_hybrid_layout():
    with pytest.raises(ValueError, match="U=3 must be >= 1 and divide the world size P=4"):
        L.sequence_positions(24, world_size=4, rank=0, layout="hybrid-zigzag", ulysses_degree=3)
    with pytest.raises(ValueError, match="ulysses_degree=2 needs a hybrid layout"):
        L.shard_sequence(
            torch.zeros(1, 8, 1), world_size=4, rank=0, layout="zigzag", ulysses_degree=2
        )
    with pytest.raises(ValueError, match="unknown layout 'hybrid'"):
        L.padded_length(8, world_size=2, layout="hybrid", ulysses_degree=2)
