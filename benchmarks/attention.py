"""Ring attention against single-process SDPA on the same total sequence, side by side.

    python -m benchmarks.attention                       # the default sweep, table + JSON
    python -m benchmarks.attention --seq 8192 --ranks 2 --causal true --layouts zigzag

For each configuration, P ring ranks (``--threads-per-rank`` threads each) and one process
running ``torch.nn.functional.scaled_dot_product_attention`` on the whole sequence with
P x threads-per-rank threads take turns on the same machine, so both see the same noise.
Reported per configuration: median forward and forward+backward time over ``--repeats``,
achieved GFLOP/s (FlashAttention accounting: forward 4*B*H*N^2*D, halved when causal;
backward 2.5x forward), peak resident memory added per rank during the step, and the share of
the ring's transfer time hidden behind compute: 1 - (step time - the same ring's step time
with nothing sent) / (time the same transfers take alone, measured right after). The ring
"with nothing sent" is ``ring_attention(..., comm=...)`` given a RingComm that sends nothing;
on GPUs every one of these times is taken with CUDA events. The processes that measure are
benchmarks/attention_workers.py's; ``--pairings`` is benchmarks/pairing.py.

Outside load: the CPU that processes outside this benchmark's process tree used during each
measurement (``benchmarks.outside_load``) is recorded per row, in cores. A measurement during
which it exceeded ``--load-threshold`` is rerun (up to ``--load-retries`` times); the least
disturbed run is kept, and a row still above the threshold is flagged ``!`` in the table and
``"disturbed": true`` in the JSON, so a ratio taken under someone else's load is never read as
the ring's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from benchmarks.attention_workers import Config, RingPool, SdpaProcess, device_kind
from benchmarks.results_file import write_results
from ringattn import switches

DEFAULT_OUT = Path("benchmarks/results/attention.json")
LOAD_THRESHOLD_CORES = 0.25
LOAD_RETRIES = 2


@dataclass
class Result:
    impl: str  # "ringattn", "ring-attention-pytorch" or "sdpa"
    ranks: int
    threads: int
    config: Config
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    fwd_gflops: float = 0.0
    fwd_bwd_gflops: float = 0.0
    peak_mem_mib: float = 0.0  # per rank, above the resident size before the step
    hidden_comm: float | None = None  # ring only
    comm_alone_s: float | None = None
    comm_wait_s: float | None = None
    extra: dict = field(default_factory=dict)


def attention_flops(cfg: Config) -> tuple[float, float]:
    fwd = 4.0 * cfg.batch * cfg.heads * cfg.seq**2 * cfg.head_dim * (0.5 if cfg.causal else 1.0)
    return fwd, fwd * 3.5


# ----------------------------------------------------------------------------- driver
def _guarded(run, args, label: str) -> dict:
    """One measurement, rerun while other jobs used more than the threshold; the least
    disturbed run is kept, with its outside load (cores) and whether it stayed disturbed."""
    from benchmarks.outside_load import OutsideLoad

    threshold = getattr(args, "load_threshold", LOAD_THRESHOLD_CORES)
    retries = getattr(args, "load_retries", LOAD_RETRIES)
    best = None
    for attempt in range(1 + retries):
        with OutsideLoad() as load:
            raw = run()
        reading = load.reading
        if best is None or (reading.outside_cores or 0.0) < (best[1].outside_cores or 0.0):
            best = (raw, reading)
        if not reading.disturbed(threshold):
            break
        more = "rerunning" if attempt < retries else "keeping the least disturbed run"
        print(
            f"# {label}: {reading.outside_cores:.2f} cores busy outside the benchmark; {more}",
            flush=True,
        )
    raw, reading = best
    return {
        **raw,
        "outside_cores": reading.outside_cores,
        "disturbed": reading.disturbed(threshold),
    }


def _note_load(result: Result, raw: dict) -> Result:
    result.extra["outside_cores"] = raw.get("outside_cores")
    result.extra["disturbed"] = bool(raw.get("disturbed"))
    return result


def _peer_installed() -> bool:
    try:
        import ring_attention_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def run_benchmark(args: argparse.Namespace) -> list[Result]:
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: list[Result] = []
    causal_values = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    kind, gpus = device_kind(args.device)
    print(f"# device: {kind}" + (f" ({gpus} GPU(s), NCCL)" if gpus else " (gloo)"), flush=True)
    peer = args.peer and _peer_installed() and kind == "cpu"
    if args.peer and not peer:
        print("ring-attention-pytorch is not installed: pip install -e '.[bench]'", flush=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        for world in args.ranks:
            baseline_threads = args.baseline_threads or world * args.threads_per_rank
            if kind == "cuda" and world > gpus:
                print(f"# P={world}: skipped, {gpus} GPU(s) here", flush=True)
                continue
            ring = partial(RingPool, ctx, world, args.threads_per_rank, tmpdir, kind)
            for seq, causal in itertools.product(args.seq, causal_values):
                base = Config(
                    seq,
                    args.heads,
                    args.kv_heads or args.heads,
                    args.head_dim,
                    args.batch,
                    args.dtype,
                    causal,
                    "contiguous",
                    args.repeats,
                )
                baseline = None
                if not args.no_baseline:  # first, so each ring row can show its ratio
                    sdpa = partial(SdpaProcess, ctx, baseline_threads, kind)
                    raw = _guarded(partial(fresh_run, sdpa, base), args, f"SDPA N={seq}")
                    baseline = _note_load(_sdpa_result(base, baseline_threads, raw), raw)
                    baseline.extra["for_ranks"] = world
                    results.append(baseline)
                    _print_row(baseline, None)
                runs = [replace(base, layout=layout) for layout in args.layouts]
                if peer and world > 1 and seq <= args.peer_max_seq:
                    runs.append(replace(base, impl="ring-attention-pytorch"))
                for cfg in runs:
                    if seq % (world * (2 if cfg.layout == "zigzag" else 1)):
                        continue
                    label = f"ring P={world} N={seq}"
                    raw = _guarded(partial(fresh_run, ring, cfg), args, label)
                    results.append(_note_load(_ring_result(cfg, world, args, raw), raw))
                    _print_row(results[-1], baseline)
    return results


def fresh_run(start, cfg: Config) -> dict:
    """One measurement in processes of its own (``start()`` makes them). The peak-memory step
    that ends a measurement fixes glibc's mmap threshold for the rest of a process's life, so
    every later large allocation there would be a fresh mmap, page-faulted afresh: a process
    that measured once would time the next configuration under another allocator."""
    procs = start()
    try:
        return procs.run(cfg)
    finally:
        procs.close()


def _ring_result(cfg: Config, world: int, args, raw: dict) -> Result:
    fwd_flops, fwd_bwd_flops = attention_flops(cfg)
    # Hidden share: 1 - (time the transfers added to the step) / (time they take alone).
    # What they added is the step's time minus the same ring's time with nothing sent.
    hidden = None
    if raw.get("no_transfer_s") and raw["comm_alone_s"] > 0:
        exposed = max(0.0, raw["fwd_bwd_s"] - raw["no_transfer_s"])
        hidden = max(0.0, min(1.0, 1.0 - exposed / raw["comm_alone_s"]))
    result = Result(
        cfg.impl,
        world,
        args.threads_per_rank,
        cfg,
        raw["fwd_s"],
        raw["fwd_bwd_s"],
        fwd_flops / raw["fwd_s"] / 1e9,
        fwd_bwd_flops / raw["fwd_bwd_s"] / 1e9,
        raw["peak_mib"],
        hidden,
        raw["comm_alone_s"],
        raw["wait_s"],
    )
    if raw.get("no_transfer_s"):
        result.extra["no_transfer_fwd_bwd_s"] = raw["no_transfer_s"]
        result.extra["bytes_sent"] = raw.get("bytes_sent")
        result.extra["bytes_alone"] = raw.get("bytes_alone")
    if args.predict and cfg.impl == "ringattn":
        result.extra.update(predict(cfg, world, args.predict))
    return result


def predict(cfg: Config, world: int, device_name: str) -> dict:
    """What `ringctl plan` predicts for this configuration on a calibrated device."""
    from ringctl.planner.cost import Workload, estimate, nominal_link
    from ringctl.planner.devices import get_device

    device = get_device(device_name)
    link = nominal_link(device)
    work = Workload(
        seq_len=cfg.seq,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        batch=cfg.batch,
        dtype=cfg.dtype,
        causal=cfg.causal,
        layout=cfg.layout,
    )
    est = estimate(work, world, device, link, ranks_on_host=world)
    return {
        "predicted_fwd_s": est.total_s["forward"],
        "predicted_fwd_bwd_s": est.total_s["forward+backward"],
        "predicted_peak_mib": sum(est.memory_bytes.values()) / 2**20,
    }


def _sdpa_result(cfg: Config, threads: int, raw: dict) -> Result:
    fwd_flops, fwd_bwd_flops = attention_flops(cfg)
    return Result(
        "sdpa",
        1,
        threads,
        cfg,
        raw["fwd_s"],
        raw["fwd_bwd_s"],
        fwd_flops / raw["fwd_s"] / 1e9,
        fwd_bwd_flops / raw["fwd_bwd_s"] / 1e9,
        raw["peak_mib"],
    )


COLUMNS = [
    ("impl", "<22"),
    ("P", ">2"),
    ("thr", ">3"),
    ("N", ">6"),
    ("mask", "<6"),
    ("layout", "<10"),
    ("fwd ms", ">8"),
    ("f+b ms", ">9"),
    ("f+b GF/s", ">8"),
    ("peak MiB/rank", ">13"),
    ("hidden", ">6"),
    ("f+b vs SDPA", ">11"),
    ("predicted f+b ms", ">16"),
    ("outside", ">7"),
]


def _cells(r: Result, baseline: Result | None) -> list[str]:
    c = r.config
    if baseline is not None and r.impl != "sdpa":
        r.extra["fwd_bwd_over_sdpa"] = r.fwd_bwd_s / baseline.fwd_bwd_s
    pred = r.extra.get("predicted_fwd_bwd_s")
    return [
        r.impl,
        str(r.ranks),
        str(r.threads),
        str(c.seq),
        "causal" if c.causal else "full",
        "-" if r.impl == "sdpa" else c.layout,
        f"{1e3 * r.fwd_s:.1f}",
        f"{1e3 * r.fwd_bwd_s:.1f}",
        f"{r.fwd_bwd_gflops:.1f}",
        f"{r.peak_mem_mib:.1f}",
        "" if r.hidden_comm is None else f"{100 * r.hidden_comm:.0f}%",
        f"{r.extra['fwd_bwd_over_sdpa']:.2f}x" if "fwd_bwd_over_sdpa" in r.extra else "",
        "" if pred is None else f"{1e3 * pred:.1f} ({pred / r.fwd_bwd_s:.2f}x)",
        load_cell(r),
    ]


def load_cell(r: Result) -> str:
    """Other jobs' CPU use during the row's measurement, in cores; '!' when over threshold."""
    cores = r.extra.get("outside_cores")
    if cores is None:
        return ""
    return f"{cores:.2f}" + ("!" if r.extra.get("disturbed") else "")


def _print_header() -> None:
    print(" ".join(f"{name:{fmt}}" for name, fmt in COLUMNS), flush=True)


def _print_row(r: Result, baseline: Result | None) -> None:
    cells = _cells(r, baseline)
    print(
        " ".join(f"{cell:{fmt}}" for cell, (_, fmt) in zip(cells, COLUMNS, strict=True)), flush=True
    )


def write_markdown(results: list[Result], path: Path, argv: list[str], repeats: int = 1) -> None:
    """The table; ``repeats`` 0 (a memory run) times one step each: said so, not "Medians"."""
    timed = (
        "Medians"
        if repeats
        else "One timed step each (a memory run, --repeats 0): times and ratios are single samples"
    )
    lines = [
        "# Attention benchmark",
        "",
        f"`python -m benchmarks.attention {' '.join(argv)}` on {os.uname().nodename} "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}. {timed}; ring ranks and the "
        "single-process SDPA baseline share the same cores and run in turn.",
        "",
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt in COLUMNS) + "|",
    ]
    baseline = None
    for r in results:
        baseline = r if r.impl == "sdpa" else baseline
        lines.append("| " + " | ".join(_cells(r, baseline if r.impl != "sdpa" else None)) + " |")
    path.write_text("\n".join(lines) + "\n")


def write_plots(results: list[Result], prefix: Path) -> list[Path]:
    """Time and peak memory against N: one panel per ring size P, each with its SDPA baseline
    (the same cores), the peer where timed, and ringctl plan's prediction (dotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", flush=True)
        return []

    def panel_of(r: Result) -> int:
        return r.extra.get("for_ranks", r.threads) if r.impl == "sdpa" else r.ranks

    panels = sorted({panel_of(r) for r in results})
    written = []
    for attr, ylabel in (
        ("fwd_bwd_s", "forward+backward time (s)"),
        ("peak_mem_mib", "peak MiB per rank"),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
        for ax, world in zip(axes[0], panels, strict=True):
            series: dict[str, list[Result]] = {}
            for r in (r for r in results if panel_of(r) == world):
                c = r.config
                label = f"{r.impl} {'causal' if c.causal else 'full'}"
                label += f" ({r.threads} threads)" if r.impl == "sdpa" else f" {c.layout}"
                series.setdefault(label, []).append(r)
            for label, rows in sorted(series.items()):
                rows = sorted(rows, key=lambda r: r.config.seq)
                xs = [r.config.seq for r in rows]
                style = "--" if rows[0].impl == "sdpa" else "-"
                (line,) = ax.plot(
                    xs, [getattr(r, attr) for r in rows], style, marker="o", label=label
                )
                if attr == "fwd_bwd_s" and "predicted_fwd_bwd_s" in rows[0].extra:
                    ax.plot(
                        xs,
                        [r.extra["predicted_fwd_bwd_s"] for r in rows],
                        ":",
                        marker="x",
                        color=line.get_color(),
                    )
            ax.set_title(f"P = {world} ranks" + (" (dotted: ringctl plan)" if world > 1 else ""))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("total sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        path = prefix.with_name(f"{prefix.name}-{attr.split('_s')[0].replace('_', '-')}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.attention",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384], help="total tokens N")
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="ring sizes P to sweep")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="both", choices=["true", "false", "both"])
    p.add_argument("--layouts", nargs="+", default=["zigzag"], choices=["contiguous", "zigzag"])
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repetitions, median reported; 0: one step, for peak memory only",
    )
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: one GPU per rank with NCCL (and flash-attn where installed) when CUDA is "
        "here, P limited to the GPUs; else CPU ranks with gloo",
    )
    p.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="SDPA threads (default: P x threads-per-rank, the same cores)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the SDPA comparison")
    p.add_argument(
        "--pairings",
        type=int,
        default=0,
        metavar="K",
        help="time SDPA and each engine's ring back to back K times, order rotating, and "
        "report the median of the K ring/SDPA ratios (benchmarks/pairing.py); forward+backward "
        "only",
    )
    p.add_argument(
        "--engine",
        nargs="+",
        default=None,
        metavar="CHECKOUT",
        help="with --pairings: checkouts whose ringattn to run, interleaved (default: this one)",
    )
    p.add_argument(
        "--transports",
        nargs="+",
        default=None,
        choices=switches.CHOICES[switches.TRANSPORT],
        help="with --pairings: run each ring once per transport (RINGATTN_TRANSPORT in its "
        "ranks; default: as the environment sets it)",
    )
    p.add_argument(
        "--load-threshold",
        type=float,
        default=LOAD_THRESHOLD_CORES,
        metavar="CORES",
        help="a measurement during which other processes used more CPU than this (cores) is "
        f"rerun, and flagged if it stays above (default {LOAD_THRESHOLD_CORES})",
    )
    p.add_argument(
        "--load-retries",
        type=int,
        default=LOAD_RETRIES,
        help=f"reruns of a disturbed measurement (default {LOAD_RETRIES})",
    )
    p.add_argument(
        "--peer-max-seq",
        type=int,
        default=4096,
        help="time the peer only up to this N (it is an order of magnitude slower)",
    )
    p.add_argument(
        "--peer",
        action="store_true",
        help="also time ring-attention-pytorch where installed (extra: bench)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument(
        "--rerender",
        type=Path,
        metavar="JSON",
        help="measure nothing: rewrite a saved run's markdown and plots (and, with --predict, "
        "its predictions from the current model)",
    )
    p.add_argument(
        "--predict",
        metavar="DEVICE",
        help="add `ringctl plan`'s prediction from this (calibrated) device entry",
    )
    return p


