"""What a ring call costs beyond its block kernels: the per-call overhead, counted and timed.

    python -m benchmarks.overhead                          # P=2, N=1024 4096 8192, both masks
    python -m benchmarks.overhead --seq 256 8192 16384 --engine /path/to/other/checkout

P gloo ranks with one thread each run ``ring_attention`` forward+backward (zigzag) as the
attention benchmark does. Every repetition times the step, then replays the step's own block
kernel calls alone, back to back, in the same ranks at the same time: the *kernel floor*, what
the step would cost if the ring did nothing but its kernels. Reported per call (the slowest
rank for times, the largest for counts):

* step / floor, by the wall clock (``wall x``) and by CPU time (``cpu x``: the whole
  process's CPU time over the replay's, which other jobs on the machine disturb less);
* ``same x``: the floor replayed a second time over the first, the harness against itself:
  what ``wall x`` reads where the step costs exactly its floor, so its spread over the
  repetitions (in the JSON and markdown) is the machine's noise, the resolution of ``wall x``;
* ``bracket x``: the step over the mean of the floor timed just before it (the previous
  step's kernel calls: same inputs, same kernels) and the floor just after it; a machine
  whose speed drifts steadily through a repetition moves ``wall x`` (the floor always
  follows the step) but not this. ``cpu bracket``: the same by CPU time;
* ``fwd k x`` / ``bwd k x``: the forward (backward) kernel calls' wall time in the step over
  the same calls' in the floor replayed after it: which kernels run slower inside the step;
* ``wall x 95%``, ``same x 95%`` and each ``95%`` column: the distribution-free 95% interval
  of the median beside it (``benchmarks.median_interval``; from 6 repetitions on): a goal
  such as wall x <= 1.02 is shown where the interval's upper end is at or below it, however
  noisy one repetition is;
* ``in-step x``: the step over the wall time of its own kernel calls in that same step (the
  busiest rank's of each): host work, waiting and imbalance, against kernels timed in the same
  seconds, so a machine whose speed drifts from one second to the next moves it least. It
  cannot see kernels that run slower because of the ring (copy threads beside them, cold
  memory): ``wall x`` and ``cpu x`` can, to their resolution;
* extra %: the step's CPU time beyond its own kernel calls, in % of theirs: host + comm over
  the kernels' CPU time in the same step, the figure least disturbed by other jobs;
* host ms: CPU time of the calling thread outside kernel calls (checks, plans, merges,
  gradient accumulation, allocation, posting transfers); check ms: the shape agreement's
  collective (wall clock, on the rank that reached it last: without waiting for the others);
* comm ms: CPU time of the process's other threads (gloo's transfers: on CPU ranks they use
  the cores the kernels compute on);
* collectives and point-to-point messages, MiB sent, MiB of fresh tensors, page faults, and
  aten ops (counted, not timed: the same on any machine);
* outside: the CPU other jobs used while the engine's configurations ran (cores,
  ``benchmarks.outside_load``): times taken beside other work say so.

The budget, per forward+backward call of a windowless ring of P gloo CPU ranks:

* one collective (the shape agreement, ten int64s); nothing else synchronises the ranks;
* 8(P-1) + 4d messages per rank (sends and receives), carrying 2(P-1) + d blocks (a block:
  K and V, the dK/dV accumulators in float32), d the dK/dV transfers: 1 at P = 2, P
  otherwise. P = 2: 12 messages, 3 blocks;
* no plan built after a shape's first call (``block_plan`` and ``ring_reach`` are cached);
* CPU beyond the kernels (``extra %``) at most 2% of the kernels' own from N = 8k (P = 2)
  on: the host's share (checks, plans, merges, accumulation) about half of one percent, the
  rest gloo's copies, which grow with N while the kernels grow with N^2.

``--engine`` runs another checkout's ``ringattn`` (e.g. a worktree of an older commit) under
the same harness; the instrumentation wraps only names both keep (``ring.select_kernel``,
``ring.check_ranks_agree``, ``comm.STATS``). Times assume one thread per rank (the kernel runs
on the calling thread). Prints a table; writes JSON and markdown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.median_interval import MedianInterval, median_interval
from benchmarks.outside_load import OutsideLoad
from benchmarks.results_file import write_results

DEFAULT_OUT = Path("benchmarks/results/overhead.json")
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "all_to_all_single")
POINT_TO_POINT = ("isend", "irecv")


@dataclass
class Row:
    engine: str
    ranks: int
    seq: int
    causal: bool
    layout: str
    step_ms: float
    floor_ms: float
    wall_x: float  # step / floor, wall clock
    cpu_x: float  # step / floor, CPU time
    extra_pct: float  # CPU beyond the step's own kernel calls, % of theirs (same step)
    host_ms: float
    comm_ms: float
    check_ms: float
    collectives: int
    p2p: int
    mib_sent: float
    mib_fresh: float
    page_faults: int
    aten_ops: int
    plan_misses: int | None  # plans computed in the measured calls (None: no counter)
    in_step_x: float  # step / the same step's kernel calls, wall clock (busiest rank each)
    same_x: float  # the floor timed again / the floor: the harness against itself
    wall_x_ci: MedianInterval | None  # 95% interval of wall_x (None: under 6 repetitions)
    bracket_x: float  # step / the mean of the floors timed just before and just after it
    bracket_x_ci: MedianInterval | None
    cpu_bracket_x: float  # the same by CPU time
    cpu_bracket_x_ci: MedianInterval | None
    same_x_ci: MedianInterval | None
    wall_x_each: list[float]  # every repetition's ratios: how far to trust the medians
    cpu_x_each: list[float]
    in_step_x_each: list[float]
    same_x_each: list[float]
    bracket_x_each: list[float]
    # the forward (backward) kernel calls' wall in the step over the same calls replayed
    fwd_kernel_x: float | None
    fwd_kernel_x_ci: MedianInterval | None
    bwd_kernel_x: float | None
    bwd_kernel_x_ci: MedianInterval | None
    outside_cores: float | None = None  # other jobs' CPU use during the engine's run


class Probe:
    """Counters the wrapped functions feed while ``active``; kernel calls kept for the replay."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple] = []
        self.reset()

    def reset(self) -> None:
        self.kernel_wall = self.kernel_cpu = self.check_s = 0.0
        self.collectives = self.p2p = 0
        self.calls = []

    def install(self, dist) -> None:
        """Wrap the kernel choice, the shape check and torch.distributed's calls."""
        import ringattn.ring as ring

        choose, check = ring.select_kernel, ring.check_ranks_agree
        ring.select_kernel = lambda q: TimedKernel(choose(q), self)

        def timed_check(*args, **kwargs):
            start = time.perf_counter()
            try:
                return check(*args, **kwargs)
            finally:
                self.check_s += time.perf_counter() - start

        ring.check_ranks_agree = timed_check
        for name in COLLECTIVES + POINT_TO_POINT:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name), name in COLLECTIVES))

    def _counted(self, fn, collective: bool):
        def wrapper(*args, **kwargs):
            if self.active:
                if collective:
                    self.collectives += 1
                else:
                    self.p2p += 1
            return fn(*args, **kwargs)

        return wrapper


