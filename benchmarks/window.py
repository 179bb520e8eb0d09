"""Sliding windows in the ring: what skipping the blocks behind the window saves, side by side.

    python -m benchmarks.window                          # N=16384, P=4, windows 512, 2048, 8192
    python -m benchmarks.window --seq 8192 --ranks 2 --windows 256 1024

One process runs a ``LocalRing`` of P virtual ranks (zigzag) for each window, on the same
inputs, and torch's own SDPA on the whole sequence with the window as an explicit boolean mask
(what one process can do with stock torch). Reported per window: median forward+backward time
of both over ``--repeats``, the ring's time relative to the ring without a window (full
causal), and the largest difference of the ring's output from SDPA's (relative to its largest
value): a row whose output disagrees beyond float32 rounding is flagged, not timed as right;
and the K/V transfers each rank makes in the forward (a short window stops the ring early).
Each window runs twice, interleaved: its band as the unmasked pieces the engine cuts it into
(rectangles, causal squares and their mirrors: ``split``) and as one masked band
(``masked``, the banded kernel, what windows shorter than ``geometry.SPLIT_WINDOW`` get). The
rate is GFLOP/s of visible scores: 14 flops per visible (query, key) pair and head dimension
(forward 4, backward 10 with the recomputed scores), the same count for every row, the full
causal ring's included, so the rates compare the kernels' efficiency directly.
A LocalRing measures compute, merge and bookkeeping (its ranks run one after another), not
the overlap of transfers: the saving shown is the FLOPs the plan skips.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.results_file import write_results
from ringattn import geometry
from ringattn.geometry import ring_reach

DEFAULT_OUT = Path("benchmarks/results/window.json")
AGREE_TOL = 1e-4
SPLIT_DEFAULT = geometry.SPLIT_WINDOW


@dataclass
class Row:
    seq: int
    ranks: int
    window: int | None
    band: str  # split (unmasked pieces) or masked (the banded kernel); "-" without a window
    ring_fwd_bwd_s: float
    visible_gflops: float
    sdpa_fwd_bwd_s: float
    vs_full_ring: float
    max_rel_diff: float
    agrees: bool
    hops: int  # K/V transfers per rank in the forward (ringattn.geometry.ring_reach)


def _inputs(seq: int, heads: int, kv_heads: int, dim: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, dim, generator=g)
    k, v = (torch.randn(1, seq, kv_heads, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(1, seq, heads, dim, generator=g)


def _visible_flops(seq: int, ranks: int, window: int | None, heads: int, dim: int) -> float:
    lay = geometry.plain_layout(seq, ranks, "zigzag")
    pairs = sum(lay.pairs(r, True, window) for r in range(ranks))
    return 14.0 * pairs * heads * dim


def _band_mode(band: str) -> None:
    """Windows cut into unmasked pieces (the engine's default from SPLIT_WINDOW keys) or
    computed as masked bands; the layouts' cached plans are dropped either way."""
    geometry.SPLIT_WINDOW = SPLIT_DEFAULT if band == "split" else 1 << 62
    geometry.plain_layout.cache_clear()


def _ring_step(q, k, v, dout, ranks: int, window: int | None) -> tuple[float, torch.Tensor]:
    import ringattn
    from ringattn.local_ring import LocalRing

    def stacked(t):
        return torch.cat(
            [
                ringattn.shard_sequence(t, world_size=ranks, rank=r, layout="zigzag")
                for r in range(ranks)
            ],
            dim=1,
        )

    qs, ks, vs, ds = (stacked(t) for t in (q, k, v, dout))
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    start = time.perf_counter()
    out = ringattn.ring_attention(
        qs, ks, vs, causal=True, layout="zigzag", comm=LocalRing(ranks), window=window
    )
    out.backward(ds)
    took = time.perf_counter() - start
    pieces = list(out.detach().chunk(ranks, dim=1))
    return took, ringattn.unshard_sequence(pieces, layout="zigzag")


def _sdpa_step(q, k, v, dout, window: int | None) -> tuple[float, torch.Tensor]:
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & (j > i - window) if window is not None else None
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    out.backward(dout.transpose(1, 2))
    return time.perf_counter() - start, out.detach().transpose(1, 2)


def measure(args) -> list[Row]:
    q, k, v, dout = _inputs(args.seq, args.heads, args.kv_heads, args.head_dim)
    _ring_step(q, k, v, dout, args.ranks, args.windows[0])  # warm-up: first calls pay set-up
    _sdpa_step(q, k, v, dout, None)
    rows, full = [], None
    for window in [None, *args.windows]:
        bands = ["-"] if window is None else args.bands
        times: dict[str, list[float]] = {band: [] for band in bands + ["sdpa"]}
        outs: dict[str, torch.Tensor] = {}  # each band's own output (the last repeat's)
        for _ in range(args.repeats):  # side by side, alternating: the same noise for all
            for band in bands:
                _band_mode("split" if band == "-" else band)
                t, outs[band] = _ring_step(q, k, v, dout, args.ranks, window)
                times[band].append(t)
            t, sdpa_out = _sdpa_step(q, k, v, dout, window)
            times["sdpa"].append(t)
        _band_mode("split")
        # each band against SDPA (one difference after the loop was the last band's for all)
        diffs = {
            band: ((out - sdpa_out).abs().max() / sdpa_out.abs().max()).item()
            for band, out in outs.items()
        }
        hops = sum(ring_reach(args.ranks, args.seq // args.ranks, True, "zigzag", window))
        flops = _visible_flops(args.seq, args.ranks, window, args.heads, args.head_dim)
        for band in bands:
            ring_s = statistics.median(times[band])
            full = ring_s if window is None else full
            rows.append(
                Row(
                    args.seq,
                    args.ranks,
                    window,
                    band,
                    ring_s,
                    flops / ring_s / 1e9,
                    statistics.median(times["sdpa"]),
                    ring_s / full,
                    diffs[band],
                    diffs[band] <= AGREE_TOL,
                    hops,
                )
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: Row) -> str:
    w = "none" if r.window is None else str(r.window)
    flag = "" if r.agrees else "  DISAGREES"
    times = (
        f"{r.ring_fwd_bwd_s:.2f} | {r.visible_gflops:.1f} | {r.sdpa_fwd_bwd_s:.2f} | "
        f"{r.vs_full_ring:.2f}x"
    )
    return (
        f"| {r.seq} | {r.ranks} | {w} | {r.band} | {r.hops} | {times} | "
        f"{r.max_rel_diff:.1e}{flag} |"
    )


HEADER = (
    "| N | P | window | band | K/V hops | ring fwd+bwd s | visible GFLOP/s | SDPA (masked) "
    "fwd+bwd s | ring vs full causal ring | max rel diff |\n|---|---|---|---|---|---|---|---|"
    "---|---|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--windows", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--bands",
        nargs="+",
        choices=["split", "masked"],
        default=["split", "masked"],
        help="how windowed rings compute their bands (both: side by side)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    print(HEADER)
    rows = measure(args)
    write_results(args.out, "window", sys.argv[1:] if argv is None else argv, rows)
    md = args.out.with_suffix(".md")
    md.write_text(
        f"{__doc__.splitlines()[0]}\n\n`python -m benchmarks.window "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{HEADER}\n"
        + "\n".join(_line(r) for r in rows)
        + "\n"
    )
    print(f"wrote {args.out} and {md}")
    return 0 if all(r.agrees for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
