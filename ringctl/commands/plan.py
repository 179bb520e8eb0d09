"""`ringctl plan`: memory, step time and overlap of a ring job before the queue wait."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UserError
from ..planner.cost import (
    GIB,
    Link,
    ModelShape,
    Workload,
    estimate,
    fewest_ranks,
    longest_sequence,
    nominal_link,
)
from ..planner.devices import Device, get_device, save_user_device

DEFAULT_DEVICE = "H100-SXM"

EPILOG = """\
examples:
  # a 1M-token causal forward+backward over 64 H100s on 8 nodes (NDR InfiniBand between nodes)
  ringctl plan --seq 1048576 --ranks 64 --nodes 8 --device H100-SXM \\
      --heads 32 --kv-heads 8 --head-dim 128 --layers 32 --hidden 4096 --vocab 128256
  # size a job config (its task, ranks, nodes and `device`), overrides as for submit
  ringctl plan jobs/attention.yaml nodes=8 tasks_per_node=8 device=H100-SXM task.seq_len=1048576
  # use the ring's real bottleneck hop from `ringctl topo ... -o plan.json`
  ringctl plan --seq 262144 --ranks 16 --device A100-80GB --topology plan.json
  # measure this machine (block kernel + rank-to-rank exchange) and store it as a device
  ringctl plan --calibrate
  ringctl plan --seq 16384 --ranks 2 --device cpu-$(hostname -s) --dtype float32 --heads 8

