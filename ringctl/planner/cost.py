"""Memory, time and overlap of a ring-attention step, before any allocation is spent.

The model follows what the engine does (ringattn/ring.py), step by step:

* every rank holds n = N/P tokens; at each of the P steps it computes its queries against one
  K/V block while the next block travels over the ring's slowest hop;
* non-causal: each step is a full n x n block; causal (zigzag): half a block per step, so
  every rank does the same work; causal (contiguous): the last rank does P blocks' worth of
  the work, the first one, which sets the pace;
* backward travels K/V again plus the float32 dK/dV accumulators (P hops, the last one
  exposed: nothing is left to compute behind it); a ring of 2 (a leg of one hop) sends K/V
  alone along and one accumulator home.

A step takes max(compute, transfer); the transfer is hidden when compute >= transfer, which
(both growing with n, compute as n^2) gives the minimal tokens per rank for full overlap —
the condition of the Ring Attention paper (Liu et al., 2023, section 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ringattn.geometry import banded_rows, grid_layout, layout_multiple, ulysses_problem

from .devices import Device
from .memory import (
    CHECKPOINTS,
    DTYPE_BYTES,
    MODES,
    OPTIMIZERS,
    SHARDS,
    TRAIN,
    activation_parts,
    backward_working_set,
    banded_workspace,
    logits_bytes,
    optimizer_step_parts,
    output_bytes,
    precision,
    runs_lm_head,
    state_parts,
)
from .model import ModelShape
from .window import layer_windows, ring_stages, rows_carried, trimmed_hops

GIB = 1024**3

__all__ = ["DTYPE_BYTES", "GIB", "Estimate", "Link", "ModelShape", "Workload", "estimate"]


@dataclass(frozen=True)
class Workload:
    """What one ring computes: a sequence, its attention shape and, optionally, a model.

    ``mode``: ``score`` / ``embed`` (inference: no autograd state) or ``train`` (forward and
    backward). Without it, ``backward`` says which (the attention-only callers' field).
    ``shard_degree``: the ranks the weights are sharded over; default the ring's ranks.
    ``ulysses``: heads are split over this many ranks of a node (DeepSpeed-Ulysses all-to-all)
    and the ring runs over ranks / ulysses groups; 1 is a flat ring.
    """

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    dtype: str = "bfloat16"
    causal: bool = True
    layout: str = "zigzag"
    backward: bool = True
    model: ModelShape | None = None
    mode: str | None = None
    checkpoint: str = "none"
    shard: str = "none"
    shard_degree: int | None = None
    optimizer: str | None = None
    lm_head_chunk: int = 4096  # tokens per lm_head + log-softmax chunk; 0: all at once
    ulysses: int = 1
    mlp_chunk: int = 0  # tokens per MLP chunk (blockwise feedforward); 0: all at once
    # Half-precision training as ringctl's training job runs it: autocast over float32
    # weights (FSDP gathers float32; every matmul's weight cast and kept for backward).
    # False: FSDP's mixed precision (weights gathered in the compute dtype), as torchtitan.
    autocast: bool = False
    # A sliding window on every layer (attention alone, or to override the model's); None:
    # the model's own (ModelShape.window on its window_layers), if any. Causal only.
    window: int | None = None

    def __post_init__(self):
        checks = [
            ("mode", self.mode, (None, *MODES)),
            ("checkpoint", self.checkpoint, CHECKPOINTS),
            ("shard", self.shard, SHARDS),
            ("optimizer", self.optimizer, OPTIMIZERS),
        ]
        for name, value, allowed in checks:
            if value not in allowed:
                shown = ", ".join(str(a) for a in allowed if a is not None)
                raise ValueError(f"Workload.{name}: {value!r} is not one of {shown}")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"Workload.window: {self.window!r} is not a window of >= 1 tokens")

    @property
    def run_mode(self) -> str:
        return self.mode or ("train" if self.backward else "score")

    @property
    def trains(self) -> bool:
        return self.run_mode == TRAIN


@dataclass(frozen=True)
class Link:
    """One hop or collective link: bandwidth per direction and a per-message latency."""

    name: str
    gbit_s: float
    latency_s: float = 10e-6

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_s * 1e9 / 8


@dataclass
class Estimate:
    ranks: int
    tokens_per_rank: int
    memory_bytes: dict[str, float] = field(default_factory=dict)
    memory_total_gib: float = 0.0
    memory_capacity_gib: float = 0.0
    fits: bool = True
    step_compute_s: dict[str, float] = field(default_factory=dict)
    step_transfer_s: dict[str, float] = field(default_factory=dict)
    overlapped: dict[str, bool] = field(default_factory=dict)
    min_tokens_per_rank_for_overlap: dict[str, int] = field(default_factory=dict)
    total_s: dict[str, float] = field(default_factory=dict)  # ring attention alone
    warnings: list[str] = field(default_factory=list)
    mode: str = "train"
    precision: dict[str, str] = field(default_factory=dict)
    shard_degree: int = 1
    ulysses: int = 1
    memory_phases_gib: dict[str, float] = field(default_factory=dict)  # transients per phase
    all_to_all_s: float = 0.0  # hybrid layouts: the Ulysses all-to-alls, all layers
    model_s: dict[str, float] = field(default_factory=dict)  # whole model, by part
    model_total_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def attention_view(w: Workload, ranks: int) -> tuple[Workload, int]:
    """The ring attention a hybrid layout runs: ranks / U ring ranks, each holding N / ring
    tokens for heads / U heads (K/V heads: kv / U, or one replicated head when U exceeds
    them). A flat ring (U = 1) is itself."""
    u = w.ulysses
    if u == 1:
        return w, ranks
    return replace(w, heads=w.heads // u, kv_heads=max(1, w.kv_heads // u), ulysses=1), ranks // u


def attention_parts(w: Workload, ranks: int, cpu: bool = False) -> dict[str, float]:
    """The ring's own buffers for one attention call (the layer being computed); ``cpu``:
    ranks on host CPUs (the banded kernel's fused path, for a sliding window).

    Blocks land in at most two buffers a leg (ringattn.ring._Rotation); backward, a leg of
    several hops holds this rank's accumulator and two travelling, ``1 + min(2, P)`` whole
    blocks in float32. Where a window keeps every leg to one hop carrying part of a block
    (``window.trimmed_hops``), a leg lands its one block in one buffer of the rows carried;
    backward (``_backward_leg``) the owner keeps its own gradients whole and the visitor's
    accumulator comes home over the rows carried (two of them alive), while an earlier
    leg's whole result waits beside a later one's: one whole a leg and two carried."""
    n, b = w.seq_len / ranks, DTYPE_BYTES[w.dtype]
    q = w.batch * n * w.heads * w.head_dim * b
    kv = 2 * w.batch * n * w.kv_heads * w.head_dim * b
    kv_f32 = kv * 4 / b
    trimmed = trimmed_hops(w, ranks)
    in_flight, carried = (trimmed[0], trimmed[1] / n) if trimmed else (min(2, ranks - 1), 1.0)
    parts = {
        "q, k, v shards": q + kv,
        "output shard": q,
        "log-sum-exp": w.batch * w.heads * n * 4,
        "K/V blocks in flight": in_flight * kv * carried,
        "block kernel workspace": q * 4 / b,  # one block's output in float32, merged in place
    }
    window = layer_windows(w)[0][0]
    workspace = banded_workspace(w, ranks, window, cpu) if window is not None else 0
    if workspace:  # a window cut into unmasked pieces (geometry.SPLIT_WINDOW) needs none
        parts[f"banded kernel workspace (window {window})"] = workspace
    if w.trains:
        parts |= {
            "dout + dQ (float32 accumulator)": q + q * 4 / b,
            "dK/dV accumulators (float32, travelling)": kv_f32
            * (in_flight + 2 * carried if trimmed else 1 + min(2, ranks)),
            "dQ, dK, dV results": q + kv,
        }
    return parts


def ulysses_parts(w: Workload, attn: Workload, ring: int) -> dict[str, float]:
    """A hybrid layout's forward beside the ring's own buffers (ringattn.hybrid._ulysses_ring):
    the heads-sharded q, k, v the all-to-all receives, and the ring's contiguous copies of
    them (views into one buffer); K/V heads replicated up to U where the model has fewer.
    Unpriced, the forward measured 11.1 MiB against 5.1 at U = 2 and 14.1 against 4.1 at
    U = 4 (8k tokens, 4 ranks, 8/2 heads of 32, float32): these terms are the difference.
    Training's peak is in backward, where the plan already held (1.00-1.07x). ``attn`` and
    ``ring``: the ring this layout runs (``attention_view``)."""
    if w.ulysses == 1 or w.trains:
        return {}
    b = DTYPE_BYTES[w.dtype]
    qkv = attn.batch * attn.seq_len / ring * (attn.heads + 2 * attn.kv_heads) * attn.head_dim * b
    parts = {"Ulysses: received q, k, v and the ring's contiguous copies": 2 * qkv}
    if w.kv_heads < w.ulysses:
        tokens = w.batch * w.seq_len / (ring * w.ulysses)  # this rank's, as the caller's
        parts["Ulysses: K/V heads replicated to U"] = 2 * tokens * w.ulysses * w.head_dim * b
    return parts


def memory_phases(
    w: Workload, ranks: int, cpu: bool = False
) -> tuple[dict[str, float], dict[str, dict]]:
    """(always held, {phase: transient parts}) of one rank, in bytes (``cpu``: ranks on host
    CPUs, see ``attention_parts``).

    A layer's attention and its MLP do not run at the same time, nor does the lm_head run
    beside a layer: the ring's buffers, the MLP's gradients and the logits are transients of
    different phases, so the peak is what is always held plus the largest phase."""
    attn, ring = attention_view(w, ranks)
    buffers = attention_parts(attn, ring, cpu) | ulysses_parts(w, attn, ring)
    if w.model is None:
        return buffers, {}
    for counted in ("q, k, v shards", "output shard", "log-sum-exp"):
        buffers.pop(counted)  # part of the layer's activations below
    tokens = w.batch * w.seq_len / ranks
    degree = w.shard_degree or ranks
    held = state_parts(w, degree)
    held.update(output_bytes(w, tokens))
    layer: dict[str, float] = {}
    saved: dict[str, float] = {}  # kept from the forward until backward: not in the step
    for name, value in activation_parts(w, tokens).items():
        (layer if name.startswith(("recomputed", "activations (one layer")) else saved)[name] = (
            value
        )
    ring_parts = {f"ring attention: {k}": v for k, v in buffers.items()}
    phases = {"attention": saved | layer | ring_parts}
    mlp = saved | layer
    if w.trains:
        mlp["backward working set (one layer's gradients)"] = backward_working_set(w, tokens)
    phases["MLP"] = mlp
    if runs_lm_head(w):
        phases["lm_head"] = saved | {_logits_label(w, tokens): logits_bytes(w, tokens)}
    step = optimizer_step_parts(w, degree, ranks)
    if step:  # after backward: the activations are freed
        phases["optimizer step"] = step
    return held, phases


def peak_phase(phases: dict[str, dict]) -> str | None:
    return max(phases, key=lambda p: sum(phases[p].values())) if phases else None


def memory_per_rank(w: Workload, ranks: int, cpu: bool = False) -> dict[str, float]:
    """Bytes one rank holds at its peak, by what holds them (the largest phase's transients
    beside what is always held; see ``memory_phases``)."""
    held, phases = memory_phases(w, ranks, cpu)
    peak = peak_phase(phases)
    return held | (phases[peak] if peak else {})


def _logits_label(w: Workload, tokens: float) -> str:
    if w.lm_head_chunk and w.lm_head_chunk < tokens:
        return f"logits (lm_head in chunks of {w.lm_head_chunk})"
    return "logits (lm_head over all tokens at once)"


def nominal_link(device: Device, nodes: int = 1, latency_s: float | None = None) -> Link:
    """The ring's slowest hop when no topology plan says it: this host's measured exchange for
    a calibrated device, else the device's inter-node network (``net_gbit``: the NIC per GPU
    of its reference system) across nodes, else NVLink (or PCIe) inside one."""
    if device.p2p_gbytes_s:
        return Link("local gloo", device.p2p_gbytes_s * 8, device.p2p_latency_s)
    if nodes > 1:
        return net_link(device, latency_s)
    return intra_link(device, latency_s)


def net_link(device: Device, latency_s: float | None = None) -> Link:
    lat = device.net_latency_s if latency_s is None else latency_s
    return Link(f"NET ({device.net_name}, nominal)", device.net_gbit, lat)


def intra_link(device: Device, latency_s: float | None = None) -> Link:
    lat = device.nvlink_latency_s if latency_s is None else latency_s
    if device.nvlink_gbytes_s:
        return Link("NVLink (nominal)", 8 * device.nvlink_gbytes_s, lat)
    if device.pcie_gbytes_s:
        return Link("PCIe (nominal)", 8 * device.pcie_gbytes_s, lat)
    # a device entry without a link figure: the assumption is named where the hop is shown
    return Link("PCIe x16 gen4 (assumed: no nvlink_gbps or pcie_gbps)", 8 * 32.0, lat)


def step_kinds(w: Workload, ranks: int) -> list[str]:
    """The block kind the slowest rank computes at each ring step (ringattn.ring.block_plan)."""
    if not w.causal:
        return ["full"] * ranks
    if w.layout == "zigzag":
        return ["diag"] + ["half"] * (ranks - 1)  # its two chunks, then half a block each step
    return ["diag"] + ["full"] * (ranks - 1)  # the last rank: its diagonal, then whole blocks


def _block_shape(w: Workload, ranks_on_host: int) -> dict:
    return dict(
        dtype=w.dtype,
        batch=w.batch,
        heads=w.heads,
        head_dim=w.head_dim,
        ranks_on_host=ranks_on_host,
    )


def _full_ring(w: Workload, ranks: int, device: Device, ranks_on_host: int) -> list[list]:
    """One layer's ring without a window: one leg, a (forward, backward) per step."""
    n = w.seq_len / ranks
    shape = _block_shape(w, ranks_on_host)
    times = {kind: device.block_time(kind, n, **shape) for kind in set(step_kinds(w, ranks))}
    return [[times[kind] for kind in step_kinds(w, ranks)]]


def _piece_seconds(pieces, w: Workload, device: Device, ranks_on_host: int):
    """(forward, backward) seconds of one ring stage's pieces (window.step_pieces)."""
    shape = _block_shape(w, ranks_on_host)
    fwd = bwd = 0.0
    for (kind, rows, keys), count in pieces:
        if kind == "causal":
            f, b = device.block_time("diag", rows, **shape)
        else:
            f, b = device.rect_time(rows, keys, **shape)
        fwd, bwd = fwd + count * f, bwd + count * b
    return fwd, bwd


def _window_ring(w: Workload, ranks: int, window: int, device: Device, ranks_on_host: int):
    """One windowed layer's ring on its busiest rank: each leg's stages (window.ring_stages),
    the banded chunks as the kernel computes them."""
    n = w.seq_len // ranks
    rows = banded_rows(w.batch, w.heads, window)
    return [
        [_piece_seconds(pieces, w, device, ranks_on_host) for pieces in stages]
        for _, stages in ring_stages(ranks, n, w.layout, window, rows)
    ]


def _transfer_seconds(w: Workload, ranks: int, link: Link, rows: float | None = None):
    """Seconds of one layer's hop over the bottleneck: (K/V block, float32 dK/dV accumulator),
    of ``rows`` rows where a hop carries only part of a block (a window: ``rows_carried``),
    else the whole block."""
    n, b = w.seq_len / ranks, DTYPE_BYTES[w.dtype]
    kv = 2 * w.batch * (n if rows is None else rows) * w.kv_heads * w.head_dim * b
    return kv / link.bytes_per_s + link.latency_s, kv * 4 / b / link.bytes_per_s + link.latency_s


def _dkv_rides_along(hops: int) -> bool:
    """Whether a backward leg of ``hops`` hops sends a dK/dV accumulator along with each K/V
    block: not on a leg of one hop (P = 2), whose owner keeps its own gradients and whose one
    visitor sends its accumulator straight home (ringattn.ring._backward_leg)."""
    return hops > 1


def _legs_total(legs, t_kv: float, t_dkv: float, on_cores: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ring, leg after leg.

    A transfer follows every stage of a leg but its last and hides behind that stage's compute
    (a step takes the longer of the two); backward, each block's dK/dV accumulator travels with
    it and, after the leg's last hop, goes home in one more exchange with nothing left to hide
    behind. A leg of one hop (P = 2) sends no accumulator along, only the visitor's home
    (ringattn.ring._backward_leg keeps the owner's own gradients): one dK/dV transfer, not two.
    On host cores (``on_cores``) a transfer also costs the cores its copy."""
    fwd_total = bwd_total = 0.0
    for stages in legs:
        hops = len(stages) - 1
        t_along = t_kv + (t_dkv if _dkv_rides_along(hops) else 0.0)  # behind a moving stage
        for i, (f, b) in enumerate(stages):
            moving = i < hops
            if on_cores and moving:
                f, b = f + t_kv, b + t_along
            elif on_cores and hops:
                b += t_dkv
            fwd_total += max(f, t_kv) if moving else f
            bwd_total += max(b, t_along) if moving else b
        if hops:
            bwd_total += t_dkv
    return fwd_total, bwd_total


def _ring_times(
    est: Estimate,
    w: Workload,
    ranks: int,
    device: Device,
    link: Link,
    ranks_on_host: int,
    overlap_threshold: bool,
) -> None:
    """Fill the ring attention's per-step and total times (w: the attention view), layers
    with a sliding window on their own shorter ring, the others on the full one."""
    layers = w.model.layers if w.model else 1
    t_kv, t_dkv = _transfer_seconds(w, ranks, link) if ranks > 1 else (0.0, 0.0)
    over = device.step_overhead(ranks_on_host) if ranks > 1 else (0.0, 0.0)
    on_cores = device.cores is not None and ranks > 1
    total_f = total_b = 0.0
    typical = {}  # the step a transfer hides behind, by kind of ring
    for window, count in layer_windows(w):
        hop = (t_kv, t_dkv)
        if window is None:
            legs = _full_ring(w, ranks, device, ranks_on_host)
        else:
            legs = _window_ring(w, ranks, window, device, ranks_on_host)
            if ranks > 1:
                carried = rows_carried(ranks, w.seq_len // ranks, w.layout, window)
                hop = _transfer_seconds(w, ranks, link, carried)
        legs = [[(f + over[0], b + over[1]) for f, b in stages] for stages in legs]
        fwd, bwd = _legs_total(legs, *hop, on_cores)
        total_f, total_b = total_f + count * fwd, total_b + count * bwd
        # full ring: an off-diagonal step; windowed: its first step (the own block)
        kind, stage = ("full", -1) if window is None else ("window", 0)
        typical[kind] = (legs[0][stage], hop)
    typical, (t_kv, t_dkv) = typical.get("full", typical.get("window"))
    est.total_s = {"forward": total_f}
    if w.trains:
        est.total_s.update({"backward": total_b, "forward+backward": total_f + total_b})
    est.step_compute_s = {"forward": layers * typical[0]}
    est.step_transfer_s = {"forward": layers * t_kv}
    if w.trains:
        est.step_compute_s["backward"] = layers * typical[1]
        along = t_kv + (t_dkv if _dkv_rides_along(ranks - 1) else 0.0)
        est.step_transfer_s["backward"] = layers * along
    full = any(window is None for window, _ in layer_windows(w))
    for phase in est.step_compute_s:
        est.overlapped[phase] = (
            ranks == 1 or est.step_compute_s[phase] >= est.step_transfer_s[phase]
        )
        # A windowed ring's compute and transfers both grow as n: W decides, no threshold.
        if overlap_threshold and full:
            est.min_tokens_per_rank_for_overlap[phase] = min_tokens_for_overlap(
                w, device, link, phase, ranks_on_host, ranks=ranks
            )


def estimate(
    w: Workload,
    ranks: int,
    device: Device,
    link: Link,
    *,
    ranks_on_host: int = 1,
    intra: Link | None = None,
    net: Link | None = None,
    overlap_threshold: bool = True,
) -> Estimate:
    """Memory, ring attention and (with a model) whole-model time of one sequence.

    ``link`` is the ring's bottleneck hop; ``intra`` / ``net`` the links FSDP's collectives
    and the Ulysses all-to-all use (default: the device's nominal NVLink and network).
    """
    why = ulysses_problem(w.ulysses, ranks, w.heads, w.kv_heads)
    if why:
        raise ValueError(f"ulysses degree {w.ulysses} {why}")
    attn, ring = attention_view(w, ranks)
    n = w.seq_len // ranks
    cpu = device.cores is not None
    mem = memory_per_rank(w, ranks, cpu)
    total = sum(mem.values())
    capacity = usable_gib(device, ranks_on_host)
    est = Estimate(
        ranks=ranks,
        tokens_per_rank=n,
        memory_bytes=mem,
        memory_total_gib=total / GIB,
        memory_capacity_gib=capacity,
        fits=total / GIB <= capacity,
        mode=w.run_mode,
        precision=precision(w),
        ulysses=w.ulysses,
        shard_degree=(w.shard_degree or ranks) if w.shard != "none" else 1,
    )
    _, phases = memory_phases(w, ranks, cpu)
    est.memory_phases_gib = {name: sum(p.values()) / GIB for name, p in phases.items()}
    _ring_times(est, attn, ring, device, link, ranks_on_host, overlap_threshold)
    from .timing import all_to_all_s, model_time

    spans = _groups_span_nodes(w.ulysses, ranks, ranks_on_host)
    a2a_link = (net or net_link(device)) if spans else (intra or intra_link(device))
    a2a = all_to_all_s(w, ranks, a2a_link)
    est.all_to_all_s = (w.model.layers if w.model else 1) * (a2a[0] + (a2a[1] if w.trains else 0))
    if spans:
        est.warnings.append(
            f"Ulysses groups of {w.ulysses} span nodes ({ranks_on_host} ranks a node): their "
            f"all-to-all is priced on the network ({a2a_link.name}), not inside a node"
        )
    timed = model_time(
        w,
        ranks,
        device,
        est.total_s,
        ranks_on_host=ranks_on_host,
        intra=intra or intra_link(device),
        net=net or net_link(device),
    )
    if timed:
        est.model_s, est.model_total_s = timed["parts"], timed["total_s"]
        est.tokens_per_s_per_gpu, est.mfu = timed["tokens_per_s_per_gpu"], timed["mfu"]
    _warn(est, device, capacity, attn.seq_len // ring)
    if w.model is not None and w.model.layout_note:
        est.warnings.append(w.model.layout_note)
    return est


def _warn(est: Estimate, device: Device, capacity: float, ring_tokens: int) -> None:
    if not est.fits:
        est.warnings.append(
            f"does not fit: {est.memory_total_gib:.1f} GiB per rank needed, "
            f"{capacity:.1f} GiB usable on {device.name}"
        )
    for phase, hidden in est.overlapped.items():
        if not hidden:
            need = est.min_tokens_per_rank_for_overlap.get(phase)
            needs = f"; needs >= {need} tokens per ring rank (has {ring_tokens})" if need else ""
            est.warnings.append(
                f"{phase}: communication exposed ({1e3 * est.step_transfer_s[phase]:.2f} ms "
                f"transfer vs {1e3 * est.step_compute_s[phase]:.2f} ms compute per step){needs}"
            )


def min_tokens_for_overlap(
    w: Workload,
    device: Device,
    link: Link,
    phase: str,
    ranks_on_host: int = 1,
    *,
    ranks: int | None = None,
) -> int:
    """Smallest tokens per rank n with compute(n) >= transfer(n) for an off-diagonal step.

    Compute grows as n^2 and transfer as n (plus latency), so the condition holds from one
    threshold on; found by bisection on the same step model `estimate` uses. Backward, a
    step carries K/V and a dK/dV accumulator, except on a ring of 2 (``ranks``; None: more
    than 2), whose one hop carries K/V alone.
    """
    kind = step_kinds(w, 2)[-1]
    b = DTYPE_BYTES[w.dtype]
    kv_per_token = 2 * w.batch * w.kv_heads * w.head_dim * b
    carries_dkv = phase != "forward" and (ranks is None or _dkv_rides_along(ranks - 1))
    per_token = kv_per_token * (1 + 4 / b) if carries_dkv else kv_per_token
    hops = 2 if carries_dkv else 1

    def hidden(n: int) -> bool:
        fwd, bwd = device.block_time(
            kind,
            n,
            dtype=w.dtype,
            batch=w.batch,
            heads=w.heads,
            head_dim=w.head_dim,
            ranks_on_host=ranks_on_host,
        )
        compute = fwd if phase == "forward" else bwd
        return compute >= n * per_token / link.bytes_per_s + hops * link.latency_s

    lo, hi = 0, 1
    while not hidden(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


def usable_gib(device: Device, ranks_on_host: int = 1) -> float:
    """Memory one rank may use: a GPU's own, or a calibrated host's RAM shared by its ranks."""
    if device.cores is not None:
        return (device.mem_gib - device.reserve_gib) / max(1, ranks_on_host)
    return device.mem_gib - device.reserve_gib


def _groups_span_nodes(ulysses: int, ranks: int, ranks_on_host: int) -> bool:
    """Whether Ulysses groups (blocks of ``ulysses`` consecutive ranks, laid node by node)
    cross a node's edge: their all-to-all then runs on the network, which was priced as the
    node's NVLink (8-9x less) for a job whose placement is optional."""
    return ulysses > 1 and ranks > ranks_on_host and ranks_on_host % ulysses != 0


def split_unit(w: Workload, ranks: int) -> int:
    """What the sequence's length must be a multiple of over ``ranks``: the engine's rule for
    the workload's layout, of its Ulysses grid where the heads are split (lcm(P, 2R) for
    zigzag, not 2P: the plan refused lengths the job ran). The degree must divide ``ranks``
    (``ulysses_problem``)."""
    return layout_multiple(grid_layout(w.layout, w.ulysses), ranks, w.ulysses)


def splits(w: Workload, ranks: int) -> bool:
    """Whether the layout splits the sequence over ``ranks`` and its Ulysses degree them."""
    if ulysses_problem(w.ulysses, ranks, w.heads, w.kv_heads):
        return False
    return w.seq_len % split_unit(w, ranks) == 0


def longest_sequence(w: Workload, ranks: int, device: Device, ranks_on_host: int = 1) -> int:
    """The largest total N (a multiple of the layout's unit) whose per-rank memory fits."""
    capacity = usable_gib(device, ranks_on_host) * GIB
    flat = ulysses_problem(w.ulysses, ranks, w.heads, w.kv_heads)  # no grid: the ring's rule
    unit = layout_multiple(w.layout, ranks) if flat else split_unit(w, ranks)

    def fits(seq: int) -> bool:
        held = memory_per_rank(replace(w, seq_len=seq), ranks, device.cores is not None)
        return sum(held.values()) <= capacity

    if not fits(unit):
        return 0
    lo, hi = 1, 2
    while fits(hi * unit):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid)
    return lo * unit


def fewest_ranks(
    w: Workload, device: Device, limit: int = 1 << 16, ranks_on_host: int = 1
) -> int | None:
    """The fewest ranks whose per-rank memory fits the sequence *and* over which the layout
    can split it (None: no such count up to ``limit``).

    Only multiples of the Ulysses degree U are ranks a hybrid layout runs on (U x R), so the
    search is over R = P / U. Memory falls as P grows, so the smallest P that fits is found
    by bisection; the answer is then the first P from there that divides the sequence as the
    layout needs (a count the planner itself would refuse is no answer).
    """
    capacity = usable_gib(device, ranks_on_host) * GIB
    u = w.ulysses

    def fits(ring: int) -> bool:
        return sum(memory_per_rank(w, ring * u, device.cores is not None).values()) <= capacity

    most = limit // u
    if most < 1 or not fits(most):
        return None
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return next((r * u for r in range(hi, most + 1) if splits(w, r * u)), None)
