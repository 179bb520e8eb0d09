"""`ringctl plan`: memory, whole-model time and overlap of a ring job before the queue wait.

The flags become the planner's plain ``Workload``, ``Device`` and ``Link`` here; a job config
(`ringctl plan JOB`) is read by ``ringctl.sizing``, the same reading `ringctl submit` checks.
The planner itself (ringctl/planner) imports neither the tasks nor the config.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from ringattn.geometry import ring_holds

from ..errors import UserError
from ..jobdir import JobDir
from ..planner.cost import (
    Link,
    ModelShape,
    Workload,
    estimate,
    fewest_ranks,
    intra_link,
    longest_sequence,
    net_link,
    nominal_link,
    split_unit,
    ulysses_problem,
)
from ..planner.devices import (
    Device,
    get_device,
    read_json_file,
    save_user_device,
    share_problem,
)
from ..planner.memory import TRAIN
from ..sizing import Sizing, config_section, job_workload, resolve_model, ring_size
from ..text import cut
from .arg_types import finite, ranks, whole

DEFAULT_DEVICE = "H100-SXM"

EPILOG = """\
examples:
  # Llama-3-8B, 1M tokens, training with full checkpointing and FSDP over 64 H100s (8 nodes)
  ringctl plan --model llama3-8b --seq 1048576 --ranks 64 --nodes 8 --device H100-SXM \\
      --mode train --checkpoint full --shard full --optimizer adam
  # the same model scoring (inference) a 256k-token document on 8 GPUs
  ringctl plan --model llama3-8b --seq 262144 --ranks 8 --mode score
  # attention only (no model): what the ring itself costs
  ringctl plan --seq 1048576 --ranks 64 --nodes 8 --heads 32 --kv-heads 8 --head-dim 128
  # a model directory's config.json for the shape
  ringctl plan --model /models/Llama-3.1-70B --seq 1048576 --ranks 64 --nodes 8 --shard weights
  # size a job config (its task, ranks, nodes, device, ring.size, model.shard)
  ringctl plan attention nodes=8 tasks_per_node=8 device=H100-SXM task.seq_len=1048576
  # a corpus on paper: one ring of the whole job versus ring.size=auto, the job's scheduler
  ringctl plan --model llama3-8b --ranks 64 --nodes 8 --corpus lognormal:10000:4096:1048576
  # measure this machine (block kernel + rank-to-rank exchange) and store it as a device
  ringctl plan --calibrate

Devices: A100-40GB, A100-80GB, H100-SXM, H100-SXM-96GB, H100-PCIe, H200, B200, L40S (datasheet
figures with their sources, ringctl/planner/data/devices.json), plus --calibrate and --devices.
Models (--model): llama3-8b, llama3-70b, llama3-405b, llama2-7b, llama2-13b, llama-3b,
llama-30b (ringctl/planner/data/models.json), or a Hugging Face model directory.

