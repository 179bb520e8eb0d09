"""What spawned ranks run for the hybrid tests (module level: spawned processes import it)."""

from __future__ import annotations

import torch

from tests.attention_reference import Case, make_inputs


def hybrid_outputs(
    rank: int, world: int, grids: list[tuple[int, list[Case]]]
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """For each (Ulysses degree U, cases): build the U x P/U grid, shard every case in its
    hybrid layout, run hybrid attention forward and backward; this rank's out, dq, dk, dv,
    and the bytes it sent in the forward pass over the ring and in all-to-alls."""
    import ringattn.hybrid as hybrid
    from ringattn.comm import STATS as RING_STATS
    from ringattn.layouts import shard_sequence
    from ringattn.ulysses import STATS as A2A_STATS

    results = {}
    for degree, cases in grids:
        groups = hybrid.hybrid_groups(degree)
        assert groups.rank == rank  # hybrid rank = global rank: results come back in its order
        for case in cases:
            shard = {
                name: shard_sequence(
                    t,
                    world_size=world,
                    rank=groups.rank,
                    layout=case.layout,
                    ulysses_degree=degree,
                    cu_seqlens=case.cu_seqlens,
                )
                for name, t in make_inputs(case).items()
            }
            q, k, v = (shard[n].requires_grad_() for n in ("q", "k", "v"))
            RING_STATS.reset(enabled=True)
            A2A_STATS.reset(enabled=True)
            out = hybrid.hybrid_attention(
                q,
                k,
                v,
                causal=case.causal,
                layout=case.layout,
                ulysses_group=groups.ulysses,
                ring_group=groups.ring,
                window=case.window,
                cu_seqlens=case.cu_seqlens,
            )
            sent = {"ring_bytes": RING_STATS.bytes_sent, "a2a_bytes": A2A_STATS.bytes_sent}
            RING_STATS.reset(enabled=False)
            A2A_STATS.reset(enabled=False)
            out.backward(shard["dout"])
            results[(degree, case.id)] = {
                "out": out.detach(),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
                **sent,
            }
    return results


def _attempt(fn) -> str:
    """Run fn; the text of the ValueError it raises ('' if none, the type name if another)."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - any other failure is reported, typed
        return f"{type(err).__name__}: {err}"
    return ""


def hybrid_errors(rank: int, world: int) -> dict[str, str]:
    """Bad inputs on a 4-rank world; every rank records what it raised for each. A valid call
    after them proves no rank was left behind in a collective (it would desynchronise)."""
    import torch.distributed as dist

    import ringattn.hybrid as hybrid

    def qkv(seq=4, heads=4, kv_heads=2, dim=8, rank_dims=None):
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, seq, heads, dim, generator=g)
        k = torch.randn(1, seq, kv_heads, dim, generator=g)
        if rank_dims is not None and rank == rank_dims:
            q = q[0]  # a 3-D tensor on one rank only
        return q, k, torch.randn_like(k)

    def call(tensors, groups_pair, layout="hybrid-zigzag", causal=True, **extra):
        ulysses, ring = groups_pair
        return lambda: hybrid.hybrid_attention(
            *tensors, causal=causal, layout=layout, ulysses_group=ulysses, ring_group=ring, **extra
        )

    grid = hybrid.hybrid_groups(2)  # ulysses {0,1},{2,3}; rings {0,2},{1,3}
    full = hybrid.hybrid_groups(4)  # one Ulysses group of 4, rings of one rank
    same = (grid.ulysses, grid.ulysses)  # the ring is the Ulysses group: not a grid
    cross = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # rings joining u=0 with u=1
    crossed = (grid.ulysses, cross[0] if rank in (0, 3) else cross[1])
    uneven_u = [dist.new_group([0, 1, 2]), dist.new_group([3])]  # Ulysses groups of 3 and 1
    uneven_r = [dist.new_group([0, 3]), dist.new_group([1]), dist.new_group([2])]
    uneven = (uneven_u[rank == 3], uneven_r[{0: 0, 3: 0, 1: 1, 2: 2}[rank]])
    pair = (grid.ulysses, grid.ring)
    seven = qkv(seq=7 if rank == 3 else 4)
    out = {
        "heads_not_divisible": _attempt(call(qkv(heads=6, kv_heads=2), (full.ulysses, full.ring))),
        "kv_heads_neither": _attempt(call(qkv(heads=12, kv_heads=3), pair)),
        "one_rank_3d": _attempt(call(qkv(rank_dims=2), pair)),
        "one_rank_longer": _attempt(call(seven, pair)),
        "one_rank_not_causal": _attempt(call(qkv(), pair, causal=rank != 1)),
        "one_rank_no_window": _attempt(call(qkv(), pair, window=None if rank == 1 else 3)),
        "one_rank_other_scale": _attempt(call(qkv(), pair, softmax_scale=0.5 + (rank == 2))),
        "ring_is_ulysses_group": _attempt(call(qkv(), same)),
        "rings_cross_heads": _attempt(call(qkv(), crossed)),
        "group_sizes_differ": _attempt(call(qkv(heads=6, kv_heads=3), uneven)),
        "ring_layout_name": _attempt(call(qkv(), pair, layout="zigzag")),
        "degree_does_not_tile": _attempt(lambda: hybrid.hybrid_groups(3)),
        # an argument bad on one rank alone (second reading): raised there before the grid's
        # agreement, the others waited in it until the group's timeout
        "one_rank_bad_window": _attempt(call(qkv(), pair, window=-1 if rank == 1 else 3)),
    }
    q, k, v = qkv()
    after = hybrid.hybrid_attention(
        q,
        k,
        v,
        causal=True,
        layout="hybrid-zigzag",
        ulysses_group=grid.ulysses,
        ring_group=grid.ring,
    )
    out["valid_call_after"] = "ok" if after.shape == q.shape else f"shape {tuple(after.shape)}"
    return out
