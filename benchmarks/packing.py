"""Packed sequences in the ring: how the layouts balance, and what packing buys, side by side.

    python -m benchmarks.packing                       # both tables, JSON + markdown
    python -m benchmarks.packing --seq 16384 --ranks 2 --repeats 3

Layouts (no timing: counted with ringattn.geometry, as the engine plans): on a heavy-tailed
packing (lognormal lengths plus one document of half the tokens), the causal visible
(query, key) pairs of the busiest rank over the mean, and the rows each layout adds, for

* ``balanced``: ringattn's packed zigzag layout (long documents cut in the zigzag pattern over
  every rank, the rest whole where the work is least);
* ``per-document zigzag``: every document padded to a multiple of 2P and cut into 2P chunks,
  rank r holding chunks r and 2P-1-r of each (TransformerEngine's THD layout);
* ``contiguous slices``: the packed tokens in P equal slices (ring-flash-attention's llama3).

Engine (timed): P ranks (one thread each, real processes, the ring's default transport) run
one packed sequence of N tokens of the same corpus, forward + backward, causal, against the
same documents as one ring call each (plain zigzag, each padded to 2P: what one document at a
time costs). Median of ``--repeats``, interleaved; tokens/s; the outputs of both compared.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results_file import write_results
from ringattn import geometry

DEFAULT_OUT = Path("benchmarks/results/packing.json")


def heavy_tail(n_total: int, seed: int) -> list[int]:
    """Lognormal lengths (median e^5 ~ 150 tokens) plus one document of half the tokens."""
    rng = random.Random(seed)
    lengths = [n_total // 2]
    while sum(lengths) < n_total:
        lengths.append(max(1, min(n_total - sum(lengths), int(rng.lognormvariate(5.0, 1.3)))))
    rng.shuffle(lengths)
    return lengths


def _cu(lengths: list[int]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


@dataclass
class LayoutRow:
    tokens: int
    ranks: int
    documents: int
    layout: str
    max_over_mean: float  # causal visible pairs of the busiest rank / the mean
    added_rows_pct: float  # rows the layout adds, % of the tokens


def per_document_zigzag(lengths: list[int], world: int) -> tuple[list[int], int]:
    """(pairs per rank, rows added) of TransformerEngine's layout: each document padded to
    2P x c and rank r holding its chunks r and 2P-1-r; padding rows do no work here."""
    work, added = [0] * world, 0
    for n in lengths:
        c = -(-n // (2 * world))
        added += 2 * world * c - n
        for r in range(world):
            for chunk in (r, 2 * world - 1 - r):
                lo, hi = chunk * c, min(n, (chunk + 1) * c)
                if hi > lo:
                    work[r] += geometry.prefix_keys(hi, None) - geometry.prefix_keys(lo, None)
    return work, added


def layout_rows(tokens: int, worlds: list[int], seed: int) -> list[LayoutRow]:
    lengths = heavy_tail(tokens, seed)
    cu = _cu(lengths)
    rows = []
    for world in worlds:
        for name, layout in (("balanced", "zigzag"), ("contiguous slices", "contiguous")):
            lay = geometry.packed_layout(cu, world, layout)
            work = [lay.pairs(r, True, None) for r in range(world)]
            rows.append(_row(tokens, world, len(lengths), name, work, lay.padding))
        work, added = per_document_zigzag(lengths, world)
        rows.append(_row(tokens, world, len(lengths), "per-document zigzag", work, added))
    return rows


def _row(tokens, world, docs, name, work, added) -> LayoutRow:
    mean = sum(work) / world
    return LayoutRow(tokens, world, docs, name, max(work) / mean, 100.0 * added / tokens)


# ----------------------------------------------------------------------------- engine timing
@dataclass
class EngineRow:
    tokens: int
    ranks: int
    documents: int
    packed_s: float
    one_by_one_s: float
    speedup: float
    packed_tokens_per_s: float
    max_rel_diff: float


def _rank(rank: int, world: int, store: str, args, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = [_engine_row(args, n, rank, world) for n in args.seq]
    if rank == 0:
        import json

        Path(out).write_text(json.dumps([r.__dict__ for r in rows]))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _engine_row(args, n: int, rank: int, world: int) -> EngineRow:
    import torch

    import ringattn

    lengths = heavy_tail(n, args.seed)
    cu = list(_cu(lengths))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, args.heads, args.head_dim, generator=g)
    k = torch.randn(1, n, args.kv_heads, args.head_dim, generator=g)
    v = torch.randn(k.shape, generator=g)  # every rank the same inputs: one seeded generator
    dout = torch.randn(q.shape, generator=g)
    packed_t, single_t = [], []
    for _ in range(args.repeats + 1):  # the first round warms up
        t, packed = _packed(q, k, v, dout, cu, rank, world, ringattn)
        packed_t.append(t)
        t, single = _one_by_one(q, k, v, dout, cu, rank, world, ringattn)
        single_t.append(t)
    diff = _gathered_diff(packed, single, world)
    p, s = statistics.median(packed_t[1:]), statistics.median(single_t[1:])
    return EngineRow(n, world, len(lengths), p, s, s / p, n / p, diff)


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - start, result


def _packed(q, k, v, dout, cu, rank, world, ringattn):
    kw = dict(world_size=world, rank=rank, layout="zigzag", cu_seqlens=cu)
    qs, ks, vs, ds = (ringattn.shard_sequence(t, **kw) for t in (q, k, v, dout))

    def step():
        qq, kk, vv = (t.clone().requires_grad_() for t in (qs, ks, vs))
        out = ringattn.ring_attention(qq, kk, vv, causal=True, layout="zigzag", cu_seqlens=cu)
        out.backward(ds)
        return out.detach()

    return _timed(step)


def _one_by_one(q, k, v, dout, cu, rank, world, ringattn):
    import torch

    def step():
        outs = []
        for a, b in zip(cu, cu[1:], strict=False):
            pad = ringattn.padded_length(b - a, world_size=world, layout="zigzag")
            kw = dict(world_size=world, rank=rank, layout="zigzag")
            parts = [
                torch.nn.functional.pad(t[:, a:b], (0, 0, 0, 0, 0, pad - (b - a)))
                for t in (q, k, v, dout)
            ]
            qs, ks, vs, ds = (ringattn.shard_sequence(t, **kw) for t in parts)
            qq, kk, vv = (t.requires_grad_() for t in (qs, ks, vs))
            out = ringattn.ring_attention(qq, kk, vv, causal=True, layout="zigzag")
            out.backward(ds)
            outs.append((a, b, pad, out.detach()))
        return outs

    return _timed(step)


def _gathered_diff(packed, single, world: int) -> float:
    """max |packed - one by one| / max |one by one| over the whole sequence (rank 0's view
    after gathering every rank's rows)."""
    import torch.distributed as dist

    mine = (packed, single)
    every = [None] * world
    dist.all_gather_object(every, mine)
    return _compare(every, world)


def _compare(every, world: int) -> float:
    import torch

    import ringattn

    cu = [0]
    for _, b, _, _ in every[0][1]:
        cu.append(b)
    packed = ringattn.unshard_sequence([p for p, _ in every], layout="zigzag", cu_seqlens=cu)
    ref = []
    for i in range(len(every[0][1])):
        a, b, pad, _ = every[0][1][i]
        whole = ringattn.unshard_sequence([s[i][3] for _, s in every], layout="zigzag")
        ref.append(whole[:, : b - a])
    ref = torch.cat(ref, dim=1)
    return float((packed - ref).abs().max() / ref.abs().max())


def engine_rows(args) -> list[EngineRow]:
    import json

    import torch.multiprocessing as mp

    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.start_processes(
                _rank,
                args=(world, os.path.join(tmp, "store"), args, out),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
            rows += [EngineRow(**r) for r in json.loads(Path(out).read_text())]
    return rows


# ----------------------------------------------------------------------------- output
def _layout_md(rows: list[LayoutRow]) -> str:
    head = (
        "| N | P | documents | layout | busiest / mean pairs | rows added |\n"
        "|---|---|---|---|---|---|"
    )
    body = [
        f"| {r.tokens} | {r.ranks} | {r.documents} | {r.layout} | {r.max_over_mean:.3f} | "
        f"{r.added_rows_pct:.2f}% |"
        for r in rows
    ]
    return "\n".join([head, *body])


def _engine_md(rows: list[EngineRow]) -> str:
    head = (
        "| N | P | documents | packed s | one ring call each s | packed speed-up | "
        "packed tokens/s | max rel diff |\n|---|---|---|---|---|---|---|---|"
    )
    body = [
        f"| {r.tokens} | {r.ranks} | {r.documents} | {r.packed_s:.3f} | "
        f"{r.one_by_one_s:.3f} | {r.speedup:.2f}x | {r.packed_tokens_per_s:.0f} | "
        f"{r.max_rel_diff:.1e} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layout-tokens", type=int, nargs="+", default=[65536, 1 << 20])
    p.add_argument("--layout-ranks", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-engine", action="store_true", help="the layout table only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    layouts = [r for n in args.layout_tokens for r in layout_rows(n, args.layout_ranks, args.seed)]
    print(_layout_md(layouts), flush=True)
    engine = [] if args.no_engine else engine_rows(args)
    if engine:
        print("\n" + _engine_md(engine))
    write_results(args.out, "packing", sys.argv[1:] if argv is None else argv, layouts + engine)
    md = args.out.with_suffix(".md")
    md.write_text(
        f"{__doc__.splitlines()[0]}\n\n`python -m benchmarks.packing "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
        f"{_layout_md(layouts)}\n\n{_engine_md(engine) if engine else ''}\n"
    )
    print(f"wrote {args.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
