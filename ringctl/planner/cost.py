"""Memory, time and overlap of a ring-attention step, before any allocation is spent.

The model follows what the engine does (ringattn/ring.py), step by step:

* every rank holds n = N/P tokens; at each of the P steps it computes its queries against one
  K/V block while the next block travels over the ring's slowest hop;
* non-causal: each step is a full n x n block; causal (zigzag): half a block per step, so
  every rank does the same work; causal (contiguous): the last rank does P blocks' worth of
  the work, the first one, which sets the pace;
* backward travels K/V again plus the float32 dK/dV accumulators (P hops, the last one
  exposed: nothing is left to compute behind it).

A step takes max(compute, transfer); the transfer is hidden when compute >= transfer, which
(both growing with n, compute as n^2) gives the minimal tokens per rank for full overlap —
the condition of the Ring Attention paper (Liu et al., 2023, section 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .devices import Device

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only LM, for activation and weight memory (per rank: all weights replicated)."""

    layers: int
    hidden: int
    intermediate: int | None = None
    vocab: int = 32000
    params: int | None = None  # default: estimated from the shape


@dataclass(frozen=True)
class Workload:
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


@dataclass(frozen=True)
class Link:
    """The ring's slowest hop (from a topology plan's bottleneck, or nominal)."""

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
    total_s: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _model_params(m: ModelShape) -> int:
    if m.params:
        return m.params
    inter = m.intermediate or 4 * m.hidden
    per_layer = 4 * m.hidden * m.hidden + 3 * m.hidden * inter  # attention + gated MLP
    return m.layers * per_layer + 2 * m.vocab * m.hidden


def memory_per_rank(w: Workload, ranks: int) -> dict[str, float]:
    """Bytes one rank holds at its peak, by what holds them."""
    n, b = w.seq_len / ranks, DTYPE_BYTES[w.dtype]
    q = w.batch * n * w.heads * w.head_dim * b
    kv = 2 * w.batch * n * w.kv_heads * w.head_dim * b
    kv_f32 = kv * 4 / b
    in_flight = min(2, ranks - 1)
    parts = {
        "q, k, v shards": q + kv,
        "output shard": q,
        "log-sum-exp": w.batch * w.heads * n * 4,
        "K/V blocks in flight": in_flight * kv,
        "block kernel workspace": q * 4 / b,  # one block's output in float32, merged in place
    }
    if w.backward:
        parts.update({
            "dout + dQ (float32 accumulator)": q + q * 4 / b,
            "dK/dV accumulators (float32, travelling)": (1 + min(2, ranks)) * kv_f32,
            "dQ, dK, dV results": q + kv,
        })  # fmt: skip
    if w.model is not None:
        m = w.model
        params = _model_params(m)
        parts["model weights"] = params * b
        tokens = w.batch * n
        if w.backward:
            # Saved activations per layer with a fused attention kernel (no n^2 scores):
            # about 34 * hidden bytes per token in 16-bit (Korthikanti et al., 2022).
            parts["activations (all layers)"] = m.layers * 34 * m.hidden * tokens * b / 2
            parts["gradients"] = params * 4
        else:
            parts["activations (one layer live)"] = 2 * 34 * m.hidden * tokens * b / 2
        parts["logits chunk (lm_head in chunks)"] = min(tokens, 4096) * m.vocab * 4
    return parts


def nominal_link(device: Device, nodes: int = 1) -> Link:
    """The ring's slowest hop when no topology plan says it: this host's measured exchange for
    a calibrated device, else NDR InfiniBand across nodes, else NVLink (or PCIe) inside one."""
    if device.p2p_gbytes_s:
        return Link("local gloo", device.p2p_gbytes_s * 8, device.p2p_latency_s)
    if nodes > 1:
        return Link("NET (NDR InfiniBand, nominal)", 400.0, 5e-6)
    if device.nvlink_gbytes_s:
        return Link("NVLink (nominal)", 8 * device.nvlink_gbytes_s)
    return Link("PCIe (nominal)", 8 * (device.pcie_gbytes_s or 32))


def step_kinds(w: Workload, ranks: int) -> list[str]:
    """The block kind the slowest rank computes at each ring step (ringattn.ring.block_plan)."""
    if not w.causal:
        return ["full"] * ranks
    if w.layout == "zigzag":
        return ["diag"] + ["half"] * (ranks - 1)  # its two chunks, then half a block each step
    return ["diag"] + ["full"] * (ranks - 1)  # the last rank: its diagonal, then whole blocks


def _step_seconds(w: Workload, ranks: int, device: Device, ranks_on_host: int):
    """[(forward, backward) seconds] per ring step on the slowest rank, summed over layers."""
    n = w.seq_len / ranks
    layers = w.model.layers if w.model else 1
    times = {}
    for kind in set(step_kinds(w, ranks)):
        fwd, bwd = device.block_time(
            kind, n, dtype=w.dtype, batch=w.batch, heads=w.heads, head_dim=w.head_dim,
            ranks_on_host=ranks_on_host,
        )  # fmt: skip
        times[kind] = (layers * fwd, layers * bwd)
    if ranks > 1:
        over_f, over_b = device.step_overhead(ranks_on_host)
        times = {k: (f + layers * over_f, b + layers * over_b) for k, (f, b) in times.items()}
    return [times[kind] for kind in step_kinds(w, ranks)]


