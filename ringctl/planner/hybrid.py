"""Flat ring versus hybrid Ulysses x ring, on the same ranks, and which to run.

A hybrid layout with Ulysses degree U splits each node's (NVLink domain's) U ranks over heads
with one all-to-all, so the ring runs over ranks / U groups with N / (ranks / U) tokens per
step block and heads / U heads per rank. The FLOPs per rank are the same as the flat ring's;
what changes is where the bytes go:

* the ring's K/V block per step is (N / R) tokens x (kv / U) heads: the same bytes as the
  flat ring's (N / P) tokens x kv heads, but each step now has U times the compute behind it
  (a block of N / R queries against N / R keys, for heads / U heads), so the transfer hides
  from U times fewer tokens per rank, and the ring has U times fewer steps (latencies);
* the all-to-all moves (U-1)/U of q, k, v and the output (backward: their gradients) over
  NVLink on every layer, on the critical path.

So the hybrid wins where the flat ring's inter-node hop is exposed (few tokens per rank, slow
network) and loses the all-to-all's time where the flat ring already hides its transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringattn.geometry import ulysses_problem

from .cost import Estimate, Link, Workload, estimate, intra_link, net_link
from .devices import Device


@dataclass
class LayoutOption:
    name: str
    ulysses: int
    ring: int
    estimate: Estimate

    @property
    def seconds(self) -> float:
        est = self.estimate
        if est.model_total_s is not None:
            return est.model_total_s
        return est.total_s.get("forward+backward", est.total_s["forward"]) + est.all_to_all_s


def ulysses_degrees(w: Workload, ranks: int, per_node: int) -> list[int]:
    """Ulysses degrees the heads and the node allow: U divides one node's ranks (the group
    stays on its links) and passes ``cost.ulysses_problem`` (ranks, heads, K/V heads)."""
    return [
        u
        for u in range(2, min(per_node, ranks) + 1)
        if per_node % u == 0 and not ulysses_problem(u, ranks, w.heads, w.kv_heads)
    ]


def compare_layouts(
    w: Workload,
    ranks: int,
    device: Device,
    *,
    nodes: int,
    flat_link: Link,
    latency_s: float | None = None,
    degrees: list[int] | None = None,
) -> list[LayoutOption]:
    """The flat ring and each hybrid degree (default: the largest the node allows)."""
    per_node = max(1, ranks // max(1, nodes))
    intra, net = intra_link(device, latency_s), net_link(device, latency_s)
    flat = replace(w, ulysses=1)
    options = [
        LayoutOption(
            "flat ring",
            1,
            ranks,
            estimate(flat, ranks, device, flat_link, ranks_on_host=per_node, intra=intra, net=net),
        )
    ]
    allowed = ulysses_degrees(w, ranks, per_node)
    for u in degrees if degrees is not None else allowed[-1:]:
        if u not in allowed:
            raise ValueError(f"ulysses degree {u} not possible here (allowed: {allowed})")
        ring = ranks // u
        ring_link = net if ring > 1 and u == per_node and nodes > 1 else flat_link
        est = estimate(
            replace(w, ulysses=u),
            ranks,
            device,
            ring_link,
            ranks_on_host=per_node,
            intra=intra,
            net=net,
        )
        options.append(LayoutOption(f"hybrid {u}x{ring} (Ulysses x ring)", u, ring, est))
    return options


def recommend(options: list[LayoutOption], tolerance: float = 0.02) -> LayoutOption | None:
    """The fastest option that fits (None: none fits); the flat ring when within
    ``tolerance`` of it (one process group, no all-to-all)."""
    fitting = [o for o in options if o.estimate.fits]
    if not fitting:
        return None
    best = min(fitting, key=lambda o: o.seconds)
    flat = options[0]
    if flat in fitting and flat.seconds <= best.seconds * (1 + tolerance):
        return flat
    return best


def explain(flat: LayoutOption, hybrid: LayoutOption) -> str:
    """One sentence: why the two differ."""
    f, h = flat.estimate, hybrid.estimate
    a2a = h.all_to_all_s
    exposed_flat = any(not ok for ok in f.overlapped.values())
    exposed_h = any(not ok for ok in h.overlapped.values())
    ring_f = f.total_s.get("forward+backward", f.total_s["forward"])
    ring_h = h.total_s.get("forward+backward", h.total_s["forward"])
    parts = [
        f"ring attention {ring_f:.3g} s flat vs {ring_h:.3g} s hybrid",
        f"flat ring transfers {'exposed' if exposed_flat else 'hidden'} at "
        f"{f.tokens_per_rank:,} tokens per rank, hybrid ring's "
        f"{'exposed' if exposed_h else 'hidden'} at {h.tokens_per_rank * hybrid.ulysses:,} "
        "tokens per ring block",
    ]
    if a2a:
        parts.append(f"all-to-all adds {a2a:.3g} s")
    return "; ".join(parts)