Exit status 1 when the sequence does not fit the ranks' memory ("does not fit" among the
warnings), 2 for a usage error or a job's document that no ring of the job holds (submit
refuses it too), else 0 (a schedule, corpus or calibration report: 0).
"""


# The workload and model flags a job config's own keys decide (the job's --ranks, --nodes,
# --device and --ulysses are taken from the flags where given): given beside a JOB, they were
# dropped and the job's plan printed, exit 0 ("--model llama3-8b" priced the tiny model).
JOB_SAYS = (
    "batch heads kv_heads head_dim dtype mode task checkpoint shard shard_degree optimizer "
    "lm_head_chunk mlp_chunk no_causal layout model layers hidden intermediate vocab "
    "attention_only"
).split()


def _flag(dest: str) -> str:
    """The command-line spelling of a JOB_SAYS flag (``kv_heads``: ``--kv-heads``)."""
    return "--" + dest.replace("_", "-")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="Estimate memory, step time and overlap before submitting.",
        description=(
            "Estimate per-rank memory (broken down, with the dtype of each kind of tensor), the "
            "ring's per-step compute and transfer over its slowest hop, whether the transfer "
            "hides behind compute, the whole model's time (tokens/s and MFU per GPU), flat ring "
            "versus hybrid Ulysses x ring, the longest sequence that fits and the fewest ranks "
            "that fit the sequence."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job", nargs="?", metavar="JOB", help="a job config to size (optional)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of JOB")
    _workload_flags(p)
    _model_flags(p)
    _link_flags(p)
    p.add_argument(
        "--corpus",
        metavar="lognormal:COUNT:LOW:HIGH[:SEED]",
        help="predicted makespan of a generated corpus (COUNT documents of LOW to HIGH "
        "tokens): one ring vs ring.size=auto",
    )
    p.add_argument(
        "--schedule",
        type=Path,
        metavar="schedule.json",
        help="a job's schedule: print its predicted makespan",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine and store it as device cpu-HOST (minutes; a quiet machine)",
    )
    # Absent flags read None, so that one given at its default is told apart; run() puts
    # the defaults back.
    p.set_defaults(func=run, flag_defaults={d: p.get_default(d) for d in JOB_SAYS})
    p.set_defaults(**dict.fromkeys(JOB_SAYS))


def _workload_flags(p) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--seq", type=whole(), help="total sequence length N (tokens)")
    w.add_argument(
        "--batch", type=whole(1, 1 << 20), default=1, help="sequences at once (default: 1)"
    )
    w.add_argument(
        "--heads", type=whole(1, 1 << 16), default=None, help="default: the model's, else 32"
    )
    w.add_argument(
        "--kv-heads",
        type=whole(1, 1 << 16),
        default=None,
        help="default: the model's, else --heads",
    )
    w.add_argument(
        "--head-dim", type=whole(1, 1 << 16), default=None, help="default: the model's, else 128"
    )
    w.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16",
    )
    w.add_argument(
        "--mode",
        choices=["score", "embed", "train"],
        help="inference (score, embed: one layer's activations) or train (autograd; the default)",
    )
    w.add_argument(
        "--task",
        default=None,
        choices=["forward", "forward+backward"],
        help="older spelling of --mode: forward = score, forward+backward = train",
    )
    w.add_argument(
        "--checkpoint",
        default="none",
        choices=["none", "full", "selective"],
        help="activation checkpointing (default: none)",
    )
    w.add_argument(
        "--shard",
        default="none",
        choices=["none", "weights", "full"],
        help="FSDP: weights only, or weights + gradients + optimizer state",
    )
    w.add_argument("--shard-degree", type=ranks, help="ranks the shards span (default: --ranks)")
    w.add_argument("--optimizer", choices=["adam"], help="float32 Adam moments + master weights")
    w.add_argument(
        "--lm-head-chunk",
        type=whole(0),
        default=4096,
        help="tokens per lm_head + log-softmax chunk (0: all tokens at once)",
    )
    w.add_argument(
        "--mlp-chunk",
        type=whole(0),
        default=0,
        help="tokens per MLP chunk, blockwise feedforward (0: all at once)",
    )
    w.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    w.add_argument(
        "--layout", default="zigzag", choices=["zigzag", "contiguous"], help="default: zigzag"
    )
    w.add_argument(
        "--ulysses",
        type=ranks,
        default=1,
        help="hybrid: heads split over U ranks of a node, ring across (1: flat)",
    )


def _model_flags(p) -> None:
    m = p.add_argument_group("model (optional: attention only without it)")
    m.add_argument("--model", help="a preset (see below) or a Hugging Face model directory")
    m.add_argument("--layers", type=whole(1, 1 << 16), help="decoder layers")
    m.add_argument("--hidden", type=whole(1, 1 << 24), help="hidden size (model width)")
    m.add_argument("--intermediate", type=whole(1, 1 << 26), help="MLP width (default: 4x hidden)")
    m.add_argument(
        "--vocab", type=whole(1, 1 << 26), default=None, help="default: the model's, else 32000"
    )
    m.add_argument(
        "--attention-only",
        action="store_true",
        help="ignore the model: the ring attention's memory and time alone",
    )


def _link_flags(p) -> None:
    r = p.add_argument_group("ranks, device and links")
    r.add_argument("--ranks", type=ranks, help="ring size P")
    r.add_argument(
        "--nodes",
        type=ranks,
        default=1,
        help="nodes the ranks span (default: 1: every rank on one node's links)",
    )
    r.add_argument(
        "--device",
        default=None,
        help=f"device table entry (default: the job's `device`, else {DEFAULT_DEVICE})",
    )
    r.add_argument("--devices", type=Path, help="extra device table (JSON) overriding entries")
    r.add_argument("--topology", type=Path, help="a `ringctl topo` plan: use its bottleneck hop")
    r.add_argument(
        "--link-gbit", type=finite(), help="bottleneck hop bandwidth in Gbit/s (overrides nominal)"
    )
    r.add_argument(
        "--link-latency-us",
        type=finite(0.0, above=False),
        help="per-message latency of every link, microseconds (default: the device's)",
    )
    r.add_argument(
        "--attention-efficiency",
        metavar="FWD,BWD",
        help="share of peak of the attention kernel, each in [0.001, 1] (default: the device's)",
    )
    r.add_argument(
        "--matmul-efficiency", type=finite(), help="share of peak of the matmuls, in [0.001, 1]"
    )


def _latency(args) -> float | None:
    return None if args.link_latency_us is None else args.link_latency_us * 1e-6


def _link(args, device: Device) -> Link:
    latency = _latency(args)
    if args.link_gbit:
        return Link("given", args.link_gbit, 10e-6 if latency is None else latency)
    if args.topology:
        link = _topology_link(args.topology)
        return link if latency is None else replace(link, latency_s=latency)
    return nominal_link(device, args.nodes, latency)


def _topology_link(path: Path) -> Link:
    """The bottleneck hop of a `ringctl topo` plan (``devices.read_json_file``: bounded, one
    line naming the file), its bandwidth a finite positive number: 0 divided every transfer
    by zero, NaN or Infinity made every transfer free."""
    plan = read_json_file(path, "topology plan")
    try:
        hop = plan["bottleneck"]
        name, gbps = str(hop["link"]), hop["gbps"]
    except (KeyError, TypeError, IndexError) as err:
        raise UserError(f"{path}: not a ringctl topo plan (missing {err})") from None
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < math.inf:
        raise UserError(
            f"{path}: bottleneck.gbps must be a finite positive number of Gbit/s, "
            f"got {cut(repr(gbps), 40)}"
        )
    return Link(name, float(gbps))


def _model(args) -> ModelShape | None:
    if args.attention_only:
        return None
    if args.model is not None:  # --model "" is refused by name, not ignored
        base = resolve_model(args.model)
    elif args.layers or args.hidden:
        if not (args.layers and args.hidden):
            raise UserError("a model needs both --layers and --hidden")
        base = ModelShape(args.layers, args.hidden, args.intermediate, args.vocab or 32000)
    else:
        return None
    given = {
        "layers": args.layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "vocab": args.vocab,
    }
    return replace(base, **{k: v for k, v in given.items() if v})


def _mode(args) -> str:
    if args.mode:
        return args.mode
    return "score" if args.task == "forward" else "train"


def _workload(args, seq_required: bool = True) -> Workload:
    if not args.seq and seq_required:
        raise UserError("--seq is required (total sequence length in tokens)")
    model = _model(args)
    heads = args.heads or (model.heads if model and model.heads else 32)
    # The model's K/V heads stay its own when --heads is given: GQA is the model's shape.
    kv = args.kv_heads or (model.kv_heads if model and model.kv_heads else heads)
    head_dim = args.head_dim or (model.head_dim if model and model.head_dim else 128)
    if heads % kv:
        whose = "--kv-heads" if args.kv_heads else "the K/V heads"
        raise UserError(f"--heads ({heads}) must be a multiple of {whose} ({kv})")
    return Workload(
        seq_len=args.seq or 0,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        batch=args.batch,
        dtype=args.dtype,
        causal=not args.no_causal,
        layout=args.layout,
        model=model,
        backward=_mode(args) == TRAIN,
        mode=_mode(args),
        checkpoint=args.checkpoint,
        shard=args.shard,
        shard_degree=args.shard_degree,
        optimizer=args.optimizer,
        lm_head_chunk=args.lm_head_chunk,
        mlp_chunk=args.mlp_chunk,
        ulysses=args.ulysses,
    )


def _device(args) -> Device:
    device = get_device(args.device or DEFAULT_DEVICE, args.devices)
    changes = {}
    if args.attention_efficiency:
        try:
            fwd, bwd = (float(x) for x in args.attention_efficiency.split(","))
        except ValueError:
            raise UserError("--attention-efficiency: expected FWD,BWD (e.g. 0.33,0.29)") from None
        changes["attention_efficiency"] = (fwd, bwd)
    if args.matmul_efficiency is not None:
        changes["matmul_efficiency"] = args.matmul_efficiency
    shares = [*changes.get("attention_efficiency", ())]
    shares += [changes["matmul_efficiency"]] if "matmul_efficiency" in changes else []
    why = share_problem(shares)
    if why:
        raise UserError(f"--attention-efficiency / --matmul-efficiency: {why}")
    return replace(device, **changes) if changes else device


def _check_split(work: Workload, ranks: int, job: str | None = None) -> None:
    """The workload splits over the ranks (its Ulysses grid's rule where it has one); named
    as the job's key where a job gave it."""
    why = ulysses_problem(work.ulysses, ranks, work.heads, work.kv_heads)
    if why:
        raise UserError(f"--ulysses {work.ulysses} {why}")
    multiple = split_unit(work, ranks)
    if work.seq_len % multiple:
        said = f"{job}: task.seq_len" if job else "--seq"
        grid = f" with Ulysses groups of {work.ulysses}" if work.ulysses > 1 else ""
        raise UserError(
            f"{said} {work.seq_len} cannot be split over {ranks} ranks{grid} in the "
            f"{work.layout} layout: it must be a multiple of {multiple}"
        )
    if work.shard_degree is not None and work.shard_degree < 1:
        raise UserError(f"--shard-degree must be at least 1, got {work.shard_degree}")
    for flag, value, least in (
        ("--batch", work.batch, 1),
        ("--lm-head-chunk", work.lm_head_chunk, 0),
        ("--mlp-chunk", work.mlp_chunk, 0),
    ):
        if value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")


def run(args) -> int:
    args.flags_given = [d for d in JOB_SAYS if getattr(args, d) is not None]
    for dest in JOB_SAYS:
        if getattr(args, dest) is None:
            setattr(args, dest, args.flag_defaults[dest])
    if args.calibrate:
        device = calibrate_and_store()
        if not args.seq:
            return 0
        args.device = device.name
    job_dir = None
    if args.job and JobDir(args.job).schedule.is_file():  # a job directory
        job_dir, args.schedule = JobDir(args.job), JobDir(args.job).schedule
    if job_dir is not None and args.flags_given:  # its schedule is priced as the job runs
        flag = _flag(args.flags_given[0])
        raise UserError(f"{flag}: a job directory's schedule is priced as its job runs it")
    if args.schedule:
        return _print_makespan(args, job_dir)
    job = _from_job(args) if args.job else None
    if args.corpus:
        return _print_corpus(args, _workload(args, seq_required=False), _device(args))
    if job is not None and not job.seq_len:
        return _print_budget(args, job, _device(args))
    work = job or _workload(args)
    if not args.ranks:
        raise UserError("--ranks is required (ring size P)")
    if args.nodes > args.ranks:
        raise UserError(f"--nodes {args.nodes} is more than --ranks {args.ranks}")
    # a job's own length named as its key; --seq given for a job without one, as the flag
    _check_split(work, args.ranks, args.job if job is not None and not args.seq else None)
    device = _device(args)
    link = _link(args, device)
    ranks_on_host = _ranks_on_host(args)
    latency = _latency(args)
    est = estimate(
        work,
        args.ranks,
        device,
        link,
        ranks_on_host=ranks_on_host,
        intra=intra_link(device, latency),
        net=net_link(device, latency),
    )
    longest = longest_sequence(work, args.ranks, device, ranks_on_host)
    fewest = (
        fewest_ranks(work, device, ranks_on_host=ranks_on_host) if device.cores is None else None
    )
    if not est.fits and fewest is not None:
        est.warnings.append(_fit_hint(args, fewest))
    layouts = _layouts(args, work, device, link) if not args.json or args.ranks > 1 else []
    if args.json:
        print(_json(_report(work, est, device, link, longest, fewest, layouts)))
    else:
        from ..planner.report import print_plan

        print_plan(work, est, device, link, longest, fewest, layouts)
    return 1 if est.warnings and not est.fits else 0


def _fit_hint(args, fewest: int) -> str:
    """What to change so that a plan that does not fit would: the key (or flag) that sets the
    ranks sharing the sequence, with the fewest that hold it (the warning named no key)."""
    cfg = getattr(args, "job_cfg", None)
    if cfg is None:
        return f"to fit on {args.device or DEFAULT_DEVICE}: --ranks {fewest} or more"
    if ring_size(cfg) is not None:
        return (
            f"to fit: ring.size={fewest} or more (ranks a sequence is split over; the job's "
            f"nodes x tasks_per_node, {args.world} now, a multiple of it)"
        )
    return f"to fit: {fewest} ranks or more (nodes x tasks_per_node; this job has {args.world})"


def _json(report: dict) -> str:
    """The report as JSON, which has no NaN or Infinity: a number that is not finite (inputs
    too extreme for the model) is refused in one line rather than written as invalid JSON."""
    try:
        return json.dumps(report, indent=2, allow_nan=False)
    except ValueError:
        raise UserError(
            "the plan has a number that is not finite (an input too extreme: a rate, an "
            "efficiency or a size); no JSON written"
        ) from None


def _runs_hybrid(cfg) -> bool:
    """Whether the job (None: no job, only --ranks) may run hybrid Ulysses x ring grids: its
    task's ``hybrid_grids``, the one question the layout table and --ulysses ask."""
    from ..tasks import get_task

    return cfg is None or get_task(str(cfg.task.name)).hybrid_grids


def _layouts(args, work: Workload, device: Device, link: Link):
    """Flat ring vs the hybrid the node allows (none when no Ulysses degree fits, or for a
    job whose task runs plain rings: the plan recommended a hybrid that training refuses)."""
    from ..planner.hybrid import compare_layouts, ulysses_degrees

    if not _runs_hybrid(getattr(args, "job_cfg", None)):
        return []
    if args.ranks < 2 or device.cores is not None:
        return []
    per_node = max(1, args.ranks // max(1, args.nodes))
    allowed = ulysses_degrees(work, args.ranks, per_node)
    if not allowed:
        return []
    # the degree the job (or --ulysses) fixes, against the flat ring: the table compared the
    # largest the node allows, a grid the job would not run
    fixed = [work.ulysses] if work.ulysses > 1 else None
    if fixed and work.ulysses not in allowed:
        return []  # its groups cross nodes: the estimate says so (no layout to compare)
    return compare_layouts(
        work,
        args.ranks,
        device,
        nodes=args.nodes,
        flat_link=link,
        latency_s=_latency(args),
        degrees=fixed,
    )


def _report(work, est, device, link, longest, fewest, layouts) -> dict:
    from ..planner.hybrid import recommend

    report = est.to_json() | {
        "device": device.name,
        "link": {"name": link.name, "gbit_s": link.gbit_s, "latency_s": link.latency_s},
        "workload": {k: v for k, v in vars(work).items() if k != "model"},
        "model": vars(work.model) if work.model else None,
        "longest_sequence": longest,
        "fewest_ranks": fewest,
    }
    if layouts:
        report["layouts"] = [
            {
                "name": o.name,
                "ulysses": o.ulysses,
                "ring": o.ring,
                "seconds": o.seconds,
                "fits": o.estimate.fits,
                "overlapped": o.estimate.overlapped,
            }
            for o in layouts
        ]
        best = recommend(layouts)
        report["recommended_layout"] = best.name if best else None
    return report


def _ranks_on_host(args) -> int:
    """The ranks sharing one host's memory and cores: a job's ranks on a node whatever its
    ring size (``Sizing.ranks_on_host``), else the flags' ranks over their nodes."""
    cfg = getattr(args, "job_cfg", None)
    if cfg is not None:
        return Sizing(cfg).ranks_on_host
    return max(1, args.ranks // max(1, args.nodes))


# --- job configs -------------------------------------------------------------------------


def _from_job(args) -> Workload:
    """The workload of a job config; its ranks, nodes and device fill the flags not given."""
    from ..config import load_job, world_size

    given = [] if args.corpus else args.flags_given  # a corpus is sized by the flags
    if given:
        flag = _flag(given[0])
        raise UserError(
            f"{flag}: with a job config ({args.job}) the job's own keys decide the workload; "
            "give them as KEY=VALUE after it (e.g. task.seq_len=65536), or leave the job out"
        )
    cfg = load_job(args.job, args.overrides)
    if args.ulysses != 1:  # the flag over the job's ring.ulysses, checked by the job's rules
        if not _runs_hybrid(cfg):
            raise UserError(
                f"--ulysses {args.ulysses}: the {cfg.task.name} task runs plain rings "
                "(ring.ulysses is the attention task's)"
            )
        given = f"ring.ulysses={args.ulysses}"
        try:
            cfg = load_job(args.job, [*args.overrides, given])
        except UserError as err:  # said as what was typed
            said = str(err).replace(f"override '{given}'", f"--ulysses {args.ulysses}")
            raise UserError(said) from None
    ring = ring_size(cfg)
    work = job_workload(cfg, ring)
    if work is None:
        raise UserError(
            f"{args.job}: the {cfg.task.name} task does not describe its work up front; "
            "use the flags (--seq, --model, ...)"
        )
    world = world_size(cfg)
    args.world = world
    args.ranks = args.ranks or ring or world
    if args.nodes == 1:
        args.nodes = max(1, -(-args.ranks // int(cfg.tasks_per_node)))
    if args.device is None and cfg.get("device"):
        args.device = str(cfg.device)
    elif args.device is None and int(cfg.gpus_per_node) == 0:
        host = socket.gethostname().split(".")[0]
        print(  # a CPU job priced on a GPU in silence read as its own plan
            f"note: {args.job} runs on CPUs (gpus_per_node: 0) and sets no device: priced on "
            f"{DEFAULT_DEVICE}; --device NAME, e.g. --device cpu-{host} once `ringctl plan "
            "--calibrate` has measured this machine",
            file=sys.stderr,
        )
    if args.seq and work.seq_len:
        raise UserError(f"--seq: {args.job} sets the sequence length (task.seq_len=N after it)")
    if args.seq and not work.seq_len:
        work = replace(work, seq_len=args.seq)
    args.job_cfg = cfg
    return work


def _print_budget(args, work: Workload, device: Device) -> int:
    """A job whose sequence lengths vary: the per-rank budget, and the predicted makespan of
    the schedule the job will run (its ring.size and budget), beside one ring of the job."""
    from ..planner.pricing import max_tokens_per_rank
    from ..planner.report import print_schedule
    from ..tasks import get_task

    cfg, ring = args.job_cfg, args.ranks
    budget = max_tokens_per_rank(work, device, ring, _ranks_on_host(args))
    rings = _job_rings(args, work, device)
    listed = get_task(str(cfg.task.name)).document_lengths(cfg, fits=_job_fits(args, *rings))
    spans = _job_makespans(args, work, device, listed, rings) if listed else {}
    own = config_section(cfg, "ring").get("max_tokens_per_rank")
    own = None if own is None else int(own)
    over = own is not None and own > budget
    if args.json:
        report = {
            "device": device.name,
            "ring_size": ring,
            "max_tokens_per_rank": budget,
            "job_max_tokens_per_rank": own,
            "documents": len(listed),
            "makespan_s": spans,
        }
        print(json.dumps(report, indent=2))
    else:
        lengths = [n for _, n in listed]
        print_schedule(work, device, ring, (budget, own), lengths, spans)
    return 1 if over else 0


def _job_makespans(args, work: Workload, device: Device, listed, rings) -> dict[str, float]:
    """{schedule: seconds}: the job's own (``ringctl.makespan.price_job``; ``rings``: its
    ``_job_rings``), and one ring of the whole job when that is not what the job runs."""
    from ..makespan import price_job

    cfg, world = args.job_cfg, args.world
    size, budget = rings
    job = partial(
        price_job,
        listed,
        world=world,
        work=work,
        device=device,
        nodes=int(cfg.nodes),
        ranks_on_host=_ranks_on_host(args),
    )
    label = f"the job's (ring.size={'null' if size is None else size})"
    spans = {label: job(size=size, budget=budget).makespan}
    if size is not None and str(size) != str(world):
        spans[f"one ring of {world}"] = job(size=None, budget=None).makespan
    return spans


def _job_rings(args, work: Workload, device: Device) -> tuple:
    """(ring.size, tokens per rank) the job runs with: its own, or for ring.size=auto the
    planner's budget on ``device`` (what submit writes in)."""
    from ..makespan import auto_budget

    ring = config_section(args.job_cfg, "ring")
    size, budget = ring.get("size"), ring.get("max_tokens_per_rank")
    if str(size) == "auto" and budget is None:
        budget = auto_budget(work, device, args.world, _ranks_on_host(args))
        if budget < 1:
            raise UserError(
                f"{args.job}: ring.size=auto: the model alone does not fit one {device.name}"
            )
    return size, budget


def _job_fits(args, size, budget):
    """``fits(tokens)``: whether the job's largest ring (``size``, its ring.size) holds a
    document that long under ``budget`` (None: one ring of the whole job, no budget); what
    the schedule's refusal asks."""
    from ..config import job_layout
    from ..rings import ring_sizes

    if budget is None:
        return None
    largest = max(ring_sizes(args.world, size if size is not None else args.world))
    layout = job_layout(args.job_cfg)
    return lambda n: ring_holds(n, largest, int(budget), layout)


def _print_makespan(args, job_dir: JobDir | None) -> int:
    """A job's schedule.json (``scheduler.read_schedule``, its owner): its makespan in seconds
    where the job priced it with a device, or as the planner prices it for the job's device
    (its config's, or --device); else in the scheduler's relative units, said so."""
    from ..scheduler import read_schedule

    try:
        schedule = read_schedule(args.schedule)
    except ValueError as err:
        raise UserError(str(err)) from None
    unit = "s"
    if schedule.cost_unit != "seconds":
        repriced = _priced_for_device(args, job_dir, schedule)
        schedule, unit = (repriced, "s") if repriced is not None else (schedule, "relative units")
    count, seconds = len(schedule.entries), schedule.makespan
    if args.json:
        key = "makespan_s" if unit == "s" else "makespan_relative"
        print(json.dumps({"documents": count, key: seconds}))
    else:
        print(f"{args.schedule}: {count:,} documents, predicted makespan {seconds:.4g} {unit}")
    return 0


def _priced_for_device(args, job_dir: JobDir | None, schedule):
    """The schedule priced in seconds for the job's device (its config's ``device``, or
    --device given), or None when neither names one or the job's work is not known."""
    from ..config import load_job
    from ..planner.pricing import document_cost
    from ..scheduler import priced

    explicit = args.device is not None
    if job_dir is None or not job_dir.config.is_file():
        return None
    cfg = load_job(job_dir.config, [])
    name = args.device if explicit else cfg.get("device")
    work = job_workload(cfg, ring_size(cfg))
    if not name or work is None:
        return None
    device = get_device(str(name), args.devices)
    per_host = Sizing(cfg).ranks_on_host
    cost = partial(
        document_cost, w=work, device=device, nodes=int(cfg.nodes), ranks_on_host=per_host
    )
    return priced(schedule, cost)


MAX_CORPUS = 100_000  # documents a paper corpus prices (each one scheduled and priced)


def _print_corpus(args, work: Workload, device: Device) -> int:
    """``--corpus lognormal:COUNT:LOW:HIGH[:SEED]`` on ``--ranks`` (the job's W)."""
    from ..makespan import corpus_comparison
    from ..planner.report import print_corpus

    try:
        kind, *numbers = args.corpus.split(":")
        count, low, high, *rest = (int(x) for x in numbers)
    except ValueError:
        raise UserError(
            f"--corpus {args.corpus!r}: expected lognormal:COUNT:LOW:HIGH[:SEED]"
        ) from None
    if len(rest) > 1:
        raise UserError(
            f"--corpus {args.corpus!r}: expected lognormal:COUNT:LOW:HIGH[:SEED], "
            f"got {len(numbers)} numbers"
        )
    if count > MAX_CORPUS:
        raise UserError(f"--corpus {args.corpus!r}: at most {MAX_CORPUS:,} documents")
    if kind != "lognormal" or not 0 < low <= high or count < 1:
        raise UserError(f"--corpus {args.corpus!r}: expected lognormal:COUNT:LOW:HIGH[:SEED]")
    if not args.ranks:
        raise UserError("--ranks is required (the job's ranks W)")
    if work.model is None:
        raise UserError("--corpus needs a model (--model or --layers/--hidden)")
    try:
        result = corpus_comparison(
            work,
            device,
            args.ranks,
            nodes=args.nodes,
            count=count,
            low=low,
            high=high,
            seed=rest[0] if rest else 0,
            ranks_on_host=_ranks_on_host(args),
        )
    except ValueError as err:
        raise UserError(f"--corpus: {err}") from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_corpus(result)
    return 0


def calibrate_and_store() -> Device:
    from ..planner.calibrate import calibrate

    device = calibrate()
    path = save_user_device(device)
    print(f"stored device {device.name!r} in {path}")
    return device