def _transfer_seconds(w: Workload, ranks: int, link: Link):
    """Seconds per step over the bottleneck hop: (K/V block, float32 dK/dV accumulator)."""
    n, b = w.seq_len / ranks, DTYPE_BYTES[w.dtype]
    kv = 2 * w.batch * n * w.kv_heads * w.head_dim * b
    layers = w.model.layers if w.model else 1
    return (
        layers * (kv / link.bytes_per_s + link.latency_s),
        layers * (kv * 4 / b / link.bytes_per_s + link.latency_s),
    )


def estimate(
    w: Workload, ranks: int, device: Device, link: Link, *, ranks_on_host: int = 1
) -> Estimate:
    n = w.seq_len // ranks
    mem = memory_per_rank(w, ranks)
    total = sum(mem.values())
    capacity = usable_gib(device, ranks_on_host)
    est = Estimate(
        ranks=ranks,
        tokens_per_rank=n,
        memory_bytes=mem,
        memory_total_gib=total / GIB,
        memory_capacity_gib=capacity,
        fits=total / GIB <= capacity,
    )
    steps = _step_seconds(w, ranks, device, ranks_on_host)
    typical_fwd, typical_bwd = steps[-1]  # an off-diagonal step's compute
    t_kv, t_dkv = _transfer_seconds(w, ranks, link) if ranks > 1 else (0.0, 0.0)
    if device.cores is not None and ranks > 1:
        # Ranks on host CPUs move blocks with those CPUs (gloo over loopback copies through
        # the kernel): a transfer hides its wait behind compute but still costs core time.
        steps = [(f + t_kv, b + t_kv + t_dkv) for f, b in steps[:-1]] + [
            (steps[-1][0], steps[-1][1] + t_dkv)
        ]
    # Forward: steps 0..P-2 overlap the next block's transfer; the last step has none.
    est.step_compute_s = {"forward": typical_fwd}
    est.step_transfer_s = {"forward": t_kv}
    est.total_s = {"forward": sum(max(f, t_kv) for f, _ in steps[:-1]) + steps[-1][0]}
    if w.backward:
        # Backward: K/V and the travelling dK/dV overlap compute; the last dK/dV hop (home)
        # has nothing left to hide behind.
        est.step_compute_s["backward"] = typical_bwd
        est.step_transfer_s["backward"] = t_kv + t_dkv
        est.total_s["backward"] = (
            sum(max(b, t_kv + t_dkv) for _, b in steps[:-1]) + steps[-1][1] + t_dkv
        )
        est.total_s["forward+backward"] = est.total_s["forward"] + est.total_s["backward"]
    for phase in est.step_compute_s:
        est.overlapped[phase] = (
            ranks == 1 or est.step_compute_s[phase] >= est.step_transfer_s[phase]
        )
        est.min_tokens_per_rank_for_overlap[phase] = min_tokens_for_overlap(
            w, device, link, phase, ranks_on_host
        )
    if not est.fits:
        est.warnings.append(
            f"does not fit: {est.memory_total_gib:.1f} GiB per rank needed, "
            f"{capacity:.1f} GiB usable on {device.name}"
        )
    for phase, hidden in est.overlapped.items():
        if not hidden:
            need = est.min_tokens_per_rank_for_overlap[phase]
            est.warnings.append(
                f"{phase}: communication exposed ({1e3 * est.step_transfer_s[phase]:.2f} ms "
                f"transfer vs {1e3 * est.step_compute_s[phase]:.2f} ms compute per step); "
                f"needs >= {need} tokens per rank (has {n})"
            )
    return est


def min_tokens_for_overlap(
    w: Workload, device: Device, link: Link, phase: str, ranks_on_host: int = 1
) -> int:
    """Smallest tokens per rank n with compute(n) >= transfer(n) for an off-diagonal step.

    Compute grows as n^2 and transfer as n (plus latency), so the condition holds from one
    threshold on; found by bisection on the same step model `estimate` uses.
    """
    kind = step_kinds(w, 2)[-1]
    b = DTYPE_BYTES[w.dtype]
    kv_per_token = 2 * w.batch * w.kv_heads * w.head_dim * b
    per_token = kv_per_token if phase == "forward" else kv_per_token * (1 + 4 / b)
    hops = 1 if phase == "forward" else 2

    def hidden(n: int) -> bool:
        fwd, bwd = device.block_time(
            kind, n, dtype=w.dtype, batch=w.batch, heads=w.heads, head_dim=w.head_dim,
            ranks_on_host=ranks_on_host,
        )  # fmt: skip
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


def longest_sequence(w: Workload, ranks: int, device: Device, ranks_on_host: int = 1) -> int:
    """The largest total N (a multiple of 2P) whose per-rank memory fits the device."""
    capacity = usable_gib(device, ranks_on_host) * GIB
    unit = 2 * ranks

    def fits(seq: int) -> bool:
        probe = Workload(**{**asdict(w), "seq_len": seq, "model": w.model})
        return sum(memory_per_rank(probe, ranks).values()) <= capacity

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


def fewest_ranks(w: Workload, device: Device, limit: int = 1 << 16) -> int | None:
    """The fewest ranks whose per-rank memory fits the sequence (None: not even ``limit``)."""
    capacity = usable_gib(device) * GIB

    def fits(p: int) -> bool:
        return sum(memory_per_rank(w, p).values()) <= capacity

    if not fits(limit):
        return None
    lo, hi = 0, limit  # memory falls as P grows: binary search for the first that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
