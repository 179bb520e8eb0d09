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

Hybrid plans (`ringctl topo --ulysses auto|N`; added, absent from other plans): the job runs
`ringattn.hybrid_attention`, an all-to-all inside each Ulysses group and rings across them.

    "ulysses": {"degree": U, "groups": [[0, .., U-1], [U, .., 2U-1], ...],
                "reason": "auto: the 8 ranks of one node (32 heads, 8 kv heads allow it)",
                "heads": H or null, "kv_heads": K or null,
                "inside": [{"domain", "nodes", "link", "gbps"}, ...]},
    "ring_of_groups": {"size": R, "rings": [[0, U, 2U, ...], [1, U+1, ...], ...],
                       "hops": [Hop, ...], "bottleneck": Hop or null}

`ulysses.groups[g]` is the g-th block of U consecutive ranks, always (the loader refuses
anything else): exactly the groups `ringattn.hybrid_groups(U)` builds, so a rank's hybrid rank
`ring_rank * U + ulysses_rank` is its plan rank. Every group sits inside one NVLink domain
(`inside[g].domain`: a node, or an NVLink block); `inside[g].link`/`gbps` is its slowest pair,
which paces the all-to-all (null for U = 1). `ring_of_groups.rings[u]` links the member u of
every group, in group order (R = W / U ranks; all U rings run at once), `hops` are those rings'
sends (`Hop.group` = u), `bottleneck` the slowest of them (null when R = 1). In a hybrid plan
the top-level `hops`, `bottleneck` and `groups` still describe one flat ring over the same
rank order, the ring a worker that ignores `ulysses` would run.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..bounded_read import read_regular
from ..errors import UserError, naming
from ..jsonsafe import whole_number
from .model import is_cpu_list
from .nodes import NODE_NAME

__all__ = [
    "PLAN_VERSION",
    "Hop",
    "RankEntry",
    "RingGroup",
    "RingOfGroups",
    "RingPlan",
    "UlyssesGroups",
    "load_plan",
    "parse_plan",
]

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
class UlyssesGroups:
    """A hybrid plan's Ulysses groups: consecutive blocks of `degree` ranks, one NVLink domain
    each, why that degree, and each group's slowest pair (`inside`)."""

    degree: int
    groups: list[list[int]]
    reason: str
    inside: list[dict[str, Any]] = field(default_factory=list)
    heads: int | None = None
    kv_heads: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UlyssesGroups:
        return cls(
            degree=int(data["degree"]),
            groups=[[int(r) for r in g] for g in data["groups"]],
            reason=str(data.get("reason", "")),
            inside=[dict(x) for x in data.get("inside") or []],
            heads=None if data.get("heads") is None else int(data["heads"]),
            kv_heads=None if data.get("kv_heads") is None else int(data["kv_heads"]),
        )


@dataclass
class RingOfGroups:
    """A hybrid plan's rings across the Ulysses groups: ring u links member u of each group."""

    size: int
    rings: list[list[int]]
    hops: list[Hop] = field(default_factory=list)
    bottleneck: Hop | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "rings": self.rings,
            "hops": [dict(vars(h)) for h in self.hops],
            "bottleneck": asdict(self.bottleneck) if self.bottleneck else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RingOfGroups:
        low = data.get("bottleneck")
        return cls(
            size=int(data["size"]),
            rings=[[int(r) for r in ring] for ring in data["rings"]],
            hops=[Hop(**h) for h in data.get("hops") or []],
            bottleneck=Hop(**low) if low else None,
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
    ulysses: UlyssesGroups | None = None
    ring_of_groups: RingOfGroups | None = None

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
        } | self._hybrid_dict()

    def _hybrid_dict(self) -> dict[str, Any]:
        """The hybrid keys, only in hybrid plans (other plans' files stay as they were)."""
        if self.ulysses is None:
            return {}
        rog = self.ring_of_groups
        return {"ulysses": asdict(self.ulysses), "ring_of_groups": rog.to_dict() if rog else None}

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
            if data.get("ulysses") is not None:
                extra["ulysses"] = UlyssesGroups.from_dict(data["ulysses"])
                rog = data.get("ring_of_groups")
                extra["ring_of_groups"] = RingOfGroups.from_dict(rog) if rog else None
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise UserError(f"{source}: not a ring plan ({err})") from None
        for index, entry in enumerate(ring):
            _check_entry(entry, f"{source}: ring[{index}]")
        if [e.rank for e in ring] != list(range(len(ring))):
            raise UserError(f"{source}: ranks must be 0..{len(ring) - 1} in ring order")
        seen = {(e.node, e.local_rank) for e in ring}
        if len(seen) != len(ring):
            raise UserError(f"{source}: two ranks share a node and local rank")
        _check_groups(groups, ring, source)
        if "ulysses" in extra:
            _check_hybrid(extra["ulysses"], extra["ring_of_groups"], len(ring), source)
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
        except RecursionError:  # every rank reads it: a traceback on each
            raise UserError(f"{source}: not JSON (nested too deeply)") from None
        if not isinstance(data, dict):
            raise UserError(f"{source}:1: expected a JSON object")
        return cls.from_dict(data, source)


