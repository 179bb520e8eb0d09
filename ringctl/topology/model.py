"""What one node looks like once its tool outputs are parsed: GPUs, NICs and the links between.

Plain dataclasses so the placement code and the plan JSON can share them without carrying any
parser state along.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Port:
    """One HCA port as `ibstat` / `ibv_devinfo` report it."""

    number: int
    state: str = ""
    phys_state: str | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None

    @property
    def usable(self) -> bool:
        """Active logical state and, when reported, a physical link that is up."""
        state = self.state.upper()
        if not (state.startswith("ACTIVE") or state.startswith("PORT_ACTIVE")):
            return False
        if self.phys_state is None:
            return True
        return self.phys_state.upper().replace("_", "").startswith("LINKUP")


@dataclass
class Hca:
    """An RDMA adapter (`mlx5_0`) and its ports."""

    name: str
    ports: list[Port] = field(default_factory=list)

    def best_port(self) -> Port | None:
        """The fastest usable port, or None when every port is down."""
        usable = [p for p in self.ports if p.usable]
        if not usable:
            return None
        return max(usable, key=lambda p: (p.rate_gbps or 0.0, -p.number))


@dataclass
class Gpu:
    """One GPU row of `nvidia-smi topo -m` with its affinity columns (raw strings kept)."""

    index: int
    cpu_affinity: str | None = None
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None

    @property
    def numa(self) -> int | None:
        """The single NUMA node to bind to, or None when the affinity is a range, list or N/A."""
        value = self.numa_affinity
        return int(value) if value is not None and value.isdigit() else None


@dataclass
class Nic:
    """A NIC column of the matrix, joined with what ibstat says about it."""

    name: str
    label: str
    usable: bool = True
    why_unusable: str | None = None
    port: int | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None


@dataclass
class NodeTopology:
    """A node: its GPUs, its NICs and link tokens `gpu_links[i][j]`, `gpu_nic_links[i][k]`.

    A node with no GPU (a CPU-only cluster) has empty lists; it still takes part in the ring.
    """

    name: str
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    gpu_links: list[list[str]] = field(default_factory=list)
    gpu_nic_links: list[list[str]] = field(default_factory=list)
    cpu_count: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)
