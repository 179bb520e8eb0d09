"""Where the ring leaves a node: can each end of a network hop use GPUDirect RDMA to its NIC?

With GPUDirect RDMA (GDR) the NIC reads (send) or writes (receive) GPU memory directly; without
it NCCL stages the data through a host-memory buffer ("host bounce"): an extra copy, more
latency, and a rate capped by the host path. NCCL decides per GPU and NIC, and the facts used
here are taken from its source (NVIDIA/nccl, src/graph/paths.cc, `ncclTopoCheckGdr`, read at
commit 5067397c) and its environment-variable documentation (docs.nvidia.com/deeplearning/nccl,
"Environment Variables"):

* `NCCL_NET_GDR_LEVEL` is the largest GPU-to-NIC PCIe distance at which GDR is used. Its
  default is PXB (at most a chain of PCIe switches, no host bridge): PIX and PXB ends get GDR,
  PHB, NODE and SYS ends bounce through host memory. (On Grace systems, C2C paths get P2C;
  nvidia-smi does not print C2C, so such a node reads as a bounce here: the safe side.)
* `NCCL_NET_GDR_READ` governs the *send* side only (the NIC reading GPU memory). Its documented
  default is on for NVLink-based platforms and off otherwise; the source's automatic rule is
  "on for compute capability 8.0 and newer, else only when the GPU has an NVLink peer (or is
  the node's only GPU)". `nvidia-smi topo -m` does not print the compute capability, so `auto`
  here is the documented, NVLink-based rule; it can only under-estimate a send.
* The receive side (the NIC writing GPU memory) uses GDR whenever the distance allows it.

Because NCCL's automatic choices depend on things this planner cannot see (compute
capability, NCCL version), the plan *pins* the two settings it modelled in each rank's
environment (`NCCL_NET_GDR_LEVEL`, `NCCL_NET_GDR_READ`), so the real ring does what the table
says. One exception: on a coherent NVLink-C2C node (Grace with Hopper/Blackwell; its matrix
gives each GPU a numeric `GPU NUMA ID`) NCCL's default level is P2C, which pinning PXB would
lower; there the level is left to NCCL unless `--gdr-level` is given, the table's host-bounce
ends are a lower bound, and the plan says so.

The plan also sets `NCCL_P2P_PXN_LEVEL=0`: by default (2) NCCL may relay a send through
another GPU of the node to reach the NIC the peer prefers (PXN, `ncclTopoGetNetDev` in
src/graph/search.cc: "0: don't use PXN for P2P"), which would move this rank's traffic off the
NIC the plan chose; with it, `NCCL_IB_HCA` (one exact HCA and port) is the NIC NCCL uses.

Rates (nominal Gbit/s, see links.py): a GDR end moves at min(NIC port, PCIe path GPU-NIC); a
host-bounce end at min(BOUNCE_SHARE x NIC port, HOST, PCIe path). The data then crosses PCIe
twice per direction (GPU to a host buffer, host buffer to the NIC), which is why about half the
line rate is what such an end reaches (e.g. ~200 of 400 Gbit/s without GPUDirect, in
losslessnetwork.com's "NCCL and GPUDirect Configuration"); HOST (default 200, one PCIe 4.0 x16
link to host memory, `--bandwidth HOST=...`) caps it further. So a GPU two host bridges from
its NIC never scores as well as one behind the NIC's PCIe switch, whatever the port rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UserError
from ..text import is_ascii_number
from .links import link_gbps, normalise_token
from .model import NodeTopology

__all__ = [
    "GDR",
    "GDR_LEVELS",
    "GDR_READ_CHOICES",
    "HOST_BOUNCE",
    "GdrPolicy",
    "NicEnd",
    "best_nic",
    "end_gbps",
    "gdr_env",
    "is_c2c",
]

GDR = "GDR"
HOST_BOUNCE = "host bounce"
NO_NIC = "no NIC"  # the node's matrix lists no usable NIC: NCCL picks one we cannot see
# NCCL's path levels in nearest-first order; nvidia-smi's NODE is NCCL's PHB (same CPU).
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
_DISTANCE = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 3, "SYS": 4}
GDR_READ_CHOICES = ("auto", "on", "off")
BOUNCE_SHARE = 0.5  # of the port rate, for an end staged through host memory


@dataclass(frozen=True)
class GdrPolicy:
    """The GDR settings the plan models and pins: NCCL's defaults unless the user says."""

    level: str | None = None  # None: NCCL's default (PXB, or P2C on coherent C2C nodes)
    read: str = "auto"  # auto: on where the node's GPUs have NVLink (NCCL's documented rule)

    def __post_init__(self) -> None:
        if self.level is not None and self.level not in GDR_LEVELS:
            raise UserError(f"--gdr-level {self.level}: expected one of {', '.join(GDR_LEVELS)}")
        if self.read not in GDR_READ_CHOICES:
            raise UserError(f"--gdr-read {self.read}: expected one of auto, on, off")

    @property
    def modelled_level(self) -> str:
        """The level the rates are computed with (PXB when NCCL's default is meant)."""
        return self.level or "PXB"

    def reaches(self, path: str) -> bool:
        """Whether a GPU-NIC path of this kind is within the GDR distance."""
        return _DISTANCE.get(normalise_token(path), 99) <= GDR_LEVELS.index(self.modelled_level)

    def read_enabled(self, node: NodeTopology) -> bool:
        """Whether sends from this node's GPUs may read GPU memory directly."""
        if self.read != "auto":
            return self.read == "on"
        if len(node.gpus) == 1:
            return True
        return node.nvlinked