class TimedKernel:
    """A block kernel whose calls are timed (wall and this thread's CPU) and kept."""

    def __init__(self, kernel, probe: Probe) -> None:
        self.kernel, self.probe, self.name = kernel, probe, kernel.name

    def _call(self, method: str, args, kwargs):
        fn = getattr(self.kernel, method)
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn(*args, **kwargs)
        if self.probe.active:
            took = time.perf_counter() - wall
            self.probe.kernel_wall += took
            self.probe.kernel_cpu += time.thread_time() - cpu
            self.probe.calls.append((fn, args, kwargs, method, took))
        return result

    def forward(self, *args, **kwargs):
        return self._call("forward", args, kwargs)

    def backward(self, *args, **kwargs):
        return self._call("backward", args, kwargs)


def fresh_tensors_mode():
    """A dispatch mode counting aten ops and the bytes of outputs that are new storage."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class FreshTensors(TorchDispatchMode):
        ops = 0
        fresh_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            held = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            self.ops += 1
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                    self.fresh_bytes += t.untyped_storage().nbytes()
            return out

    return FreshTensors()


# ----------------------------------------------------------------------------- one rank
def _inputs(torch, cfg: dict, rank: int, world: int):
    g = torch.Generator().manual_seed(rank)
    shape = (1, cfg["seq"] // world, cfg["heads"], cfg["head_dim"])
    return [torch.randn(shape, generator=g) for _ in range(4)]  # q, k, v, dout


def _step(ringattn, tensors, cfg: dict) -> None:
    q, k, v, dout = tensors
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = ringattn.ring_attention(qq, kk, vv, causal=cfg["causal"], layout=cfg["layout"])
    out.backward(dout)


def _plan_misses(ringattn) -> int | None:
    """Plans computed so far (None for an engine without the counter: older commits)."""
    try:
        from ringattn.geometry import plans_built
    except ImportError:
        return None
    return plans_built()


def _timed_step(ringattn, tensors, cfg, probe: Probe, stats) -> dict:
    """One measured call: its times and counts, the probe keeping its kernel calls."""
    probe.reset()
    stats.reset(enabled=True)
    faults, misses = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _plan_misses(ringattn)
    probe.active = True
    wall, main, proc = time.perf_counter(), time.thread_time(), time.process_time()
    _step(ringattn, tensors, cfg)
    wall, main = time.perf_counter() - wall, time.thread_time() - main
    proc = time.process_time() - proc
    probe.active = False
    return {
        "step_s": wall,
        "main_cpu_s": main,
        "proc_cpu_s": proc,
        "kernel_cpu_s": probe.kernel_cpu,
        "kernel_wall_s": probe.kernel_wall,
        "check_s": probe.check_s,
        "collectives": probe.collectives,
        "p2p": probe.p2p,
        "bytes_sent": stats.bytes_sent,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "plan_misses": None if misses is None else _plan_misses(ringattn) - misses,
    }


def _replay(calls, by_method: dict | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of the kernel calls alone, back to back; ``by_method`` gets each
    method's (forward, backward) in-step and replayed wall seconds. A call's recorded inputs
    may be views of a landing buffer or shared-memory slot that later hops of the step (or,
    for the floor timed before a step, the previous step's) wrote over: the same shapes and
    finite values, so the kernels' time is the step's, not their data."""
    wall, cpu = time.perf_counter(), time.process_time()
    for fn, args, kwargs, method, in_step in calls:
        start = time.perf_counter()
        fn(*args, **kwargs)
        if by_method is not None:
            step_s, replay_s = by_method.get(method, (0.0, 0.0))
            by_method[method] = (step_s + in_step, replay_s + time.perf_counter() - start)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(torch, dist, ringattn, probe: Probe, cfg: dict, rank: int, world: int) -> dict:
    """Every repetition: a measured call, then its kernel floor; last, one counted call."""
    from ringattn.comm import STATS

    tensors = _inputs(torch, cfg, rank, world)
    for _ in range(2):  # warm-up: allocator, gloo pairs, caches
        _step(ringattn, tensors, cfg)
    _timed_step(ringattn, tensors, cfg, probe, STATS)  # the first floor's calls
    calls, probe.calls = probe.calls, []
    samples = []
    for _ in range(cfg["repeats"]):
        # the floor before the step: the previous step's calls (same inputs, same kernels)
        dist.barrier()
        before, before_cpu = _replay(calls)
        del calls  # not held through the step: it would change what the step allocates
        dist.barrier()
        sample = _timed_step(ringattn, tensors, cfg, probe, STATS)
        calls, probe.calls = probe.calls, []
        dist.barrier()
        sample["by_method"] = {}  # kernel seconds in the step and replayed, per method
        sample["floor_s"], sample["floor_cpu_s"] = _replay(calls, sample["by_method"])
        dist.barrier()
        sample["floor_again_s"], _ = _replay(calls)
        sample["floor_before_s"], sample["floor_before_cpu_s"] = before, before_cpu
        samples.append(sample)
    del calls
    STATS.reset(enabled=False)
    mode = fresh_tensors_mode()
    with mode:
        _step(ringattn, tensors, cfg)
    return {"samples": samples, "aten_ops": mode.ops, "fresh_bytes": mode.fresh_bytes}


