"""Place the ring: order the nodes by switch, the GPUs inside each node by link, and give each
rank its NIC, NUMA node and environment.

In ring attention every rank sends its K/V block to the next rank at every step, so the ring
runs at the pace of its slowest hop. Hence, in this order:

* nodes under one leaf switch are neighbours in the ring (a depth-first walk of Slurm's tree),
  so the ring crosses switch boundaries the minimal number of times;
* inside a node, the GPUs form a path (a cycle when the ring is one node) with the best
  bottleneck, then the fewest hops at that bottleneck, then the most bandwidth (`search.py`);
  a path's ends are scored by their link to a usable NIC, so entry and exit GPUs are the ones
  closest (PIX/PXB) to a fast NIC;
* each GPU uses its nearest usable NIC (down or unlisted NICs are skipped), ties going to the
  faster port.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import UserError
from .links import link_gbps, merge_bandwidths, nic_path_rank
from .model import Nic, NodeTopology
from .plan import Hop, RankEntry, RingPlan
from .search import best_order
from .slurm import SwitchTopology

__all__ = ["assign_nics", "nic_for_gpu", "order_gpus", "order_nodes", "plan_ring"]


def assign_nics(node: NodeTopology) -> list[int | None]:
    """For each GPU (by position), the index in `node.nics` of its NIC, or None.

    Nearest usable NIC first (PIX < PXB < PHB < NODE < SYS), then the faster port, then the
    NIC fewer GPUs already use (so GPU0 and GPU1 sharing a switch with mlx5_0 and mlx5_1 get
    one each, as rail-optimised fabrics expect), then the lower index.
    """
    load = [0] * len(node.nics)
    out: list[int | None] = []
    for i in range(len(node.gpus)):
        best = None
        for j, nic in enumerate(node.nics):
            if not nic.usable:
                continue
            path = nic_path_rank(node.gpu_nic_links[i][j])
            key = (path, -(nic.rate_gbps or 0.0), load[j], j)
            if best is None or key < best:
                best = key
        out.append(None if best is None else best[3])
        if best is not None:
            load[best[3]] += 1
    return out


def nic_for_gpu(node: NodeTopology, gpu_pos: int) -> int | None:
    """Index in `node.nics` of the NIC the GPU at position `gpu_pos` should use, or None."""
    return assign_nics(node)[gpu_pos]


def _attach_gbps(node: NodeTopology, gpu_pos: int | None, table: Mapping[str, float]) -> float:
    """What a rank can push into the network: its NIC's rate, capped by the PCIe path to it."""
    nics = [(j, n) for j, n in enumerate(node.nics) if n.usable]
    if gpu_pos is None:  # a CPU rank: the node's fastest usable NIC
        rates = [n.rate_gbps or table["NET"] for _, n in nics]
        return max(rates) if rates else table["NET"]
    j = nic_for_gpu(node, gpu_pos)
    if j is None:
        return table["NET"]
    rate = node.nics[j].rate_gbps or table["NET"]
    return min(rate, link_gbps(node.gpu_nic_links[gpu_pos][j], table))


def _gpu_weights(node: NodeTopology, table: Mapping[str, float]) -> list[list[float]]:
    n = len(node.gpus)
    return [
        [0.0 if i == j else link_gbps(node.gpu_links[i][j], table) for j in range(n)]
        for i in range(n)
    ]


def order_gpus(
    node: NodeTopology,
    count: int | None = None,
    *,
    cycle: bool,
    bandwidths: Mapping[str, float] | None = None,
) -> list[int]:
    """Positions (into `node.gpus`) of `count` GPUs in ring order.

    `cycle=True`: the whole ring is this node, wrap-around included. Otherwise a path whose
    first and last GPU talk to the network, scored by their link to their NIC.
    """
    table = merge_bandwidths(bandwidths)
    w = _gpu_weights(node, table)
    if cycle:
        return best_order(w, count, cycle=True)
    attach = [_attach_gbps(node, i, table) for i in range(len(node.gpus))]
    return best_order(w, count, cycle=False, start_w=attach, end_w=attach)


def order_nodes(
    nodes: Sequence[NodeTopology], switches: SwitchTopology | None
) -> list[NodeTopology]:
    """Nodes in switch order (see SwitchTopology.node_order); unknown nodes last, as given."""
    if switches is None:
        return list(nodes)
    rank = {name: i for i, name in enumerate(switches.node_order())}
    return sorted(nodes, key=lambda n: rank.get(n.name, len(rank)))


def _switch_path(switches: SwitchTopology | None, node: str) -> list[str]:
    """[leaf, its parent, ..., top] for a node; empty when the node is not in the layout."""
    if switches is None:
        return []
    leaf = switches.leaf_of(node)
    path: list[str] = []
    while leaf is not None and leaf not in path:
        path.append(leaf)
        leaf = next((g.name for g in switches.groups.values() if path[-1] in g.children), None)
    return path