@dataclass(frozen=True)
class NicEnd:
    """One end of a network hop: the NIC it uses, how, and at what rate."""

    nic: int | None  # index in node.nics, None when the node has no usable NIC
    mode: str  # GDR, HOST_BOUNCE, NO_NIC, or "host" (a CPU rank: host memory anyway)
    gbps: float
    assumed: bool  # the NIC's port rate is unknown (no ibstat): NET from the table


def end_gbps(
    node: NodeTopology,
    gpu: int,
    nic: int,
    send: bool,
    policy: GdrPolicy,
    table: Mapping[str, float],
) -> NicEnd:
    """How GPU position `gpu` sends (or receives) through NIC `nic` of `node`."""
    path = node.gpu_nic_links[gpu][nic]
    port = node.nics[nic].rate_gbps
    rate = port if port else table["NET"]  # no rate, or ibstat's Rate: 0: assumed, and said
    direct = policy.reaches(path) and (not send or policy.read_enabled(node))
    cap = link_gbps(path, table)
    if direct:
        return NicEnd(nic, GDR, min(rate, cap), not port)
    return NicEnd(nic, HOST_BOUNCE, min(rate * BOUNCE_SHARE, table["HOST"], cap), not port)


def best_nic(
    node: NodeTopology,
    gpu: int,
    send: bool,
    policy: GdrPolicy,
    table: Mapping[str, float],
    avoid: int | None = None,
) -> NicEnd:
    """The usable NIC that gives GPU `gpu` the fastest end; GDR before bounce at equal rate,
    then not `avoid` (so a node's way in and way out use different NICs where it has several),
    then the nearer path, then the lower index. No usable NIC: an assumed NET end."""
    best, best_key = None, None
    for j, nic in enumerate(node.nics):
        if not nic.usable:
            continue
        end = end_gbps(node, gpu, j, send, policy, table)
        path = _DISTANCE.get(normalise_token(node.gpu_nic_links[gpu][j]), 99)
        key = (-end.gbps, end.mode != GDR, j == avoid, path, j)
        if best_key is None or key < best_key:
            best, best_key = end, key
    return best if best is not None else NicEnd(None, NO_NIC, table["NET"], True)


def is_c2c(node: NodeTopology) -> bool:
    """A coherent NVLink-C2C node: nvidia-smi gives its GPUs their own NUMA node."""
    return bool(node.gpus) and all(is_ascii_number(g.gpu_numa_id or "", 5) for g in node.gpus)


def gdr_env(policy: GdrPolicy, node: NodeTopology) -> dict[str, str]:
    """The NCCL settings that make NCCL do what the plan modelled for a rank with a NIC."""
    env = {}
    if policy.level is not None or not is_c2c(node):
        env["NCCL_NET_GDR_LEVEL"] = policy.modelled_level
    env["NCCL_NET_GDR_READ"] = "1" if policy.read_enabled(node) else "0"
    env["NCCL_P2P_PXN_LEVEL"] = "0"
    return env
