"""What one node looks like once its tool outputs are parsed: GPUs, NICs and the links between.

Plain dataclasses so the placement code and the plan JSON can share them without carrying any
parser state along.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from ..text import ascii_number

# An RDMA device's name as the kernel spells it (mlx5_0, bnxt_re1, irdma0; at most 64, the
# kernel's IB_DEVICE_NAME_MAX): a plan pins it in NCCL_IB_HCA, where ',' ':' '=' and blanks
# separate names, so a name holding one would select some other device.
NIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# nvidia-smi's CPU Affinity, a list of CPU numbers and ranges (ASCII digits). Up to
# MAX_CPU_LIST_CHARS long: a dual-socket host that numbers its CPUs interleaved lists every
# other CPU one by one (0,2,4,...,222 is 392 characters), and all 8,192 CPUs so listed take
# ~40,000; Linux takes 128 KiB in one environment variable.
CPU_LIST = re.compile(r"[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*")
MAX_CPU_LIST_CHARS = 65536
MAX_CPUS = 8192  # Linux numbers CPUs below this (CONFIG_NR_CPUS at most)


def cpu_set(text: str) -> set[int]:
    """The CPUs a ``CPU_LIST`` names ("0-27,56-83"); ValueError for anything else, a CPU of
    MAX_CPUS or more and a range that runs backwards ("5-3") included. Marked in one table:
    8,191 ranges of 0-99999 (a placement.json within its length bound) took each rank ~34 s
    of CPU as a set built range by range."""
    if len(text) > MAX_CPU_LIST_CHARS or not CPU_LIST.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not a CPU list")
    named = bytearray(MAX_CPUS)
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if not low <= high < MAX_CPUS:
            raise ValueError(f"{part!r} is not a range of CPUs below {MAX_CPUS}")
        named[low : high + 1] = bytes([1]) * (high + 1 - low)
    return {cpu for cpu, on in enumerate(named) if on}


def is_cpu_list(text: object) -> bool:
    """Does ``cpu_set`` take this?"""
    if not isinstance(text, str):
        return False
    try:
        cpu_set(text)
    except ValueError:
        return False
    return True


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
        return None if value is None else ascii_number(value, 5)


@dataclass
class Nic:
    """A NIC column of the matrix, joined with what ibstat says about it.

    `name_from` says how the name is known: "nvidia-smi" (its NIC Legend, or an old driver's
    column name), "ibstat" (an HCA only ibstat lists), "ibstat order" (a NICn column matched to
    ibstat's HCAs by order, no legend), "column label" (no legend, no ibstat listing as many
    HCAs: `name` is the column's NICn, which no device is called, so no plan may pin it in
    NCCL_IB_HCA) or "ibstat unplaced" (an HCA ibstat lists beside such columns: it is one of
    them, which one is unknown, so its distance from each GPU is too, and pinning it chose
    by index; NCCL, reading the PCI tree, chooses better)."""

    name: str
    label: str | None
    usable: bool = True
    why_unusable: str | None = None
    port: int | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None
    name_from: str = "nvidia-smi"

    @property
    def name_known(self) -> bool:
        """Whether `name` is a device's real name (one NCCL_IB_HCA can select)."""
        return self.name_from != "column label"

    @property
    def pinned(self) -> bool:
        """Whether a rank using this NIC names it in NCCL_IB_HCA (see `name_from`)."""
        return self.name_from not in ("column label", "ibstat unplaced")


@dataclass
class NodeTopology:
    """A node: its GPUs, its NICs and link tokens `gpu_links[i][j]`, `gpu_nic_links[i][k]`.

    A node with no GPU (a CPU-only cluster) has empty lists; it takes part in a ring of CPU
    nodes only (beside a GPU node it is refused: its nvidia-smi may have failed).
    """

    name: str
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    gpu_links: list[list[str]] = field(default_factory=list)
    gpu_nic_links: list[list[str]] = field(default_factory=list)
    cpu_count: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def nvlinked(self) -> bool:
        """Whether any two of its GPUs are joined by NVLink (a link token NV<n>)."""
        return any(t.startswith("NV") for row in self.gpu_links for t in row)

    @property
    def all_nvlinked(self) -> bool:
        """Whether every two of its GPUs are joined by NVLink (NVSwitch nodes, full meshes;
        not a node of bridged pairs, whose pairs meet over PCIe)."""
        n = len(self.gpu_links)
        return all(
            self.gpu_links[i][j].startswith("NV") for i in range(n) for j in range(n) if i != j
        )

    def without_gpus(self) -> NodeTopology:
        """The node as a CPU job (gloo) uses it: its NICs and CPUs, none of its GPUs, so a
        gloo job spanning GPU and CPU-only nodes is placed as one ring of CPU ranks."""
        return replace(self, gpus=[], gpu_links=[], gpu_nic_links=[])
