"""The attention task: ring attention forward and backward on deterministic random inputs.

Every rank draws its shard of q, k, v (and the output gradient) from `task.seed`: the rows
`ringattn.sequence_positions` gives it in the job's layout, each chunk of the sequence from a
seed of its own (`make_inputs`), and runs `ring_attention` forward and
backward `task.steps` times. Each rank writes, atomically, `out/rank-<R>.safetensors` (its
shards of out, dq, dk, dv and the global positions they hold) and `out/rank-<R>.json` (timings).
`reference(cfg)` computes the same quantities over the whole sequence in float64 in one process,
and `load_results(out_dir)` reassembles the ranks' shards: with `save_outputs`, rank 0 compares
the two once every rank wrote its shards, and a wrong result fails the job (attention_check.py).

Fault injection (for tests of failure handling): `fault_rank` set to a rank makes that rank, at
step `fault_step` between forward and backward (mid-ring), `raise` an error, `hang` (sleep
forever), or `exit` (die without a word).

`AttentionTask` is the task (`ringctl.tasks.base.Task`): check, workload and run are its
methods; the functions here are their parts, and the reference tests compare against.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import job_layout
from ..errors import StoppedOnRequest
from ..jobdir import JobDir
from ..task_params import MAX_COUNT, MAX_SEED, MAX_SIZE, TaskParams, int_problem
from . import atomic_write_json, load_tensors, save_tensors
from .base import Task

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float64", "bfloat16", "float16")
FAULTS = ("raise", "raise-once", "hang", "exit")  # raise-once: first attempt only (resume)
# The ring keys of the long-document and training tasks' rings, which this task never reads.
IGNORED_RING_KEYS = ("size", "max_tokens_per_rank")


@dataclass
class Params(TaskParams):
    name: str = "attention"
    seq_len: int = 4096
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None  # default: heads (no GQA)
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    layout: str | None = None  # default: ring.layout
    softmax_scale: float | None = None  # default: 1/sqrt(head_dim)
    seed: int = 0
    steps: int = 1
    save_outputs: bool = True  # write the shards of out, dq, dk, dv
    fault_rank: int | None = None
    fault: str = "raise"
    fault_step: int = 0


# (key, least, most) of the integer parameters (task_params: the one rule of their bounds)
PARAM_BOUNDS = (
    *((key, 1, MAX_SIZE) for key in ("seq_len", "batch", "heads", "head_dim")),
    ("steps", 1, MAX_COUNT),
    ("seed", 0, MAX_SEED),
)


def check_input_size(t, bad) -> None:
    """q of ``make_inputs`` (float64, on every rank) within a 64-bit byte count: each size
    below 2**31 does not keep four of them from overflowing torch's sizes."""
    elements = t.batch * t.seq_len * t.heads * t.head_dim
    if elements * 8 >= 1 << 63:
        raise bad(
            "task.seq_len",
            f"batch x seq_len x heads x head_dim is {elements:,} elements: the inputs in "
            "float64 would be more bytes than a 64-bit size holds",
        )


def check_softmax_scale(scale, bad) -> None:
    """The engine's own rule (``ringattn.checks.check_scale``), at load: every rank refused a
    NaN, infinite, zero or negative scale after the queue. Its module imports torch, asked
    only for a scale given."""
    if scale is None:
        return
    from ringattn.checks import check_scale

    try:
        check_scale(scale)
    except ValueError as err:
        raise bad("task.softmax_scale", str(err)) from None


def _dtype(name: str):
    import torch

    return getattr(torch, name)


INPUT_CHUNK = 1024  # tokens of the inputs drawn from one seed (``make_inputs``)
INPUT_NAMES = ("q", "k", "v", "dout")