def load_results(path: Path, predict_device: str | None) -> tuple[list[Result], list[str]]:
    """A saved run, its predictions recomputed with today's model when a device is given."""
    data = json.loads(path.read_text())
    results = []
    for row in data["results"]:
        row["config"] = Config(**row["config"])
        r = Result(**row)
        r.extra = {k: v for k, v in r.extra.items() if not k.startswith("predicted_")}
        if predict_device and r.impl == "ringattn":
            r.extra.update(predict(r.config, r.ranks, predict_device))
        results.append(r)
    return results, data.get("argv", [])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank))
    if args.pairings:
        return _main_pairings(args, sys.argv[1:] if argv is None else argv)
    _print_header()
    if args.rerender:
        results, run_argv = load_results(args.rerender, args.predict)
        args.json = args.rerender
        for r in results:
            _print_row(r, None)
    else:
        results, run_argv = run_benchmark(args), sys.argv[1:] if argv is None else argv
    write_results(args.json, "attention", run_argv, results)
    markdown = args.json.with_suffix(".md")
    write_markdown(results, markdown, run_argv, build_parser().parse_args(run_argv).repeats)
    plots = write_plots(results, args.json.with_suffix(""))
    print(f"wrote {args.json}, {markdown}" + "".join(f", {p}" for p in plots))
    return 0


def _main_pairings(args, run_argv: list[str]) -> int:
    from benchmarks import pairing

    if args.json == DEFAULT_OUT:
        args.json = DEFAULT_OUT.with_name("attention-pairings.json")
    rows = pairing.run_pairings(args)
    write_results(args.json, "attention-pairings", run_argv, rows)
    pairing.write_markdown(rows, args.json.with_suffix(".md"), run_argv)
    print(f"wrote {args.json}, {args.json.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