Devices: A100-40GB, A100-80GB, H100-SXM, H100-PCIe, H200, B200, L40S (nominal datasheet
figures, ringctl/planner/data/devices.json), plus entries from --calibrate and --devices FILE.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="estimate memory, step time and overlap before submitting",
        description=(
            "Estimate per-rank memory (broken down), per-step compute and transfer time over the "
            "ring's slowest hop, whether the transfer hides behind compute (and the fewest tokens "
            "per rank for which it does), the total time, the longest sequence that fits and the "
            "fewest ranks that fit the sequence."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job", nargs="?", metavar="JOB", help="a job config to size (optional)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of JOB")
    w = p.add_argument_group("workload")
    w.add_argument("--seq", type=int, help="total sequence length N (tokens)")
    w.add_argument("--batch", type=int, default=1)
    w.add_argument("--heads", type=int, default=32)
    w.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    w.add_argument("--head-dim", type=int, default=128)
    w.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    w.add_argument("--task", default="forward+backward", choices=["forward", "forward+backward"])
    w.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    w.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    m = p.add_argument_group("model (optional: attention only without it)")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--intermediate", type=int)
    m.add_argument("--vocab", type=int, default=32000)
    r = p.add_argument_group("ranks and links")
    r.add_argument("--ranks", type=int, help="ring size P")
    r.add_argument("--nodes", type=int, default=1, help="nodes the ranks span")
    r.add_argument("--device", default=DEFAULT_DEVICE, help="device table entry (see below)")
    r.add_argument("--devices", type=Path, help="extra device table (JSON) overriding entries")
    r.add_argument("--topology", type=Path, help="a `ringctl topo` plan: use its bottleneck hop")
    r.add_argument(
        "--link-gbit", type=float, help="bottleneck hop bandwidth in Gbit/s (overrides nominal)"
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--calibrate", action="store_true", help="measure this machine, store it")
    p.set_defaults(func=run)


def _link(args, device: Device) -> Link:
    if args.link_gbit:
        return Link("given", args.link_gbit)
    if args.topology:
        try:
            plan = json.loads(args.topology.read_text())
            hop = plan["bottleneck"]
            return Link(str(hop["link"]), float(hop["gbps"]))
        except FileNotFoundError:
            raise UserError(f"{args.topology}: no such file") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise UserError(f"{args.topology}: not a ringctl topo plan ({err})") from None
    return nominal_link(device, args.nodes)


def _workload(args) -> Workload:
    if not args.seq:
        raise UserError("--seq is required (total sequence length in tokens)")
    model = None
    if args.layers or args.hidden:
        if not (args.layers and args.hidden):
            raise UserError("a model needs both --layers and --hidden")
        model = ModelShape(args.layers, args.hidden, args.intermediate, args.vocab)
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        raise UserError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    return Workload(
        seq_len=args.seq, heads=args.heads, kv_heads=kv, head_dim=args.head_dim,
        batch=args.batch, dtype=args.dtype, causal=not args.no_causal, layout=args.layout,
        backward=args.task == "forward+backward", model=model,
    )  # fmt: skip


def _workload_from_job(args) -> Workload:
    """The workload, ranks, nodes and device of a job config (flags given too still win)."""
    from ..config import load_job, world_size
    from ..tasks import get_spec

    cfg = load_job(args.job, args.overrides)
    make = getattr(get_spec(str(cfg.task.name)).module, "workload", None)
    work = make(cfg) if make else None
    if work is None:
        raise UserError(
            f"{args.job}: the {cfg.task.name} task does not describe its attention up front "
            "(document lengths are known only when read); use the flags (--seq, --heads, ...)"
        )
    args.ranks = args.ranks or world_size(cfg)
    args.nodes = args.nodes if args.nodes != 1 else int(cfg.nodes)
    if cfg.get("device") and args.device == DEFAULT_DEVICE:
        args.device = str(cfg.device)
    return work


def run(args) -> int:
    if args.calibrate:
        device = calibrate_and_store()
        if not args.seq:
            return 0
        args.device = device.name
    work = _workload_from_job(args) if args.job else _workload(args)
    if not args.ranks:
        raise UserError("--ranks is required (ring size P)")
    multiple = args.ranks * (2 if work.layout == "zigzag" else 1)
    if work.seq_len % multiple:
        raise UserError(
            f"--seq {work.seq_len} cannot be split over {args.ranks} ranks in the {work.layout} "
            f"layout: it must be a multiple of {multiple}"
        )
    device = get_device(args.device, args.devices)
    link = _link(args, device)
    ranks_on_host = max(1, args.ranks // max(1, args.nodes))
    est = estimate(work, args.ranks, device, link, ranks_on_host=ranks_on_host)
    longest = longest_sequence(work, args.ranks, device, ranks_on_host)
    fewest = fewest_ranks(work, device) if device.cores is None else None
    if args.json:
        report = est.to_json() | {
            "device": device.name, "link": {"name": link.name, "gbit_s": link.gbit_s},
            "workload": {k: v for k, v in vars(work).items() if k != "model"},
            "longest_sequence": longest, "fewest_ranks": fewest,
        }  # fmt: skip
        print(json.dumps(report, indent=2))
    else:
        _print_table(work, est, device, link, longest, fewest)
    return 1 if est.warnings and not est.fits else 0


def calibrate_and_store() -> Device:
    from ..planner.calibrate import calibrate

    device = calibrate()
    path = save_user_device(device)
    print(f"stored device {device.name!r} in {path}")
    return device


def _print_table(work, est, device, link, longest, fewest) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    mask = "causal" if work.causal else "full"
    console.print(
        f"[bold]{work.seq_len:,} tokens[/], {mask} {work.layout}, {work.dtype}, "
        f"{est.ranks} ranks x {est.tokens_per_rank:,} tokens on {device.name}; "
        f"bottleneck hop: {link.name} {link.gbit_s:g} Gbit/s"
    )
    mem = Table(title="memory per rank", show_footer=True)
    mem.add_column("held by", footer="total / usable")
    mem.add_column(
        "GiB", justify="right",
        footer=f"{est.memory_total_gib:.2f} / {est.memory_capacity_gib:.1f}",
    )  # fmt: skip
    for name, value in est.memory_bytes.items():
        mem.add_row(name, f"{value / GIB:.3f}")
    console.print(mem)
    steps = Table(title="one ring step (slowest rank)")
    steps.add_column("phase")
    for col in ("compute ms", "transfer ms", "hidden", "min tokens/rank", "total s"):
        steps.add_column(col, justify="right", no_wrap=True)
    for phase in est.step_compute_s:
        steps.add_row(
            phase,
            f"{1e3 * est.step_compute_s[phase]:.2f}",
            f"{1e3 * est.step_transfer_s[phase]:.2f}",
            "yes" if est.overlapped[phase] else "[red]NO[/]",
            f"{est.min_tokens_per_rank_for_overlap[phase]:,}",
            f"{est.total_s[phase]:.4g}",
        )
    if "forward+backward" in est.total_s:
        steps.add_row("fwd+bwd", "", "", "", "", f"{est.total_s['forward+backward']:.4g}")
    console.print(steps)
    if work.model is not None:
        console.print(
            f"times are the attention of all {work.model.layers} layers; projections and MLP "
            "are not modelled"
        )
    console.print(f"longest sequence that fits on {est.ranks} ranks: {longest:,} tokens")
    if fewest is not None:
        console.print(f"fewest ranks that fit {work.seq_len:,} tokens: {fewest}")
    for warning in est.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