def make_inputs(cfg, positions=None) -> dict[str, torch.Tensor]:
    """q, k, v and the output gradient (CPU, float64) at the sequence's ``positions`` (all,
    in order, by default: the reference's), the same values whichever rank asks. Each
    INPUT_CHUNK tokens of each tensor are drawn from a seed of their own, so that a rank
    draws its share only: every rank drew the whole sequence in float64 (jobs/attention.yaml,
    262,144 tokens: 20 GiB and about 90 s a rank before its first step, 160 GiB a node)."""
    import torch

    t = cfg.task
    if positions is None:
        positions = torch.arange(int(t.seq_len))
    heads = {"q": t.heads, "dout": t.heads}
    kv = t.kv_heads if t.kv_heads is not None else t.heads
    chunks = torch.unique(positions // INPUT_CHUNK).tolist()
    where = {c: i for i, c in enumerate(chunks)}  # a chunk's place among those drawn
    rows = torch.tensor([where[c] for c in (positions // INPUT_CHUNK).tolist()], dtype=torch.long)
    rows = rows * INPUT_CHUNK + positions % INPUT_CHUNK
    inputs = {}
    for name in INPUT_NAMES:
        drawn = [_chunk(t, name, c, heads.get(name, kv)) for c in chunks]
        inputs[name] = torch.cat(drawn, dim=1).index_select(1, rows)
    return inputs


def _chunk(t, name: str, index: int, heads: int) -> torch.Tensor:
    """Tokens index*INPUT_CHUNK.. of input ``name`` (the last chunk padded to a whole one:
    a chunk's values do not depend on the sequence's length beyond it)."""
    import torch

    text = f"{int(t.seed)}:{name}:{index}".encode()
    seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    shape = (t.batch, INPUT_CHUNK, heads, t.head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def reference(cfg) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of plain attention over the whole sequence, in float64, one process.

    Inputs are rounded to the task's dtype first, as the ranks see them."""
    import torch

    t = cfg.task
    inputs = make_inputs(cfg)
    q, k, v = (inputs[n].to(_dtype(t.dtype)).to(torch.float64).requires_grad_() for n in "qkv")
    dout = inputs["dout"].to(_dtype(t.dtype)).to(torch.float64)
    groups = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scale = t.softmax_scale if t.softmax_scale is not None else 1.0 / math.sqrt(t.head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if t.causal:
        n = q.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def load_results(out_dir: str | Path, world: int | None = None) -> dict[str, torch.Tensor]:
    """Reassemble every rank's shards (out/rank-*.safetensors) into full tensors; with
    ``world``, those of ranks 0..world-1 only, each written by a job of that many ranks (out/
    is kept across attempts: a resume on fewer ranks leaves the earlier run's higher ones)."""
    from ringattn import unshard_sequence

    if world is None:
        files = sorted(Path(out_dir).glob("rank-*.safetensors"))
    else:
        files = [Path(out_dir) / f"rank-{r}.safetensors" for r in range(world)]
        files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no rank-*.safetensors in {out_dir}")
    shards = [load_tensors(f) for f in files]
    world = int(shards[0][1]["world_size"]) if world is None else world
    stale = [meta["rank"] for _, meta in shards if int(meta["world_size"]) != world]
    if stale:
        raise ValueError(f"{out_dir}: shards of ranks {stale} are of a job of another size")
    ranks = sorted(int(meta["rank"]) for _, meta in shards)
    if ranks != list(range(world)):
        raise ValueError(f"{out_dir}: shards of ranks {ranks}, expected 0..{world - 1}")
    shards.sort(key=lambda s: int(s[1]["rank"]))
    layout = shards[0][1]["layout"]
    degree = int(shards[0][1].get("ulysses_degree", 1))
    extra = {"ulysses_degree": degree} if degree > 1 else {}
    return {
        name: unshard_sequence([s[0][name] for s in shards], layout=layout, **extra)
        for name in ("out", "dq", "dk", "dv")
    }


def _attention_for(cfg, ctx, layout: str, kv_heads: int):
    """(attend(q, k, v), the layout shards use, the Ulysses degree): the ring over the job,
    or with a Ulysses degree U > 1 (ring.ulysses, or the placement's groups) the hybrid
    attention over groups of U consecutive ranks, built here on every rank."""
    from functools import partial

    from ringattn import hybrid_attention, hybrid_groups, ring_attention
    from ringattn.geometry import grid_layout

    from ..rings import ulysses_degree

    t = cfg.task
    degree = ulysses_degree(
        cfg.ring.ulysses,
        placement=ctx.placement,
        ranks_per_node=int(cfg.tasks_per_node),
        world=ctx.world_size,
        heads=int(t.heads),
        kv_heads=kv_heads,
    )
    common = {"causal": t.causal, "softmax_scale": t.softmax_scale}
    if degree <= 1:
        return partial(ring_attention, group=ctx.group, layout=layout, **common), layout, 1
    groups = hybrid_groups(degree, timeout=ctx.timeout)
    hybrid = grid_layout(layout, degree)
    attend = partial(
        hybrid_attention,
        layout=hybrid,
        ulysses_group=groups.ulysses,
        ring_group=groups.ring,
        **common,
    )
    ctx.log(f"attention: Ulysses degree {degree} x ring of {ctx.world_size // degree}")
    return attend, hybrid, degree


def _inject_fault(cfg, ctx, step: int) -> None:
    t = cfg.task
    if t.fault_rank is None or t.fault_rank != ctx.rank or t.fault_step != step:
        return
    if t.fault == "raise-once" and JobDir(ctx.job_dir).attempts.is_dir():
        return  # an earlier attempt failed here: this one (a resume) goes through
    ctx.log(f"injecting fault {t.fault!r} at step {step}")
    if t.fault in ("raise", "raise-once"):
        raise RuntimeError(f"injected fault on rank {ctx.rank} at step {step}")
    if t.fault == "hang":
        while True:
            time.sleep(3600)
    os._exit(17)  # "exit": die mid-ring without cleaning up


def _stop_agreed(ctx) -> bool:
    """Whether any rank got the warning signal (slurm.signal's), agreed by every rank at the
    same step, as the long-document and training tasks agree it (``consensus.any_has``): a
    rank that left the ring alone left its peers waiting in it until the collective timeout."""
    from ..longdoc.compute.scoring import comm_device
    from ..longdoc.consensus import any_has

    return any_has([ctx.stop_requested()], ctx.group, comm_device(ctx.group))[0]


def _timed_steps(cfg, ctx, attend, q, k, v, dout) -> tuple[list[dict], tuple]:
    """Forward and backward ``task.steps`` times, each timed (a CUDA device is synchronised
    around each phase); (timings, the last step's out, dq, dk, dv). A stop requested on any
    rank ends every rank at the same step with StoppedOnRequest (the job is not done)."""
    import torch

    t = cfg.task

    def sync() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    timings = []
    last = (None, None, None, None)
    for step in range(t.steps):
        if _stop_agreed(ctx):  # before the step's clock starts: not in its timing
            raise StoppedOnRequest(  # not done, and must not look done (it ended COMPLETED)
                f"stopped on request after {step} of {t.steps} steps; the outputs are not "
                "written (a stopped job must not look done): `ringctl resume` runs it again"
            )
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        sync()
        t0 = time.perf_counter()
        out = attend(qs, ks, vs)
        sync()
        t1 = time.perf_counter()
        _inject_fault(cfg, ctx, step)
        out.backward(dout)
        sync()
        t2 = time.perf_counter()
        last = (out, qs.grad, ks.grad, vs.grad)
        timings.append({"step": step, "forward_s": t1 - t0, "backward_s": t2 - t1})
        ctx.progress(step + 1, t.steps, unit="steps")
    return timings, last


def rank_record(ctx, layout: str, seq_local: int, timings: list[dict]) -> dict:
    """This rank's result record: its steps and their median forward/backward times."""
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "node": ctx.node,
        "layout": layout,
        "seq_local": seq_local,
        "steps_done": len(timings),
        "steps": timings,
    }
    # The first step warms up (allocations, kernel choices, the first connections: 1.73 s
    # against 0.044 for the next in the smoke job), so the medians are of the steps after it
    # where there are any; the median proper (of two steps, their mean).
    steady = timings[1:] or timings
    if steady:
        result["forward_median_s"] = statistics.median(s["forward_s"] for s in steady)
        result["backward_median_s"] = statistics.median(s["backward_s"] for s in steady)
        result["median_of"] = "steps after the first" if len(timings) > 1 else "the one step"
    return result


def _save_outputs(cfg, ctx, layout: str, degree: int, steps_done: int, tensors: dict) -> None:
    """The last step's output and gradients with this rank's positions (``save_outputs``)."""
    t = cfg.task
    meta = {
        "rank": str(ctx.rank),
        "world_size": str(ctx.world_size),
        "layout": layout,
        "ulysses_degree": str(degree),
        "seq_len": str(t.seq_len),
        "dtype": t.dtype,
        "steps_done": str(steps_done),
    }
    save_tensors(ctx.out_dir / f"rank-{ctx.rank}.safetensors", tensors, meta)


def _checked(cfg, ctx) -> str | None:
    """Rank 0 holds every rank's shards against float64 attention (``attention_check``) once
    all are written; a result outside the dtype's tolerance fails the job. The line said
    (rank 0), or None (the other ranks)."""
    import torch.distributed as dist

    from .attention_check import compare, too_large

    dist.barrier(group=ctx.group)  # every rank's shards are on disk
    if ctx.rank != 0:
        return None
    line = too_large(cfg)
    if line is None:
        got = load_results(ctx.out_dir, ctx.world_size)
        passed, line = compare(reference(cfg), got, str(cfg.task.dtype))
        if not passed:
            ctx.log(line)
            raise RuntimeError(f"the ring's result is wrong: {line}")
    ctx.log(line)
    return line


def _unplaceable(cfg, degree: int) -> bool:
    """Whether the batch script's placement step must refuse the job's Ulysses degree (it
    waited in the queue to fail there): the placement's rule (``topology.ulysses``: each
    NVLink domain's ranks divide into groups of U) where the domains are nodes (no NVLink
    blocks) of tasks_per_node ranks."""
    from ..backends import backend_of

    return (
        degree > 1
        and cfg.ring.placement == "required"
        and not cfg.ring.nvlink_blocks
        and backend_of(cfg).places_ring
        and int(cfg.tasks_per_node) % degree != 0
    )


class AttentionTask(Task):
    """Ring attention on random inputs, checked against `reference` (no gather step)."""

    name = "attention"
    params = Params
    hybrid_grids = True

    def check(self, cfg, bad) -> None:
        from ringattn.geometry import (
            LAYOUTS,
            grid_layout,
            layout_multiple,
            padded_length,
            ulysses_problem,
        )

        from .base import world_size

        t = cfg.task
        for key, least, most in PARAM_BOUNDS:
            why = int_problem(t[key], least, most)
            if why:
                raise bad(f"task.{key}", why)
        check_input_size(t, bad)
        check_softmax_scale(t.softmax_scale, bad)
        if t.dtype not in DTYPES:
            raise bad(
                "task.dtype", f"unknown dtype {t.dtype!r}; expected one of {', '.join(DTYPES)}"
            )
        kv = t.kv_heads if t.kv_heads is not None else t.heads
        if kv < 1 or t.heads % kv:
            why = f"heads ({t.heads}) must be a multiple of kv_heads ({kv})"
            raise bad("task.kv_heads", why, "task.heads")
        if t.layout is not None and t.layout not in LAYOUTS:
            raise bad("task.layout", f"unknown layout {t.layout!r}; expected contiguous or zigzag")
        if t.fault not in FAULTS:
            raise bad("task.fault", f"expected one of {', '.join(FAULTS)}, got {t.fault!r}")
        world, layout = world_size(cfg), job_layout(cfg)
        self.check_ring_keys(cfg, bad)
        degree = cfg.ring.ulysses if isinstance(cfg.ring.ulysses, int) else 1
        why = ulysses_problem(degree, world, int(t.heads), int(kv))
        if why:
            raise bad("ring.ulysses", f"{degree} {why}")
        if _unplaceable(cfg, degree):
            raise bad(
                "ring.ulysses",
                f"{degree} does not divide the {cfg.tasks_per_node} ranks of a node "
                "(tasks_per_node): a Ulysses group sits inside one node (or NVLink domain: "
                "ring.nvlink_blocks), so ring.placement=required would stop the job before "
                "any rank ran; ring.placement=optional runs its groups across nodes",
            )
        split = grid_layout(layout, degree)  # the engine's padding rule
        multiple = layout_multiple(split, world, degree)
        if t.seq_len % multiple:
            padded = padded_length(t.seq_len, world_size=world, layout=split, ulysses_degree=degree)
            raise bad(
                "task.seq_len",
                f"{t.seq_len} cannot be split over {world} ranks ({cfg.nodes} nodes x "
                f"{cfg.tasks_per_node}) in the {layout} layout: it must be a multiple of {multiple}"
                f" (e.g. {padded})",
                *("nodes", "tasks_per_node", "task.layout", "ring.layout", "ring.ulysses"),
            )

    @staticmethod
    def check_ring_keys(cfg, bad) -> None:
        """The task runs one ring (or one hybrid grid) of all the job's ranks: ring.size and
        ring.max_tokens_per_rank are refused by name rather than ignored, since the placement
        and submit's plan check would size the rings they ask for, not the one that runs."""
        for key in IGNORED_RING_KEYS:
            if cfg.ring[key] is not None:
                raise bad(
                    f"ring.{key}",
                    f"the attention task runs one ring of all the job's ranks and does not read "
                    f"it (got {cfg.ring[key]!r}); leave it null",
                )

    def workload(self, cfg):
        """What `ringctl plan` should size for this job (checked by `ringctl submit`)."""
        from ..planner.cost import Workload

        t = cfg.task
        return Workload(
            seq_len=int(t.seq_len),
            heads=int(t.heads),
            kv_heads=int(t.kv_heads or t.heads),
            head_dim=int(t.head_dim),
            batch=int(t.batch),
            dtype=str(t.dtype),
            causal=bool(t.causal),
            layout=job_layout(cfg),
            backward=True,
        )

    def run(self, cfg, ctx) -> dict:
        """Shard the job's random inputs, time ``task.steps`` forward+backward steps of the ring
        (or hybrid) attention, and write this rank's result (and outputs when asked)."""
        from ringattn import sequence_positions

        t = cfg.task
        dtype = _dtype(t.dtype)
        kv_heads = int(t.kv_heads if t.kv_heads is not None else t.heads)
        attend, layout, degree = _attention_for(cfg, ctx, job_layout(cfg), kv_heads)
        where = {"world_size": ctx.world_size, "rank": ctx.rank, "layout": layout}
        if degree > 1:
            where["ulysses_degree"] = degree
        positions = sequence_positions(t.seq_len, **where)
        inputs = make_inputs(cfg, positions)  # this rank's rows only, as shard_sequence's
        q, k, v, dout = (inputs.pop(n).to(dtype).to(ctx.device) for n in INPUT_NAMES)
        ctx.log(
            f"attention: seq_len={t.seq_len} (local {q.shape[1]}) batch={t.batch} heads={t.heads} "
            f"kv_heads={k.shape[2]} head_dim={t.head_dim} dtype={t.dtype} causal={t.causal} "
            f"layout={layout} steps={t.steps} device={ctx.device}"
        )
        timings, (out, dq, dk, dv) = _timed_steps(cfg, ctx, attend, q, k, v, dout)
        result = rank_record(ctx, layout, int(q.shape[1]), timings)
        if t.save_outputs and out is not None:
            tensors = {"out": out, "dq": dq, "dk": dk, "dv": dv, "positions": positions}
            _save_outputs(cfg, ctx, layout, degree, len(timings), tensors)
            result["check"] = _checked(cfg, ctx)
        atomic_write_json(ctx.out_dir / f"rank-{ctx.rank}.json", result)
        return result
