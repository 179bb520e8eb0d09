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
interleaved with the same SDPA runs; ``--transports gloo shm`` runs each engine's ring once per
transport (``RINGATTN_TRANSPORT`` in its ranks). No memory, transfer or forward-only
measurement is taken in this mode (the glibc setting the peak-memory measurement needs would
change every later step's allocations).

Two ratios per row, from the same runs (two harnesses): *ring/SDPA*, the median over the
pairings of the ring's time over its pairing's SDPA time; and *bracketed*: each pairing also
times SDPA again after each ring run, and the ring's time is divided by the faster of the two
SDPA timings around it (the median over the pairings). The second reads a machine that sped
up or slowed down during the pairing in SDPA's favour; where the two differ, the machine
drifted within a pairing. *SDPA again* lists, per pairing, the SDPA timing after the ring
over the one before it: the same work timed twice, so its spread is the resolution of both
ratios on this machine at this time. Each median comes with its distribution-free 95%
interval (``benchmarks.median_interval``, from 6 pairings on): the ring at or below SDPA is
shown where the ratio's interval ends at or below 1.0; SDPA again's interval should hold 1.0.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.attention_workers import Config, RingPool, SdpaProcess, device_kind
from benchmarks.median_interval import MedianInterval, median_interval
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
    ratio_ci: MedianInterval | None  # the median's 95% interval (None: under 6 pairings)
    bracketed: float  # median over the pairings of ring / the faster SDPA around it
    bracketed_ci: MedianInterval | None
    sdpa_again: list[float]  # per pairing, SDPA after this ring / SDPA before it: the noise
    sdpa_again_ci: MedianInterval | None  # should hold 1.0: else the harness is biased
    outside_cores: float | None  # the most any pairing saw
    disturbed: bool


def run_pairings(args) -> list[PairRow]:
    """Every configuration of ``args`` (ranks x seq x mask x layout), in pairings."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    kind, _ = device_kind(args.device)
    engines = [str(Path(e).resolve()) for e in args.engine] if args.engine else [None]
    transports = args.transports or [None]
    sides = list(itertools.product(engines, transports))
    labels = [engine_label(e) + (f" {t}" if t else "") for e, t in sides]
    masks = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    rows: list[PairRow] = []
    print(" ".join(f"{name:{fmt}}" for name, fmt, _ in COLUMNS), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            threads = args.baseline_threads or world * args.threads_per_rank
            pools = [_pool(ctx, world, args.threads_per_rank, tmp, kind, e, t) for e, t in sides]
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


def _pool(ctx, world, threads, tmp, kind, engine, transport) -> RingPool:
    """A ring pool whose ranks start with ``RINGATTN_TRANSPORT=transport`` (None: as set)."""
    saved = os.environ.get("RINGATTN_TRANSPORT")
    if transport:
        os.environ["RINGATTN_TRANSPORT"] = transport  # the spawned ranks inherit it
    try:
        return RingPool(ctx, world, threads, tmp, kind, engine)
    finally:
        if saved is None:
            os.environ.pop("RINGATTN_TRANSPORT", None)
        else:
            os.environ["RINGATTN_TRANSPORT"] = saved


def _pair(args, world: int, cfg: Config, sdpa, pools, labels) -> list[PairRow]:
    """``args.pairings`` pairings of one configuration, the order rotating; one row per ring.
    A pairing: SDPA, then each ring followed by SDPA again (the bracket around each ring)."""
    times, brackets, agains = ({side: [] for side in range(len(pools))} for _ in range(3))
    sdpa_first, loads = [], []
    for i in range(args.pairings):
        order = list(range(len(pools)))
        order = order[i % len(order) :] + order[: i % len(order)]
        with OutsideLoad() as load:
            before = _sdpa_s(sdpa, cfg)
            sdpa_first.append(before)
            for side in order:
                ring = pools[side].run(cfg)["fwd_bwd_s"]
                after = _sdpa_s(sdpa, cfg)
                times[side].append(ring)
                brackets[side].append(ring / min(before, after))
                agains[side].append(after / before)
                before = after
        loads.append(load.reading.outside_cores)
    known = [c for c in loads if c is not None]
    worst = max(known) if known else None
    rows = []
    for side, label in enumerate(labels):
        ratios = [r / s for r, s in zip(times[side], sdpa_first, strict=True)]
        rows.append(
            PairRow(
                label,
                world,
                args.threads_per_rank,
                cfg.seq,
                cfg.causal,
                cfg.layout,
                1e3 * statistics.median(sdpa_first),
                1e3 * statistics.median(times[side]),
                statistics.median(ratios),
                ratios,
                median_interval(ratios),
                statistics.median(brackets[side]),
                median_interval(brackets[side]),
                agains[side],
                median_interval(agains[side]),
                worst,
                worst is not None and worst > args.load_threshold,
            )
        )
        print(" ".join(f"{_cell(rows[-1], a):{fmt}}" for _, fmt, a in COLUMNS), flush=True)
    return rows


def _sdpa_s(sdpa, cfg: Config) -> float:
    return sdpa.run(replace(cfg, layout="contiguous"))["fwd_bwd_s"]


COLUMNS = [
    ("engine", "<10", "engine"),
    ("P", ">2", "ranks"),
    ("N", ">6", "seq"),
    ("mask", "<6", "causal"),
    ("layout", "<10", "layout"),
    ("SDPA f+b ms", ">11", "sdpa_ms"),
    ("ring f+b ms", ">11", "ring_ms"),
    ("ring/SDPA", ">9", "ratio"),
    ("95%", ">11", "ratio_ci"),
    ("pairings", "<24", "ratios"),
    ("bracketed", ">9", "bracketed"),
    ("95%", ">11", "bracketed_ci"),
    ("SDPA again", "<24", "sdpa_again"),
    ("95%", ">11", "sdpa_again_ci"),
    ("outside", ">7", "outside_cores"),
]


def _cell(row: PairRow, attr: str) -> str:
    value = getattr(row, attr)
    if attr == "causal":
        return "causal" if value else "full"
    if attr in ("ratio", "bracketed"):
        return f"{value:.3f}x"
    if attr in ("ratios", "sdpa_again"):
        return " ".join(f"{r:.3f}" for r in value)
    if attr == "outside_cores":
        return "" if value is None else f"{value:.2f}" + ("!" if row.disturbed else "")
    if attr.endswith("_ci"):
        return "-" if value is None else str(value)
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def write_markdown(rows: list[PairRow], path: Path, argv: list[str]) -> None:
    lines = [
        "# Ring vs SDPA, interleaved pairings",
        "",
        f"`python -m benchmarks.attention {' '.join(argv)}`. Each pairing times SDPA and every "
        "ring back to back (order rotating); ring/SDPA is the median of the pairings' "
        "ratios. Each ring run is followed by SDPA again; bracketed divides it by the faster "
        "of the two SDPA timings around it (the median over the pairings). SDPA again: "
        "each pairing's SDPA after the ring over SDPA before it, the same work timed twice: "
        "how far the machine moves within a pairing, the resolution of both ratios. "
        "95%: the median's distribution-free 95% interval (order statistics; from 6 "
        "pairings on).",
        "",
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt, _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r, attr) for _, _, attr in COLUMNS) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