def _worker(rank: int, world: int, init: str, engine: str | None, configs, results) -> None:
    if engine:
        sys.path.insert(0, engine)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import ringattn

    probe = Probe()
    probe.install(dist)
    for index, cfg in enumerate(configs):
        try:
            results.put((rank, index, measure(torch, dist, ringattn, probe, cfg, rank, world)))
        except Exception:
            results.put((rank, index, traceback.format_exc()))
            break
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _run_ranks(world: int, engine: str | None, configs: list[dict]) -> list[dict]:
    """Spawn the ranks once for every configuration; per configuration, each rank's result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [
            ctx.Process(target=_worker, args=(r, world, init, engine, configs, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: list[dict] = [{} for _ in configs]
        for _ in range(world * len(configs)):
            rank, index, value = results.get()
            if isinstance(value, str):
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank {rank} failed on {configs[index]}:\n{value}")
            got[index][rank] = value
        for p in procs:
            p.join(timeout=60)
    return got


def _row(label: str, world: int, cfg: dict, per_rank: dict) -> Row:
    """Per repetition the slowest rank (the largest figure over ranks), then the median over
    repetitions; counts from the first repetition (they are the same in every one)."""
    ranks = [per_rank[r] for r in sorted(per_rank)]
    reps = range(len(ranks[0]["samples"]))

    def largest(fn):  # fn(sample) -> number; per repetition, the largest over ranks
        return lambda i: max(fn(r["samples"][i]) for r in ranks)

    def med(by_rep):
        return statistics.median(by_rep(i) for i in reps)

    step, floor = largest(lambda s: s["step_s"]), largest(lambda s: s["floor_s"])
    cpu_x = largest(lambda s: s["proc_cpu_s"] / s["floor_cpu_s"])
    kernels, again = largest(lambda s: s["kernel_wall_s"]), largest(lambda s: s["floor_again_s"])
    before = largest(lambda s: s["floor_before_s"])
    cpu_bracket_x = largest(
        lambda s: 2 * s["proc_cpu_s"] / (s["floor_before_cpu_s"] + s["floor_cpu_s"])
    )
    wall_x = [step(i) / floor(i) for i in reps]
    bracket_x = [2 * step(i) / (before(i) + floor(i)) for i in reps]
    in_step_x = [step(i) / kernels(i) for i in reps]
    same_x = [again(i) / floor(i) for i in reps]
    kernel_x = {  # per method: its kernels' wall in the step over the same calls replayed
        m: [largest(lambda s, m=m: s["by_method"][m][0] / s["by_method"][m][1])(i) for i in reps]
        for m in ranks[0]["samples"][0]["by_method"]
    }
    first = [r["samples"][0] for r in ranks]
    misses = [s["plan_misses"] for s in first]
    return Row(
        label,
        world,
        cfg["seq"],
        cfg["causal"],
        cfg["layout"],
        step_ms=1e3 * med(step),
        floor_ms=1e3 * med(floor),
        wall_x=statistics.median(wall_x),
        cpu_x=med(cpu_x),
        extra_pct=100 * med(largest(lambda s: s["proc_cpu_s"] / s["kernel_cpu_s"] - 1)),
        host_ms=1e3 * med(largest(lambda s: s["main_cpu_s"] - s["kernel_cpu_s"])),
        comm_ms=1e3 * med(largest(lambda s: s["proc_cpu_s"] - s["main_cpu_s"])),
        # the rank that reached the check last waited least: the check's own latency
        check_ms=1e3 * med(lambda i: min(r["samples"][i]["check_s"] for r in ranks)),
        collectives=max(s["collectives"] for s in first),
        p2p=max(s["p2p"] for s in first),
        mib_sent=max(s["bytes_sent"] for s in first) / 2**20,
        mib_fresh=max(r["fresh_bytes"] for r in ranks) / 2**20,
        page_faults=int(med(largest(lambda s: s["page_faults"]))),
        aten_ops=max(r["aten_ops"] for r in ranks),
        plan_misses=None if None in misses else max(misses),
        in_step_x=statistics.median(in_step_x),
        same_x=statistics.median(same_x),
        wall_x_ci=median_interval(wall_x),
        bracket_x=statistics.median(bracket_x),
        bracket_x_ci=median_interval(bracket_x),
        cpu_bracket_x=med(cpu_bracket_x),
        cpu_bracket_x_ci=median_interval([cpu_bracket_x(i) for i in reps]),
        same_x_ci=median_interval(same_x),
        wall_x_each=wall_x,
        cpu_x_each=[cpu_x(i) for i in reps],
        in_step_x_each=in_step_x,
        same_x_each=same_x,
        bracket_x_each=bracket_x,
        fwd_kernel_x=statistics.median(kernel_x["forward"]) if "forward" in kernel_x else None,
        fwd_kernel_x_ci=median_interval(kernel_x.get("forward", [])),
        bwd_kernel_x=statistics.median(kernel_x["backward"]) if "backward" in kernel_x else None,
        bwd_kernel_x_ci=median_interval(kernel_x.get("backward", [])),
    )


COLUMNS = [
    ("engine", "<14", "engine"),
    ("N", ">6", "seq"),
    ("mask", "<6", "causal"),
    ("step ms", ">9", "step_ms"),
    ("floor ms", ">9", "floor_ms"),
    ("wall x", ">7", "wall_x"),
    ("wall x 95%", ">11", "wall_x_ci"),
    ("bracket x", ">9", "bracket_x"),
    ("95%", ">11", "bracket_x_ci"),
    ("cpu bracket", ">11", "cpu_bracket_x"),
    ("95%", ">11", "cpu_bracket_x_ci"),
    ("same x", ">7", "same_x"),
    ("fwd k x", ">7", "fwd_kernel_x"),
    ("95%", ">11", "fwd_kernel_x_ci"),
    ("bwd k x", ">7", "bwd_kernel_x"),
    ("95%", ">11", "bwd_kernel_x_ci"),
    ("same x 95%", ">11", "same_x_ci"),
    ("in-step x", ">9", "in_step_x"),
    ("cpu x", ">6", "cpu_x"),
    ("extra %", ">7", "extra_pct"),
    ("host ms", ">8", "host_ms"),
    ("comm ms", ">8", "comm_ms"),
    ("check ms", ">8", "check_ms"),
    ("coll", ">4", "collectives"),
    ("p2p", ">4", "p2p"),
    ("MiB sent", ">8", "mib_sent"),
    ("MiB new", ">8", "mib_fresh"),
    ("faults", ">7", "page_faults"),
    ("ops", ">5", "aten_ops"),
    ("plan miss", ">9", "plan_misses"),
    ("outside", ">7", "outside_cores"),
]


def _cell(row: Row, attr: str) -> str:
    value = getattr(row, attr)
    if attr == "causal":
        return "causal" if value else "full"
    if value is not None and attr in (
        "wall_x",
        "same_x",
        "in_step_x",
        "cpu_x",
        "bracket_x",
        "cpu_bracket_x",
        "fwd_kernel_x",
        "bwd_kernel_x",
    ):
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return "-" if value is None else str(value)  # an interval prints as low-high


def engine_label(engine: str | None) -> str:
    """The engine checkout's short commit, '+' when its ringattn/ has uncommitted changes."""
    import subprocess

    where = engine or str(Path(__file__).resolve().parents[1])
    try:
        head = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--", "ringattn"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return Path(where).name
    return head + ("+" if dirty else "")


