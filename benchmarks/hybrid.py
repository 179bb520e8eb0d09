"""Flat ring against hybrid Ulysses x ring grids on the same ranks, side by side.

    python -m benchmarks.hybrid                               # 4 ranks: 1x4, 2x2, 4x1
    python -m benchmarks.hybrid --ranks 4 --seq 8192 --degrees 1 2 4 --causal true

One pool of P ranks (``--threads-per-rank`` threads each, gloo on CPU) runs every grid in
turn on the same global inputs: U = 1 is the flat ring (``ring_attention``, zigzag, over all
P ranks), U > 1 is ``hybrid_attention`` with Ulysses groups of U consecutive ranks and a ring
of P/U groups (``hybrid-zigzag``). Reported per grid: median forward and forward+backward
time over ``--repeats`` (a step ends when its slowest rank does), achieved GFLOP/s
(FlashAttention accounting, as benchmarks/attention.py), the time spent in all-to-alls (which
includes waiting for the group's slowest member to arrive) and blocked waiting on ring
transfers during forward+backward (slowest rank), the bytes each rank
sends per forward+backward, and the output's largest difference from the flat ring's
(relative to its largest value): every grid computes the same attention, and a grid whose
output differs beyond float32 rounding is reported as such, not timed as if it were right.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from benchmarks.results_file import write_results

DEFAULT_OUT = Path("benchmarks/results/hybrid.json")
AGREE_TOL = 1e-4  # float32 outputs of two exact algorithms differ by rounding only


@dataclass(frozen=True)
class Config:
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool
    degree: int  # Ulysses degree U; 1 = flat ring
    repeats: int


@dataclass
class Result:
    grid: str  # "U x R"
    ranks: int
    threads: int
    config: Config
    fwd_s: float
    fwd_bwd_s: float
    fwd_bwd_gflops: float
    a2a_s: float
    ring_wait_s: float
    ring_mib: float
    a2a_mib: float
    diff_vs_flat: float | None
    extra: dict = field(default_factory=dict)


def attention_flops(cfg: Config) -> tuple[float, float]:
    fwd = 4.0 * cfg.batch * cfg.heads * cfg.seq**2 * cfg.head_dim * (0.5 if cfg.causal else 1.0)
    return fwd, fwd * 3.5


# ----------------------------------------------------------------------------- ranks
def _worker(rank, world, threads, init, degrees, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from ringattn.hybrid import hybrid_groups

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    grids = {u: hybrid_groups(u) for u in degrees if u > 1}  # collective: same order everywhere
    flat: dict = {}  # (seq, causal) -> the flat ring's full output, to compare grids against
    while (cfg := tasks.get()) is not None:
        try:
            results.put((rank, "ok", _measure(cfg, rank, world, grids, flat)))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _inputs(cfg: Config, rank: int, world: int):
    """This rank's shards of the same seeded global q, k, v, dout, in the grid's layout."""
    import torch

    from ringattn.layouts import shard_sequence

    layout = "zigzag" if cfg.degree == 1 else "hybrid-zigzag"
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg.dtype)
    shapes = {"q": cfg.heads, "k": cfg.kv_heads, "v": cfg.kv_heads, "dout": cfg.heads}
    out = {}
    for name, heads in shapes.items():
        full = torch.randn(cfg.batch, cfg.seq, heads, cfg.head_dim, generator=g).to(dtype)
        out[name] = shard_sequence(
            full, world_size=world, rank=rank, layout=layout, ulysses_degree=cfg.degree
        )
    return layout, out


def _attend(cfg: Config, layout: str, grids: dict):
    import ringattn
    from ringattn.hybrid import hybrid_attention

    if cfg.degree == 1:
        return lambda q, k, v: ringattn.ring_attention(q, k, v, causal=cfg.causal, layout=layout)
    groups = grids[cfg.degree]
    return lambda q, k, v: hybrid_attention(
        q,
        k,
        v,
        causal=cfg.causal,
        layout=layout,
        ulysses_group=groups.ulysses,
        ring_group=groups.ring,
    )


def _slowest(dist, torch, values: list[float]) -> list[float]:
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).max(0).values.tolist()


def _measure(cfg: Config, rank: int, world: int, grids: dict, flat: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ringattn.comm import STATS as RING
    from ringattn.layouts import unshard_sequence
    from ringattn.ulysses import STATS as A2A

    layout, x = _inputs(cfg, rank, world)
    attend = _attend(cfg, layout, grids)

    def step(backward: bool) -> list[float]:
        q, k, v = (x[n].detach().requires_grad_(backward) for n in ("q", "k", "v"))
        RING.reset(enabled=True)
        A2A.reset(enabled=True)
        dist.barrier()
        start = time.perf_counter()
        out = attend(q, k, v)
        if backward:
            out.backward(x["dout"])
        elapsed = time.perf_counter() - start
        sent = [RING.bytes_sent, A2A.bytes_sent, A2A.seconds, RING.wait_s]
        RING.reset(enabled=False)
        A2A.reset(enabled=False)
        return _slowest(dist, torch, [elapsed, *sent])

    step(True)  # warm-up: allocator, thread pools, gloo pairs
    fwd = [step(False)[0] for _ in range(cfg.repeats)]
    fwd_bwd = [step(True) for _ in range(cfg.repeats)]
    with torch.no_grad():
        shard = attend(x["q"], x["k"], x["v"])
    shards = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(shards, shard)
    full = unshard_sequence(shards, layout=layout, ulysses_degree=cfg.degree).double()
    key = (cfg.seq, cfg.causal)
    if cfg.degree == 1:
        flat[key] = full
    diff = None
    if key in flat:
        diff = ((full - flat[key]).abs().max() / flat[key].abs().max()).item()

    def median(i: int) -> float:
        return statistics.median(r[i] for r in fwd_bwd)

    return {
        "fwd_s": statistics.median(fwd),
        "fwd_bwd_s": median(0),
        "ring_bytes": median(1),
        "a2a_bytes": median(2),
        "a2a_s": median(3),
        "ring_wait_s": median(4),
        "diff": diff,
    }


class Pool:
    """P ranks kept alive across configurations (spawning torch costs seconds)."""

    def __init__(self, ctx, world: int, threads: int, tmpdir: str, degrees: list[int]) -> None:
        init = f"file://{tmpdir}/hybrid-store-{world}-{os.getpid()}"
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, threads, init, degrees, self.tasks[r], self.results)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, cfg: Config) -> dict:
        for t in self.tasks:
            t.put(cfg)
        out = {}
        for _ in self.procs:
            rank, status, value = _get(self.results, self.procs)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
        return out[0]  # every rank returns the slowest rank's figures

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)


def _get(results, procs):
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(
                    f"benchmark process exited with code {dead[0].exitcode}"
                ) from None


# ----------------------------------------------------------------------------- driver
def _check_degrees(args) -> None:
    for u in args.degrees:
        if u < 1 or args.ranks % u:
            raise SystemExit(f"--degrees: U={u} does not divide --ranks {args.ranks}")
        if args.heads % u or (args.kv_heads % u and u % args.kv_heads):
            raise SystemExit(
                f"--degrees: U={u} needs heads ({args.heads}) divisible by U and kv_heads "
                f"({args.kv_heads}) dividing or divided by U"
            )


def run_benchmark(args: argparse.Namespace) -> list[Result]:
    import math
    import tempfile

    import torch.multiprocessing as mp

    _check_degrees(args)
    ctx = mp.get_context("spawn")
    degrees = sorted(set(args.degrees))  # U = 1 (flat) first: the others compare against it
    causal_values = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    results = []
    with tempfile.TemporaryDirectory() as tmpdir:
        pool = Pool(ctx, args.ranks, args.threads_per_rank, tmpdir, degrees)
        try:
            for seq in args.seq:
                for causal in causal_values:
                    base = Config(
                        seq,
                        args.heads,
                        args.kv_heads,
                        args.head_dim,
                        args.batch,
                        args.dtype,
                        causal,
                        1,
                        args.repeats,
                    )
                    flat = None
                    for u in degrees:
                        cfg = replace(base, degree=u)
                        multiple = math.lcm(args.ranks, 2 * (args.ranks // u))
                        if seq % multiple:
                            print(f"# N={seq}: U={u} needs N a multiple of {multiple}; skipped")
                            continue
                        results.append(_result(cfg, args, pool.run(cfg)))
                        flat = results[-1] if u == 1 else flat
                        _print_row(results[-1], flat)
        finally:
            pool.close()
    return results


def _result(cfg: Config, args, raw: dict) -> Result:
    _, fwd_bwd_flops = attention_flops(cfg)
    mib = 2.0**20
    result = Result(
        f"{cfg.degree}x{args.ranks // cfg.degree}",
        args.ranks,
        args.threads_per_rank,
        cfg,
        raw["fwd_s"],
        raw["fwd_bwd_s"],
        fwd_bwd_flops / raw["fwd_bwd_s"] / 1e9,
        raw["a2a_s"],
        raw["ring_wait_s"],
        raw["ring_bytes"] / mib,
        raw["a2a_bytes"] / mib,
        raw["diff"],
    )
    if raw["diff"] is not None and not raw["diff"] <= AGREE_TOL:
        result.extra["disagrees_with_flat"] = True
    return result


COLUMNS = [
    ("grid UxR", "<8"),
    ("P", ">2"),
    ("N", ">6"),
    ("mask", "<6"),
    ("fwd ms", ">8"),
    ("f+b ms", ">9"),
    ("f+b GF/s", ">8"),
    ("a2a ms", ">7"),
    ("ring wait ms", ">12"),
    ("ring MiB", ">8"),
    ("a2a MiB", ">8"),
    ("f+b vs flat", ">11"),
    ("diff vs flat", ">12"),
]


def _cells(r: Result, flat: Result | None) -> list[str]:
    c = r.config
    if flat is not None:
        r.extra["fwd_bwd_over_flat"] = r.fwd_bwd_s / flat.fwd_bwd_s
    diff = "" if r.diff_vs_flat is None else f"{r.diff_vs_flat:.1e}"
    if r.extra.get("disagrees_with_flat"):
        diff += " WRONG"
    return [
        r.grid,
        str(r.ranks),
        str(c.seq),
        "causal" if c.causal else "full",
        f"{1e3 * r.fwd_s:.1f}",
        f"{1e3 * r.fwd_bwd_s:.1f}",
        f"{r.fwd_bwd_gflops:.1f}",
        f"{1e3 * r.a2a_s:.1f}",
        f"{1e3 * r.ring_wait_s:.1f}",
        f"{r.ring_mib:.2f}",
        f"{r.a2a_mib:.2f}",
        f"{r.extra['fwd_bwd_over_flat']:.2f}x" if "fwd_bwd_over_flat" in r.extra else "",
        diff,
    ]


def _line(cells: list[str]) -> str:
    return " ".join(f"{cell:{fmt}}" for cell, (_, fmt) in zip(cells, COLUMNS, strict=True))


def _print_row(r: Result, flat: Result | None) -> None:
    print(_line(_cells(r, flat)), flush=True)


def write_markdown(results: list[Result], path: Path, argv: list[str]) -> None:
    lines = [
        "# Hybrid sequence parallelism benchmark",
        "",
        f"`python -m benchmarks.hybrid {' '.join(argv)}` on {os.uname().nodename} "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}. Medians; every grid runs on "
        "the same ranks and inputs, in turn. Bytes and times are per rank per forward+backward "
        "(slowest rank).",
        "",
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt in COLUMNS) + "|",
    ]
    flat = None
    for r in results:
        flat = r if r.config.degree == 1 else flat
        same = flat is not None and (flat.config.seq, flat.config.causal) == (
            r.config.seq,
            r.config.causal,
        )
        lines.append("| " + " | ".join(_cells(r, flat if same else None)) + " |")
    path.write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hybrid",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--ranks", type=int, default=4, help="P, the ranks every grid uses")
    p.add_argument(
        "--degrees",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="Ulysses degrees U to compare (1: the flat ring)",
    )
    p.add_argument("--seq", type=int, nargs="+", default=[8192], help="total tokens N")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--causal", default="both", choices=["true", "false", "both"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions, median reported")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank))
    print(_line([name for name, _ in COLUMNS]), flush=True)
    results = run_benchmark(args)
    run_argv = sys.argv[1:] if argv is None else argv
    write_results(args.json, "hybrid", run_argv, results)
    markdown = args.json.with_suffix(".md")
    write_markdown(results, markdown, run_argv)
    print(f"wrote {args.json}, {markdown}")
    wrong = [r.grid for r in results if r.extra.get("disagrees_with_flat")]
    if wrong:
        print(f"grids whose output differs from the flat ring's beyond {AGREE_TOL}: {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