def _node_dict(node: NodeTopology, path: list[str]) -> dict:
    nics = node.nics
    gpus = []
    for i, g in enumerate(node.gpus):
        j = nic_for_gpu(node, i)
        gpus.append(
            {
                "index": g.index,
                "numa": g.numa,
                "numa_affinity": g.numa_affinity,
                "cpu_affinity": g.cpu_affinity,
                "nic": nics[j].name if j is not None else None,
            }
        )
    return {
        "name": node.name,
        "switch": path[0] if path else None,
        "switch_path": path,
        "cpu_count": node.cpu_count,
        "gpus": gpus,
        "nics": [
            {
                "name": n.name,
                "label": n.label,
                "usable": n.usable,
                "why_unusable": n.why_unusable,
                "port": n.port,
                "rate_gbps": n.rate_gbps,
                "link_layer": n.link_layer,
            }
            for n in nics
        ],
        "gpu_links": node.gpu_links,
        "gpu_nic_links": node.gpu_nic_links,
    }


def _env(nic: Nic | None, gpu_index: int | None, numa: int | None, cpus: str | None) -> dict:
    env: dict[str, str] = {}
    if gpu_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_index)
    if nic is not None:
        # '=' asks NCCL for an exact name: plain 'mlx5_1' would also match mlx5_10, mlx5_11.
        env["NCCL_IB_HCA"] = f"={nic.name}" + (f":{nic.port}" if nic.port else "")
    if numa is not None:
        env["RINGCTL_NUMA_NODE"] = str(numa)
    if cpus and cpus != "N/A":
        env["RINGCTL_CPU_AFFINITY"] = cpus
    return env


def plan_ring(
    nodes: Sequence[NodeTopology],
    switch_topology: SwitchTopology | None = None,
    ranks_per_node: int | None = None,
    bandwidths: Mapping[str, float] | None = None,
) -> RingPlan:
    """Place a ring over `nodes`: every GPU of every node, or `ranks_per_node` of them.

    Nodes without GPUs get `ranks_per_node` (default 1) CPU ranks with gpu null. Raises
    UserError when the request cannot be met (no node, more ranks than GPUs, a name twice).
    """
    if not nodes:
        raise UserError("no node to place the ring on")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UserError(f"node {dup} is given twice")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UserError("--ranks-per-node must be at least 1")
    try:
        table = merge_bandwidths(bandwidths)
    except ValueError as err:
        raise UserError(str(err)) from None

    ordered = order_nodes(nodes, switch_topology)
    single = len(ordered) == 1
    ring: list[RankEntry] = []
    where: list[tuple[NodeTopology, int | None]] = []  # (node, gpu position) per rank
    for node in ordered:
        if node.gpus:
            count = len(node.gpus) if ranks_per_node is None else ranks_per_node
            if count > len(node.gpus):
                raise UserError(
                    f"node {node.name} has {len(node.gpus)} GPUs, fewer than "
                    f"--ranks-per-node {count}"
                )
            positions: list[int | None] = list(
                order_gpus(node, count, cycle=single, bandwidths=table)
            )
        else:
            positions = [None] * (ranks_per_node or 1)
        for local, pos in enumerate(positions):
            nic = None
            if pos is not None:
                j = nic_for_gpu(node, pos)
                nic = node.nics[j] if j is not None else None
            elif node.nics:
                usable = [n for n in node.nics if n.usable]
                nic = max(usable, key=lambda n: n.rate_gbps or 0.0) if usable else None
            gpu = node.gpus[pos] if pos is not None else None
            ring.append(
                RankEntry(
                    rank=len(ring),
                    node=node.name,
                    local_rank=local,
                    gpu=gpu.index if gpu else None,
                    nic=nic.name if nic else None,
                    nic_port=nic.port if nic else None,
                    numa=gpu.numa if gpu else None,
                    numa_affinity=gpu.numa_affinity if gpu else None,
                    cpu_affinity=gpu.cpu_affinity if gpu else None,
                    env=_env(
                        nic,
                        gpu.index if gpu else None,
                        gpu.numa if gpu else None,
                        gpu.cpu_affinity if gpu else None,
                    ),
                )
            )
            where.append((node, pos))

    paths = {n.name: _switch_path(switch_topology, n.name) for n in ordered}
    hops: list[Hop] = []
    size = len(ring)
    for src in range(size if size > 1 else 0):
        dst = (src + 1) % size
        (a, pa), (b, pb) = where[src], where[dst]
        if a is b:
            link = a.gpu_links[pa][pb] if pa is not None else "SHM"
            hops.append(Hop(src, dst, link, link_gbps(link, table)))
            continue
        gbps = min(_attach_gbps(a, pa, table), _attach_gbps(b, pb, table))
        leaf_a = paths[a.name][0] if paths[a.name] else None
        leaf_b = paths[b.name][0] if paths[b.name] else None
        crosses = leaf_a != leaf_b
        hops.append(Hop(src, dst, "NET", gbps, ring[src].nic, ring[dst].nic, crosses))
    bottleneck = min(hops, key=lambda h: h.gbps) if hops else None
    return RingPlan(
        ring=ring,
        hops=hops,
        bottleneck=bottleneck,
        nodes=[_node_dict(n, paths[n.name]) for n in ordered],
        bandwidths=table,
    )