def write_markdown(rows: list[Row], path: Path, argv: list[str]) -> None:
    lines = [
        "# Ring attention: per-call overhead beyond the block kernels",
        "",
        f"`python -m benchmarks.overhead {' '.join(argv)}`",
        "",
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt, _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r, attr) for _, _, attr in COLUMNS) + " |" for r in rows]
    lines += ["", "Every repetition (the medians' spread; `same x` is the machine's noise):", ""]
    for r in rows:
        label = f"{r.engine} {r.seq} {_cell(r, 'causal')}"
        for name, each in (
            ("wall x", r.wall_x_each),
            ("same x", r.same_x_each),
            ("bracket x", r.bracket_x_each),
            ("in-step x", r.in_step_x_each),
        ):
            lines.append(f"- {label}, {name}: " + ", ".join(f"{x:.3f}" for x in each))
    path.write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", default="both", choices=["true", "false", "both"])
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--engine",
        nargs="+",
        default=[None],
        metavar="CHECKOUT",
        help="checkouts whose ringattn to measure, in turn (default: this one)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    masks = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    configs = [
        dict(
            seq=n,
            causal=c,
            layout=args.layout,
            heads=args.heads,
            head_dim=args.head_dim,
            repeats=args.repeats,
        )
        for n, c in itertools.product(args.seq, masks)
    ]
    print(" ".join(f"{name:{fmt}}" for name, fmt, _ in COLUMNS), flush=True)
    rows = []
    for engine in (e and str(Path(e).resolve()) for e in args.engine):
        label = engine_label(engine)
        with OutsideLoad() as load:
            measured = _run_ranks(args.ranks, engine, configs)
        for cfg, per_rank in zip(configs, measured, strict=True):
            rows.append(_row(label, args.ranks, cfg, per_rank))
            rows[-1].outside_cores = load.reading.outside_cores
            print(" ".join(f"{_cell(rows[-1], a):{fmt}}" for _, fmt, a in COLUMNS), flush=True)
    run_argv = sys.argv[1:] if argv is None else argv
    write_results(args.json, "overhead", run_argv, rows)
    write_markdown(rows, args.json.with_suffix(".md"), run_argv)
    print(f"wrote {args.json}, {args.json.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
