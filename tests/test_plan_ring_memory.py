"""The planner's ring buffers against what the engine holds: real gloo ranks run ring attention
forward and backward, each counting the tensor storage it allocates (tests/live_bytes.py), and
``ringctl plan``'s parts of one attention call (less the q, k, v shards the caller holds) must
bound every rank's peak.

A window that keeps every leg of the ring to one hop sends only the rows the next rank reads
(``SequenceLayout.kv_rows``): the planner once priced whole blocks in flight and three whole
float32 dK/dV accumulators there, 2.6x what the ranks held at W = 64; it now prices the rows
carried (``window.trimmed_hops``): 2.0x, the rest being dout (the caller's) and the call's
transients priced as if alive at once; 2.25x is the bound. The other cases pin that the bound
holds where whole blocks travel (no window; a window crossing blocks, whose pieces allocate
flipped copies).
"""

from __future__ import annotations

import pytest

from ringctl.planner.cost import Workload, attention_parts
from tests.distributed import run_distributed

SEQ, HEADS, KV_HEADS, HEAD_DIM, WORLD = 4096, 4, 2, 32, 4
# (layout, window, the ring carries only part of a block)
CASES = [
    ("zigzag", None, False),
    ("zigzag", 64, True),
    ("contiguous", 64, True),
    ("zigzag", 2000, False),
]


def _peaks(rank: int, world: int) -> list[int]:
    import torch

    import ringattn
    from tests.live_bytes import LiveBytes

    peaks = []
    for layout, window, _ in CASES:
        g = torch.Generator().manual_seed(0)
        full = {
            name: torch.randn(1, SEQ, heads, HEAD_DIM, generator=g)
            for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("dout", HEADS))
        }
        shard = {
            name: ringattn.shard_sequence(t, world_size=world, rank=rank, layout=layout)
            for name, t in full.items()
        }
        q, k, v = (shard[n].contiguous().requires_grad_() for n in "qkv")
        for counted in (False, True):  # the first call builds the plans, outside the count
            mode = LiveBytes()
            with mode if counted else _nothing():
                out = ringattn.ring_attention(q, k, v, causal=True, layout=layout, window=window)
                out.backward(shard["dout"])
            q.grad = k.grad = v.grad = None
        peaks.append(mode.peak)
    return peaks


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _planned(layout: str, window: int | None) -> float:
    w = Workload(
        seq_len=SEQ,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="float32",
        layout=layout,
        window=window,
    )
    parts = attention_parts(w, WORLD)
    parts.pop("q, k, v shards")  # the caller's, held before the call
    return sum(parts.values())


@pytest.fixture(scope="module")
def peaks() -> list[list[int]]:
    return run_distributed(_peaks, WORLD, transport="gloo")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-W{c[1]}" for c in CASES])
def test_the_planned_ring_buffers_bound_what_every_rank_holds(peaks, case):
    layout, window, trimmed = CASES[case]
    held = max(rank[case] for rank in peaks)
    planned = _planned(layout, window)
    assert held <= planned, (held, planned)
    if trimmed:  # the rows a hop carries are priced, not whole blocks
        assert planned <= 2.25 * held, (held, planned)