# The variables a plan may set for its rank (what placement.py and gdr.py write), each
# value of a plain form: a worker applies them before torch and NCCL start, so a plan that
# set LD_PRELOAD, PYTHONPATH or NCCL_NET_PLUGIN ran code of whoever wrote placement.json.
PLAN_ENV = frozenset(
    {
        "CUDA_DEVICE_ORDER",
        "CUDA_VISIBLE_DEVICES",
        "NCCL_IB_HCA",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_NET_GDR_READ",
        "NCCL_P2P_PXN_LEVEL",
        "RINGCTL_NUMA_NODE",
        "RINGCTL_CPU_AFFINITY",
    }
)
_ENV_VALUE = re.compile(r"[A-Za-z0-9_.,:=-]{0,256}")
MAX_GPU_INDEX = 4096


def _plain_env_value(name: str, value: object) -> bool:
    """A value a worker may apply: plain characters up to 256, or for RINGCTL_CPU_AFFINITY
    a CPU list ``cpu_set`` takes (CPUs below 8,192, ranges forward, possibly longer). nvidia-smi
    prints a dual-socket host's interleaved CPUs one by one (0,2,4,...: 392 characters for 112
    CPUs); kept, not dropped, so a worker can still bind its rank to the GPU's CPUs."""
    if name == "RINGCTL_CPU_AFFINITY":
        return is_cpu_list(value)
    return isinstance(value, str) and _ENV_VALUE.fullmatch(value) is not None


def _check_entry(entry: RankEntry, where: str) -> None:
    """A rank's entry as a worker will use it: counts are ints (0.0 and False passed the
    order check, and reached init_process_group), a GPU index in range, the environment
    only PLAN_ENV's names with plain values."""
    for key in ("rank", "local_rank", "group"):
        if not whole_number(getattr(entry, key)):
            raise UserError(f"{where}.{key}: expected a whole number >= 0")
    for key in ("gpu", "numa", "nic_port"):
        value = getattr(entry, key)
        if value is not None and not whole_number(value, 0, MAX_GPU_INDEX):
            raise UserError(f"{where}.{key}: expected null or a whole number 0-{MAX_GPU_INDEX}")
    if not isinstance(entry.node, str) or not NODE_NAME.fullmatch(entry.node):
        raise UserError(f"{where}.node: not a host name")
    if not isinstance(entry.env, dict):
        raise UserError(f"{where}.env: expected a mapping of variables to values")
    for name, value in entry.env.items():
        if name not in PLAN_ENV:
            allowed = ", ".join(sorted(PLAN_ENV))
            raise UserError(f"{where}.env.{str(name)[:64]!r}: a placement sets only {allowed}")
        if not _plain_env_value(name, value):
            raise UserError(f"{where}.env.{name}: {str(value)[:64]!r} is not a plain value")


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


def _check_hybrid(
    ulysses: UlyssesGroups, rog: RingOfGroups | None, world: int, source: str
) -> None:
    """The groups must be what `ringattn.hybrid_groups(U)` builds over ranks 0..W-1: blocks of
    U consecutive ranks, and rings of the same member of every block."""
    u = ulysses.degree
    if u < 1 or world % u:
        raise UserError(f"{source}: ulysses.degree {u} does not divide the {world} ranks")
    if ulysses.groups != [list(range(s, s + u)) for s in range(0, world, u)]:
        raise UserError(
            f"{source}: ulysses.groups must be the blocks of {u} consecutive ranks 0..{world - 1}"
        )
    rings = [list(range(m, world, u)) for m in range(u)]
    if rog is None or rog.size != world // u or rog.rings != rings:
        raise UserError(
            f"{source}: ring_of_groups must hold {u} rings of {world // u} ranks, ring m "
            f"linking ranks m, m+{u}, ... (member m of every Ulysses group)"
        )


MAX_PLAN_BYTES = 256 << 20  # a 32,768-rank plan is ~10 MB written compact


def load_plan(path: str | Path) -> RingPlan:
    """Read a placement file written by `ringctl topo -o placement.json`: a regular file
    (every rank reads it before any timeout applies: a FIFO there hung the whole job, a link
    to /dev/zero filled its memory), UTF-8 JSON within MAX_PLAN_BYTES."""
    path = Path(path)
    try:
        data = read_regular(path, MAX_PLAN_BYTES)
    except ValueError as err:
        raise UserError(f"{path}: cannot read the plan ({naming(path, str(err))})") from None
    return parse_plan(data, str(path))


def parse_plan(data: bytes, source: str) -> RingPlan:
    """A plan file's bytes as `load_plan` takes them (the reader of every worker). `ringctl
    topo -o` passes its own output through it before writing, so a plan the workers would
    refuse is never written (a long CPU Affinity once made one that every rank refused)."""
    if len(data) > MAX_PLAN_BYTES:
        raise UserError(f"{source}: cannot read the plan (longer than {MAX_PLAN_BYTES} bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{source}: cannot read the plan ({source}: {err})") from None
    return RingPlan.from_json(text, source)
