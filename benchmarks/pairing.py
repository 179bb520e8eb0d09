"""Ring against SDPA in interleaved pairings (``python -m benchmarks.attention --pairings K``).

A ratio taken from two measurements minutes apart carries whatever changed on the machine in
between; on a small machine that is several percent either way. Here each pairing times SDPA
(one process, P x threads-per-rank threads) and every engine's ring (P gloo ranks, one
process each) back to back, forward+backward (one warm-up step, then the median of
``--repeats``), the order rotated from one pairing to the next; a pairing's ratio is ring /
SDPA within that pairing. Reported per engine and configuration: the median ratio over the
pairings, every pairing's ratio, and the most CPU other jobs used during a pairing (cores;
``!`` above ``--load-threshold``). ``--engine`` names checkouts whose ``ringattn`` runs under
the same harness (a worktree of the commit before a change, and this one): before and after,
interleaved with the same SDPA runs. No memory, transfer or forward-only measurement is taken
in this mode (the glibc setting the peak-memory measurement needs would change every later
step's allocations).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.attention_workers import Config, RingPool, SdpaProcess, device_kind
from benchmarks.outside_load import OutsideLoad
from benchmarks.overhead import engine_label


@dataclass
class PairRow:
    engine: str
    ranks: int
    threads: int
    seq: int
    causal: bool
    layout: str
    sdpa_ms: float  # medians over the pairings
    ring_ms: float
    ratio: float  # median over the pairings of ring / SDPA
    ratios: list[float]
    outside_cores: float | None  # the most any pairing saw
    disturbed: bool


def run_pairings(args) -> list[PairRow]:
    """Every configuration of ``args`` (ranks x seq x mask x layout), in pairings."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    kind, _ = device_kind(args.device)
    engines = [str(Path(e).resolve()) for e in args.engine] if args.engine else [None]
    labels = [engine_label(e) for e in engines]
    masks = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    rows: list[PairRow] = []
    print(" ".join(f"{name:{fmt}}" for name, fmt, _ in COLUMNS), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            threads = args.baseline_threads or world * args.threads_per_rank
            pools = [RingPool(ctx, world, args.threads_per_rank, tmp, kind, e) for e in engines]
            sdpa = SdpaProcess(ctx, threads, kind)
            try:
                for seq, causal, layout in itertools.product(args.seq, masks, args.layouts):
                    base = Config(
                        seq,
                        args.heads,
                        args.kv_heads or args.heads,
                        args.head_dim,
                        args.batch,
                        args.dtype,
                        causal,
                        layout,
                        args.repeats,
                        lean=True,
                    )
                    rows += _pair(args, world, base, sdpa, pools, labels)
            finally:
                for pool in pools:
                    pool.close()
                sdpa.close()
    return rows


def _pair(args, world: int, cfg: Config, sdpa, pools, labels) -> list[PairRow]:
    """``args.pairings`` pairings of one configuration, the order rotating; one row per engine."""
    sides = ["sdpa", *range(len(pools))]
    times: dict = {side: [] for side in sides}
    loads = []
    for i in range(args.pairings):
        order = sides[i % len(sides) :] + sides[: i % len(sides)]
        with OutsideLoad() as load:
            for side in order:
                run = (
                    sdpa.run(replace(cfg, layout="contiguous"))
                    if side == "sdpa"
                    else (pools[side].run(cfg))
                )
                times[side].append(run["fwd_bwd_s"])
        loads.append(load.reading.outside_cores)
    known = [c for c in loads if c is not None]
    worst = max(known) if known else None
    rows = []
    for side, label in enumerate(labels):
        ratios = [r / s for r, s in zip(times[side], times["sdpa"], strict=True)]
        rows.append(
            PairRow(
                label,
                world,
                args.threads_per_rank,
                cfg.seq,
                cfg.causal,
                cfg.layout,
                1e3 * statistics.median(times["sdpa"]),
                1e3 * statistics.median(times[side]),
                statistics.median(ratios),
                ratios,
                worst,
                worst is not None and worst > args.load_threshold,
            )
        )
        print(" ".join(f"{_cell(rows[-1], a):{fmt}}" for _, fmt, a in COLUMNS), flush=True)
    return rows


COLUMNS = [
    ("engine", "<10", "engine"),
    ("P", ">2", "ranks"),
    ("N", ">6", "seq"),
    ("mask", "<6", "causal"),
    ("layout", "<10", "layout"),
    ("SDPA f+b ms", ">11", "sdpa_ms"),
    ("ring f+b ms", ">11", "ring_ms"),
    ("ring/SDPA", ">9", "ratio"),
    ("pairings", "<24", "ratios"),
    ("outside", ">7", "outside_cores"),
]


def _cell(row: PairRow, attr: str) -> str:
    value = getattr(row, attr)
    if attr == "causal":
        return "causal" if value else "full"
    if attr == "ratio":
        return f"{value:.3f}x"
    if attr == "ratios":
        return " ".join(f"{r:.3f}" for r in value)
    if attr == "outside_cores":
        return "" if value is None else f"{value:.2f}" + ("!" if row.disturbed else "")
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def write_markdown(rows: list[PairRow], path: Path, argv: list[str]) -> None:
    lines = [
        "# Ring vs SDPA, interleaved pairings",
        "",
        f"`python -m benchmarks.attention {' '.join(argv)}`. Each pairing times SDPA and every "
        "engine's ring back to back (order rotating); ring/SDPA is the median of the "
        "pairings' ratios.",
        "",
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt, _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r, attr) for _, _, attr in COLUMNS) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
