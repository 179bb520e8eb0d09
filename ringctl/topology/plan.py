"""The placement: the one file the job's workers read to learn their rank, GPU, NIC and ring.

Contract with the worker (keys never renamed, only added to; version stays 1):

    {"version": 1,
     "ring":  [{"rank", "node", "local_rank", "gpu", "nic", "numa", "env", "group", ...}, ...],
     "hops":  [{"src", "dst", "link", "gbps", "src_end", "dst_end", "rate_source", ...}, ...],
     "bottleneck": {"src", "dst", "link", "gbps", ...} or null,
     "nodes": [{"name", "switch", "gpus", "nics", ...}, ...],
     "ring_size": N,
     "groups": [{"index", "ranks", "bottleneck", "nodes", "span"}, ...],
     "gdr": {"level": "PXB", "read": "auto"},
     "assumptions": ["..."]}

`ring` is in placement order and `rank` equals the position. A worker finds its entry by
(node name, SLURM_LOCALID) and uses `rank` as its torch rank.

Rings of rings (added, optional when reading): `ring_size` N splits the W ranks into W/N rings
of N *consecutive* ranks; `groups[g].ranks` lists ring g's ranks in ring order (rank r sends to
the next one of its group, the last one to the first), `ring[r].group` is r's group, and
`groups[g].bottleneck` is that ring's slowest hop (null for a one-rank ring). The top-level
`bottleneck` is the worst ring's. `span` says where the ring lives: "node", "nvlink domain
<name>", "leaf <name>" or "crosses switches". A plan written before groups existed reads as
one group of all ranks.

`hops` are every ring's hops, ring by ring, each ring's wrap-around hop included. Network hops
carry `src_end`/`dst_end`: "GDR" (GPUDirect RDMA between GPU and NIC), "host bounce" (staged
through host memory), "host" (a CPU rank) or "no NIC" (a GPU whose node lists no usable NIC);
MNNVL hops have "NVLink" at both ends; `rate_source` is "ibstat"
(port rates read), "given" (`--bandwidth NET=`) or "assumed" (no ibstat, the NET default);
`shared` counts the hops that share the busiest NIC direction of the hop (rates are divided
by it). A hop between nodes of one multi-node NVLink domain has link "MNNVL". `gdr` records the
GPUDirect settings the plan modelled, which it also pins in each rank's `env` (see gdr.py);
`assumptions` lists what the figures rest on that no input said. Bandwidths are nominal Gbit/s
(see `links.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

__all__ = ["PLAN_VERSION", "Hop", "RankEntry", "RingGroup", "RingPlan", "load_plan"]

PLAN_VERSION = 1
COMPACT_ABOVE = 1024  # ranks; larger plans are written without indentation


@dataclass
class RankEntry:
    """One rank: where it runs and the environment it needs there."""

    rank: int
    node: str
    local_rank: int
    gpu: int | None = None
    nic: str | None = None
    numa: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    nic_port: int | None = None
    numa_affinity: str | None = None
    cpu_affinity: str | None = None
    group: int = 0


@dataclass
class Hop:
    """A send from rank `src` to rank `dst`, the next rank of its ring group."""

    src: int
    dst: int
    link: str
    gbps: float
    src_nic: str | None = None
    dst_nic: str | None = None
    crosses_switch: bool = False
    src_end: str | None = None  # "GDR" | "host bounce" | "host" | "no NIC" | "NVLink"
    dst_end: str | None = None
    rate_source: str | None = None  # "ibstat" | "given" | "assumed"; network hops only
    shared: int = 1
    group: int = 0


@dataclass
class RingGroup:
    """One ring of a rings-of-rings plan: its ranks in ring order and its slowest hop."""

    index: int
    ranks: list[int]
    bottleneck: Hop | None = None
    nodes: list[str] = field(default_factory=list)
    span: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bottleneck"] = asdict(self.bottleneck) if self.bottleneck else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RingGroup:
        low = data.get("bottleneck")
        return cls(
            index=int(data["index"]),
            ranks=[int(r) for r in data["ranks"]],
            bottleneck=Hop(**low) if low else None,
            nodes=list(data.get("nodes", [])),
            span=str(data.get("span", "")),
        )


@dataclass
class RingPlan:
    """The placed ring; `to_json()` / `from_json()` round-trip it exactly."""

    ring: list[RankEntry]
    hops: list[Hop]
    bottleneck: Hop | None
    nodes: list[dict[str, Any]]
    bandwidths: dict[str, float] = field(default_factory=dict)
    version: int = PLAN_VERSION
    groups: list[RingGroup] = field(default_factory=list)
    ring_size: int | None = None
    gdr: dict[str, str] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:  # one ring of every rank (plans written before groups existed)
            self.groups = [
                RingGroup(
                    0,
                    [e.rank for e in self.ring],
                    self.bottleneck,
                    list(dict.fromkeys(e.node for e in self.ring)),
                    "",
                )
            ]
        if self.ring_size is None:
            self.ring_size = len(self.ring)

    @property
    def world_size(self) -> int:
        return len(self.ring)

    def entry_for(self, node: str, local_rank: int) -> RankEntry:
        """The entry of the rank that runs as task `local_rank` (SLURM_LOCALID) on `node`."""
        for entry in self.ring:
            if entry.node == node and entry.local_rank == local_rank:
                return entry
        nodes = sorted({e.node for e in self.ring})
        raise UserError(
            f"the plan has no rank for node {node!r} local rank {local_rank} "
            f"(its nodes: {', '.join(nodes)})"
        )

    def switch_crossings(self) -> int:
        """How many hops go from one leaf switch (or block, ring) to another."""
        return sum(1 for h in self.hops if h.crosses_switch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            # vars() not asdict(): asdict deep-copies field by field, 10x slower at 32k ranks
            "ring": [{**vars(e), "env": dict(e.env)} for e in self.ring],
            "hops": [dict(vars(h)) for h in self.hops],
            "bottleneck": asdict(self.bottleneck) if self.bottleneck else None,
            "nodes": self.nodes,
            "bandwidths": self.bandwidths,
            "ring_size": self.ring_size,
            "groups": [g.to_dict() for g in self.groups],
            "gdr": self.gdr,
            "assumptions": self.assumptions,
        }

    def to_json(self, indent: int | None | str = "auto") -> str:
        """The plan file's text. "auto": indented for a reader up to COMPACT_ABOVE ranks,
        compact above (a 32,768-rank plan is then ~2.5x smaller and faster to write)."""
        if indent == "auto":
            indent = 2 if len(self.ring) <= COMPACT_ABOVE else None
        separators = (",", ":") if indent is None else None
        return json.dumps(self.to_dict(), indent=indent, separators=separators)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<plan>") -> RingPlan:
        """Check the contract, then build; a wrong plan fails here, not inside a worker."""
        try:
            if data.get("version") != PLAN_VERSION:
                raise UserError(f"{source}: expected plan version {PLAN_VERSION}")
            ring = [RankEntry(**e) for e in data["ring"]]
            hops = [Hop(**h) for h in data["hops"]]
            bottleneck = Hop(**data["bottleneck"]) if data.get("bottleneck") else None
            nodes = list(data["nodes"])
            groups = [RingGroup.from_dict(g) for g in data.get("groups") or []]
            ring_size = data.get("ring_size")
            extra = {
                "gdr": dict(data.get("gdr") or {}),
                "assumptions": [str(a) for a in data.get("assumptions") or []],
            }
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise UserError(f"{source}: not a ring plan ({err})") from None
        if [e.rank for e in ring] != list(range(len(ring))):
            raise UserError(f"{source}: ranks must be 0..{len(ring) - 1} in ring order")
        seen = {(e.node, e.local_rank) for e in ring}
        if len(seen) != len(ring):
            raise UserError(f"{source}: two ranks share a node and local rank")
        _check_groups(groups, ring, source)
        return cls(
            ring,
            hops,
            bottleneck,
            nodes,
            dict(data.get("bandwidths", {})),
            groups=groups,
            ring_size=ring_size,
            **extra,
        )

    @classmethod
    def from_json(cls, text: str, source: str = "<plan>") -> RingPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{source}:{err.lineno}: not JSON ({err.msg})") from None
        if not isinstance(data, dict):
            raise UserError(f"{source}:1: expected a JSON object")
        return cls.from_dict(data, source)


def _check_groups(groups: list[RingGroup], ring: list[RankEntry], source: str) -> None:
    """Groups, when given, must tile the ranks in consecutive runs of one size, in order."""
    if not groups:
        return
    flat = [r for g in groups for r in g.ranks]
    sizes = {len(g.ranks) for g in groups}
    if sorted(flat) != list(range(len(ring))) or len(sizes) != 1:
        raise UserError(f"{source}: groups must split ranks 0..{len(ring) - 1} into equal rings")
    for g in groups:
        if sorted(g.ranks) != list(range(min(g.ranks), min(g.ranks) + len(g.ranks))):
            raise UserError(f"{source}: group {g.index} is not a run of consecutive ranks")
        if any(ring[r].group != g.index for r in g.ranks):
            raise UserError(f"{source}: ring entries disagree with group {g.index}")


def load_plan(path: str | Path) -> RingPlan:
    """Read a placement file written by `ringctl topo -o placement.json`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"{path}: cannot read the plan ({err.strerror})") from None
    return RingPlan.from_json(text, str(path))
