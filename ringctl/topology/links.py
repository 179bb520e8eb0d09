"""Link kinds and the nominal bandwidth table the placement ranks them by.

Every figure is in Gbit/s, one direction, which is also the unit of InfiniBand port rates
(`ibstat` prints `Rate: 200` for HDR), so intra-node and network hops compare directly. They
are nominal, not measured: what matters for placement is their order (NVLink > PIX > PXB > PHB
> NODE > SYS), and the bottleneck they name. Users with better numbers override any entry with
`--bandwidth KIND=GBPS` or `plan_ring(..., bandwidths={...})`.

| kind | Gbit/s | what it is (nvidia-smi legend)                  | basis                      |
|------|--------|-------------------------------------------------|----------------------------|
| NV   | 200    | per NVLink of a bonded set: NV12 = 2400         | 25 GB/s per link, one way  |
| PIX  | 200    | at most one PCIe bridge                         | PCIe 4.0 x16, ~25 GB/s     |
| PXB  | 180    | several PCIe bridges, no host bridge            | a chain of PCIe switches   |
| PHB  | 150    | through a PCIe host bridge (the CPU)            | the CPU's root complex     |
| NODE | 120    | between host bridges inside one NUMA node       |                            |
| SYS  | 80     | across the SMP link between sockets (UPI/xGMI)  | ~10 GB/s peer to peer      |
| NET  | 100    | between nodes when the port rate is unknown     | EDR InfiniBand (assumed)   |
| HOST | 200    | cap of a network end staged through host memory | PCIe 4.0 x16 to host memory|
| MNNVL| 3600   | NVLink between nodes of one NVLink domain       | NV18 at the NV figure      |
| SHM  | 400    | between two CPU-only ranks of one node          | shared memory              |

A network hop takes the slower of its two ends. An end that can use GPUDirect RDMA moves at its
NIC's port rate capped by the PCIe path from the GPU to that NIC; an end beyond NCCL's GDR
distance bounces through host memory: half its port rate, capped by HOST (see gdr.py). Without
`ibstat` the port rate is unknown and NET is *assumed*: the plan says so. MNNVL is used for a
hop between two nodes of one multi-node NVLink domain (GB200/GB300 NVL72) when a node's matrix
shows no NVLink to scale from; otherwise such a hop runs at the GPUs' own NVLink figure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = [
    "DEFAULT_BANDWIDTHS",
    "MAX_NVLINKS",
    "NIC_PATH_ORDER",
    "is_link_token",
    "link_gbps",
    "merge_bandwidths",
    "nic_path_rank",
    "normalise_token",
    "nvlink_count",
    "nvlink_problem",
]

DEFAULT_BANDWIDTHS: dict[str, float] = {
    "NV": 200.0,
    "PIX": 200.0,
    "PXB": 180.0,
    "PHB": 150.0,
    "NODE": 120.0,
    "SYS": 80.0,
    "NET": 100.0,
    "HOST": 200.0,
    "MNNVL": 3600.0,
    "SHM": 400.0,
}

# PCIe path kinds from a GPU to a NIC, nearest first.
NIC_PATH_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")

_NV = re.compile(r"^NV([0-9]+)$")  # ASCII digits only (\d would take "NV١٢" too)
# The most NVLinks one pair of GPUs can have: 18 on H100/B200 (through NVSwitch), 12 on A100;
# 64 leaves room for later parts while refusing what no machine prints (NV99999999999999999999
# would otherwise be read as 2e22 Gbit/s and win every placement).
MAX_NVLINKS = 64
# Drivers before ~384 printed SOC for what is now SYS.
_ALIASES = {"SOC": "SYS"}
_PCIE = set(NIC_PATH_ORDER)


def normalise_token(token: str) -> str:
    """`SOC` (old drivers) -> `SYS`; other valid tokens are returned unchanged."""
    return _ALIASES.get(token, token)


def is_link_token(token: str) -> bool:
    """Whether `token` is a cell nvidia-smi can print in its matrix (`X`, `NV<n>`, PCIe kinds)."""
    token = normalise_token(token)
    return token == "X" or token in _PCIE or bool(_NV.match(token))


def nvlink_count(token: str) -> int | None:
    """n of an `NV<n>` token (None for other tokens), whatever its size: see nvlink_problem."""
    m = _NV.match(normalise_token(token))
    return int(m.group(1)) if m else None


def nvlink_problem(token: str) -> str:
    """Why an `NV<n>` token cannot be a real link count ("" when it can, or is no NV token)."""
    count = nvlink_count(token)
    if count is None or 1 <= count <= MAX_NVLINKS:
        return ""
    return f"{token[:24]!r} is not a count of NVLinks between two GPUs (NV1..NV{MAX_NVLINKS})"


MAX_GBPS = 1e6  # a link's Gbit/s (NVLink 5 is 14,400 a GPU): a petabit is no typo's limit


def merge_bandwidths(overrides: Mapping[str, float] | None) -> dict[str, float]:
    """The default table with the user's entries on top; unknown kinds are refused."""
    table = dict(DEFAULT_BANDWIDTHS)
    for kind, value in (overrides or {}).items():
        key = kind.upper()
        if key not in table:
            raise ValueError(f"unknown link kind {kind!r}; known: {', '.join(table)}")
        if not (math.isfinite(value) and 0 < value <= MAX_GBPS):  # inf would win every
            raise ValueError(  # placement; 1e308 x an NVLink count overflowed to inf
                f"bandwidth of {kind} must be a positive number up to {MAX_GBPS:g} Gbit/s, "
                f"got {value}"
            )
        table[key] = float(value)
    return table


def link_gbps(token: str, table: Mapping[str, float]) -> float:
    """Nominal Gbit/s of a matrix token: `NV<n>` scales with n, the rest are table entries."""
    token = normalise_token(token)
    count = nvlink_count(token)
    if count is not None:
        if nvlink_problem(token):
            raise ValueError(nvlink_problem(token))
        return table["NV"] * count
    if token in table:
        return table[token]
    raise ValueError(f"no bandwidth for link kind {token!r}")


def nic_path_rank(token: str) -> int:
    """0 for PIX (nearest) up to 4 for SYS; used to pick each GPU's NIC."""
    token = normalise_token(token)
    try:
        return NIC_PATH_ORDER.index(token)
    except ValueError:
        return len(NIC_PATH_ORDER)
