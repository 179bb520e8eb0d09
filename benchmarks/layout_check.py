"""Would keeping the ring in the kernel's (B, H, S, D) layout pay? The CPU kernel, both ways.

    python -m benchmarks.layout_check                       # N = 8k over P = 2: 4096 per rank
    python -m benchmarks.layout_check --seq-local 8192 --rounds 12

The ring holds q, k, v, out and dout as (B, S, H, D) and hands the CPU kernel transposed views;
the kernel's own layout is (B, H, S, D). This times one ring step's block work (forward, then
backward given out, lse and dout) on the same data held both ways, in alternating rounds in one
process with one thread, so both see the same machine: the gain of changing the ring's layout
is at most the difference. Rounds during which other processes used more than
``--load-threshold`` cores are dropped (and counted). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.outside_load import OutsideLoad

DEFAULT_OUT = Path("benchmarks/results/layout-check.json")


def _ops():
    return (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )


def step_bshd(q, k, v, dout, causal, scale) -> float:
    """Today: (B, S, H, D) tensors passed as transposed views (as TorchCPUKernel does)."""
    fwd, bwd = _ops()
    t0 = time.perf_counter()
    out, lse = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
                   scale=scale)  # fmt: skip
    out = out.transpose(1, 2)
    bwd(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), 0.0, causal, scale=scale)  # fmt: skip
    return time.perf_counter() - t0


def step_bhsd(q, k, v, dout, causal, scale) -> float:
    """The alternative: everything already (B, H, S, D) and contiguous."""
    fwd, bwd = _ops()
    t0 = time.perf_counter()
    out, lse = fwd(q, k, v, 0.0, causal, scale=scale)
    bwd(dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layout_check",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--seq-local", type=int, default=4096, help="tokens per rank")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--causal", action="store_true", help="a causal diagonal block")
    p.add_argument("--load-threshold", type=float, default=0.25, metavar="CORES")
    p.add_argument("--json", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    b, s, h, d = 1, args.seq_local, args.heads, args.head_dim
    bshd = [torch.randn(b, s, h, d) for _ in range(4)]
    bhsd = [t.transpose(1, 2).contiguous() for t in bshd]
    scale = d**-0.5
    steps = {"bshd": step_bshd, "bhsd": step_bhsd}
    inputs = {"bshd": bshd, "bhsd": bhsd}
    step_bshd(*bshd, args.causal, scale), step_bhsd(*bhsd, args.causal, scale)  # warm-up
    kept: dict[str, list[float]] = {"bshd": [], "bhsd": []}
    dropped = 0
    for i in range(args.rounds):
        order = ("bshd", "bhsd") if i % 2 == 0 else ("bhsd", "bshd")  # alternate who goes first
        with OutsideLoad() as load:
            pair = {name: steps[name](*inputs[name], args.causal, scale) for name in order}
        if load.reading.disturbed(args.load_threshold):
            dropped += 1
            continue
        for name, t in pair.items():
            kept[name].append(t)
    if not kept["bshd"]:
        print(f"every round was disturbed (> {args.load_threshold} cores busy outside)")
        return 1
    med = {name: statistics.median(ts) for name, ts in kept.items()}
    gain = 1 - med["bhsd"] / med["bshd"]
    print(f"{'layout':<8} {'median ms':>10}   ({len(kept['bshd'])} rounds kept, {dropped} dropped)")
    for name, m in med.items():
        print(f"{name:<8} {1e3 * m:>10.1f}")
    print(f"(B, H, S, D) saves {gain:+.1%} of a step's block work")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                     "median_s": med, "kept": kept, "dropped": dropped,
                                     "gain": gain}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
