"""The placement plan: the one file the job's workers read to learn their rank, GPU and NIC.

Contract with the worker (keys never renamed, only added to):

    {"version": 1,
     "ring":  [{"rank", "node", "local_rank", "gpu", "nic", "numa", "env", ...}, ...],
     "hops":  [{"src", "dst", "link", "gbps", ...}, ...],
     "bottleneck": {"src", "dst", "link", "gbps", ...} or null,
     "nodes": [{"name", "switch", "gpus", "nics", ...}, ...]}

`ring` is in ring order and `rank` equals the position, so the engine's plain rank-order ring
*is* the placed ring. A worker finds its entry by (node name, SLURM_LOCALID) and uses `rank`
as its torch rank. `hops` include the wrap-around hop; a one-rank ring has no hop and a null
bottleneck. Bandwidths are nominal Gbit/s (see `links.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

__all__ = ["PLAN_VERSION", "Hop", "RankEntry", "RingPlan", "load_plan"]

PLAN_VERSION = 1


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


@dataclass
class Hop:
    """A send from rank `src` to rank `dst` = src + 1 (mod world size)."""

    src: int
    dst: int
    link: str
    gbps: float
    src_nic: str | None = None
    dst_nic: str | None = None
    crosses_switch: bool = False


@dataclass
class RingPlan:
    """The placed ring; `to_json()` / `from_json()` round-trip it exactly."""

    ring: list[RankEntry]
    hops: list[Hop]
    bottleneck: Hop | None
    nodes: list[dict[str, Any]]
    bandwidths: dict[str, float] = field(default_factory=dict)
    version: int = PLAN_VERSION

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
            "ring": [asdict(e) for e in self.ring],
            "hops": [asdict(h) for h in self.hops],
            "bottleneck": asdict(self.bottleneck) if self.bottleneck else None,
            "nodes": self.nodes,
            "bandwidths": self.bandwidths,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

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
        except (KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{source}: not a ring plan ({err})") from None
        if [e.rank for e in ring] != list(range(len(ring))):
            raise UserError(f"{source}: ranks must be 0..{len(ring) - 1} in ring order")
        seen = {(e.node, e.local_rank) for e in ring}
        if len(seen) != len(ring):
            raise UserError(f"{source}: two ranks share a node and local rank")
        return cls(ring, hops, bottleneck, nodes, dict(data.get("bandwidths", {})))

    @classmethod
    def from_json(cls, text: str, source: str = "<plan>") -> RingPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{source}:{err.lineno}: not JSON ({err.msg})") from None
        if not isinstance(data, dict):
            raise UserError(f"{source}:1: expected a JSON object")
        return cls.from_dict(data, source)


def load_plan(path: str | Path) -> RingPlan:
    """Read a plan file written by `ringctl topo -o plan.json`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"{path}: cannot read the plan ({err.strerror})") from None
    return RingPlan.from_json(text, str(path))
