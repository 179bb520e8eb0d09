"""Place the ring: order the nodes by switch, the GPUs inside each node by link, cut the ranks
into rings of `ring_size`, and give each rank its NIC, NUMA node and environment.

In ring attention every rank sends its K/V block to the next rank of its ring at every step,
so a ring runs at the pace of its slowest hop. Hence, in this order:

* nodes under one leaf switch are neighbours (a depth-first walk of Slurm's tree), so the ring
  crosses switch boundaries the minimal number of times; with `ring_size` the rings are packed
  inside nodes, NVLink domains and leaves first (`groups.py`);
* inside a node, the GPUs form a path (a cycle when the ring is one node) with the best
  bottleneck, then the fewest hops at that bottleneck, then the most bandwidth (`search.py`);
  a path's first GPU receives from the network and its last one sends to it, so each end is
  scored by the rate it gets through its best NIC, GPUDirect RDMA or host bounce (`gdr.py`):
  the ring enters and leaves a node through the GPUs that sit next to a usable NIC;
* the exit GPU takes a different NIC from the entry GPU when an equally fast one exists; every
  other GPU uses its nearest usable NIC (down or unlisted NICs are skipped);
* ranks that send (or receive) through one NIC at once share its rate (`Hop.shared`).

Nodes with identical layouts are ordered once (`NodeCache`), which is what keeps 4,096 nodes
in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..errors import UserError
from ..text import cut
from .gdr import GdrPolicy, NicEnd, best_nic, end_gbps, gdr_env, is_c2c
from .groups import Layout, NodeRole, choose_layout, partition_cycles
from .links import link_gbps, merge_bandwidths, nic_path_rank
from .model import Nic, NodeTopology
from .plan import Hop, RankEntry, RingGroup, RingPlan
from .search import best_order
from .slurm import SwitchTopology

__all__ = [
    "MAX_NODE_GPUS",
    "assign_nics",
    "nic_for_gpu",
    "order_gpus",
    "order_nodes",
    "plan_ring",
]

# GPUs of one node that a plan places. No node built shows more than 16 in one nvidia-smi
# matrix (DGX-2, HGX-2); multi-node NVLink domains are several nodes. Above EXACT_LIMIT the
# search is a heuristic of O(k^3) per 2-opt pass and start: ~1 s for 64 GPUs of random links on
# a 2-core machine, 4 s at 96 and more past it, so a larger matrix (a generated or corrupt
# one) is refused in one line rather than left to run for minutes.
MAX_NODE_GPUS = 64


def assign_nics(node: NodeTopology) -> list[int | None]:
    """For each GPU (by position), the index in `node.nics` of its nearest NIC, or None.

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
    """Index in `node.nics` of the nearest NIC of the GPU at position `gpu_pos`, or None."""
    return assign_nics(node)[gpu_pos]


def gpu_weights(node: NodeTopology, table: Mapping[str, float]) -> list[list[float]]:
    n = len(node.gpus)
    return [
        [0.0 if i == j else link_gbps(node.gpu_links[i][j], table) for j in range(n)]
        for i in range(n)
    ]


def nvlink_gbps(node: NodeTopology, gpu: int, table: Mapping[str, float]) -> float:
    """What one GPU moves over NVLink to another node of its NVLink domain: its own fastest
    NVLink figure in the node's matrix, else the MNNVL default."""
    rates = [link_gbps(t, table) for t in node.gpu_links[gpu] if t.startswith("NV")]
    return max(rates) if rates else table["MNNVL"]


def _end_weights(node, kind: str, send: bool, policy, table) -> list[float]:
    if kind == "nvlink":
        return [nvlink_gbps(node, i, table) for i in range(len(node.gpus))]
    return [best_nic(node, i, send, policy, table).gbps for i in range(len(node.gpus))]


def order_gpus(
    node: NodeTopology,
    count: int | None = None,
    *,
    cycle: bool,
    bandwidths: Mapping[str, float] | None = None,
    gdr: GdrPolicy | None = None,
    entry: str = "net",
    exit: str = "net",
) -> list[int]:
    """Positions (into `node.gpus`) of `count` GPUs in ring order.

    `cycle=True`: the whole ring is this node, wrap-around included. Otherwise a path whose
    first GPU receives from the previous node and whose last GPU sends to the next one, over
    the network ("net", scored by GPUDirect reach to a NIC) or NVLink ("nvlink").
    """
    table = merge_bandwidths(bandwidths)
    w = gpu_weights(node, table)
    if cycle:
        return best_order(w, count, cycle=True)
    policy = gdr or GdrPolicy()
    start_w = _end_weights(node, entry, False, policy, table)
    end_w = _end_weights(node, exit, True, policy, table)
    return best_order(w, count, cycle=False, start_w=start_w, end_w=end_w)


def order_nodes(
    nodes: Sequence[NodeTopology], switches: SwitchTopology | None
) -> list[NodeTopology]:
    """Nodes in switch order (see SwitchTopology.node_order); unknown nodes last, as given."""
    if switches is None:
        return list(nodes)
    rank = {name: i for i, name in enumerate(switches.node_order())}
    return sorted(nodes, key=lambda n: rank.get(n.name, len(rank)))


@dataclass
class PlacedNode:
    """One node's share of the placement: GPU positions in ring order and each rank's NIC."""

    positions: list[int | None]  # GPU positions, or None per CPU rank
    nics: list[int | None]  # index into node.nics per rank
    send: dict[int, NicEnd]  # local rank -> its send end (ranks that leave the node)
    recv: dict[int, NicEnd]  # local rank -> its receive end (ranks that enter it)


class NodeCache:
    """Placement of a node, shared by every node with the same layout and role."""

    def __init__(self, table: Mapping[str, float], policy: GdrPolicy, size: int) -> None:
        self.table, self.policy, self.size = table, policy, size
        self.memo: dict[tuple, PlacedNode] = {}

    def place(self, node: NodeTopology, count: int, role: NodeRole) -> PlacedNode:
        key = (
            tuple(map(tuple, node.gpu_links)),
            tuple(map(tuple, node.gpu_nic_links)),
            tuple((n.usable, n.rate_gbps) for n in node.nics),
            count,
            role,
        )
        if key not in self.memo:
            self.memo[key] = self._place(node, count, role)
        return self.memo[key]

    def _place(self, node: NodeTopology, count: int, role: NodeRole) -> PlacedNode:
        if not node.gpus:
            return self._cpu(node, count)
        nearest = assign_nics(node)
        if role.mode == "path":
            pos = order_gpus(
                node,
                count,
                cycle=False,
                bandwidths=self.table,
                gdr=self.policy,
                entry=role.entry,
                exit=role.exit,
            )
        else:
            pos = order_gpus(node, count, cycle=True, bandwidths=self.table)
            if role.mode == "cycles":
                cycles = partition_cycles(gpu_weights(node, self.table), pos, self.size)
                pos = [p for c in cycles for p in c]
        nics = [nearest[p] for p in pos]
        placed = PlacedNode(list(pos), nics, {}, {})
        if role.mode == "path":
            self._ends(node, role, placed)
        return placed

    def _ends(self, node: NodeTopology, role: NodeRole, placed: PlacedNode) -> None:
        """NICs of the entry (first) and exit (last) rank of a path, GDR-aware."""
        first, last = 0, len(placed.positions) - 1
        p_in, p_out = placed.positions[first], placed.positions[last]
        args = (self.policy, self.table)
        recv = best_nic(node, p_in, False, *args) if role.entry == "net" else None
        if role.exit == "net":
            avoid = recv.nic if recv is not None else None
            send = best_nic(node, p_out, True, *args, avoid=avoid if last != first else None)
            placed.send[last] = send
            if send.nic is not None:
                placed.nics[last] = send.nic
        if recv is not None:
            if last == first and role.exit == "net" and placed.send[last].nic is not None:
                recv = end_gbps(node, p_in, placed.send[last].nic, False, *args)  # one HCA
            placed.recv[first] = recv
            if recv.nic is not None:
                placed.nics[first] = recv.nic

    def _cpu(self, node: NodeTopology, count: int) -> PlacedNode:
        usable = [j for j, n in enumerate(node.nics) if n.usable]
        j = max(usable, key=lambda k: node.nics[k].rate_gbps or 0.0) if usable else None
        rate = node.nics[j].rate_gbps if j is not None else None
        end = NicEnd(j, "host", rate or self.table["NET"], not rate)  # a CPU rank
        ends = {r: end for r in range(count)}
        return PlacedNode([None] * count, [j] * count, ends, dict(ends))


def pins_gpu(node: NodeTopology) -> bool:
    """Whether a rank of this node is pinned to its GPU (CUDA_VISIBLE_DEVICES: it sees that
    one only): where every two of the node's GPUs are joined by NVLink, or it has one. NCCL
    reaches a GPU the process cannot see through NVLink only (src/transport/p2p.cc: "we can
    still communicate with 'invisible' devices", when they share NVLink); a pinned rank of a
    PCIe node (L40S, H100 PCIe), or of one whose GPUs are bridged in pairs, sent every hop
    over PCIe through host memory where the plan priced a PCIe peer copy. There every GPU
    stays visible and the plan's index is the rank's CUDA ordinal (CUDA_DEVICE_ORDER=
    PCI_BUS_ID numbers them as nvidia-smi does; ``worker.cuda_index`` maps it through the
    job's own CUDA_VISIBLE_DEVICES where Slurm sets one)."""
    return len(node.gpus) == 1 or node.all_nvlinked


def _env(node: NodeTopology, nic: Nic | None, gpu, policy: GdrPolicy) -> dict[str, str]:
    env: dict[str, str] = {}
    if gpu is not None:  # nvidia-smi's index counts in PCI bus order; CUDA's, fastest first
        if pins_gpu(node):
            env["CUDA_VISIBLE_DEVICES"] = str(gpu.index)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if nic is not None and gpu is not None:
        # '=' asks NCCL for an exact name: plain 'mlx5_1' would also match mlx5_10, mlx5_11.
        # A NIC known only by its column label (NIC0) is no device's name: `=NIC0` matched no
        # HCA and NCCL fell back to sockets, so such a rank leaves the choice to NCCL; so
        # does one on an HCA the matrix does not place (Nic.name_from).
        if nic.pinned:
            env["NCCL_IB_HCA"] = f"={nic.name}" + (f":{nic.port}" if nic.port else "")
        env.update(gdr_env(policy, node))
    if gpu is not None and gpu.numa is not None:
        env["RINGCTL_NUMA_NODE"] = str(gpu.numa)
    if gpu is not None and gpu.cpu_affinity and gpu.cpu_affinity != "N/A":
        env["RINGCTL_CPU_AFFINITY"] = gpu.cpu_affinity
    return env


def node_dict(node: NodeTopology, path: list[str], chosen: dict[int, int | None]) -> dict:
    nearest = assign_nics(node)
    gpus = []
    for i, g in enumerate(node.gpus):
        j = chosen.get(i, nearest[i])
        gpus.append(
            {
                "index": g.index,
                "numa": g.numa,
                "numa_affinity": g.numa_affinity,
                "cpu_affinity": g.cpu_affinity,
                "nic": node.nics[j].name if j is not None else None,
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
            for n in node.nics
        ],
        "gpu_links": node.gpu_links,
        "gpu_nic_links": node.gpu_nic_links,
    }


def _check(nodes: Sequence[NodeTopology], ranks_per_node: int | None) -> None:
    if not nodes:
        raise UserError("no node to place the ring on")
    seen: set[str] = set()
    for n in nodes:
        if n.name in seen:
            raise UserError(f"node {n.name} is given twice")
        seen.add(n.name)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UserError("--ranks-per-node must be at least 1")
    with_gpus = [n for n in nodes if n.gpus]
    without = [n.name for n in nodes if not n.gpus]
    if with_gpus and without:  # a probe whose nvidia-smi failed, planned as CPU ranks, exit 0
        raise UserError(
            f"node {without[0]} has no GPU in its topology while node {with_gpus[0].name} has "
            f"{len(with_gpus[0].gpus)}: one ring cannot mix GPU and CPU ranks (see the "
            "node's probe: its nvidia-smi may have failed; fix it, or leave the node out; a CPU "
            "job places CPU ranks with --cpu, as the batch script does for a job asking no GPU or "
            "ring.dist_backend=gloo)"
        )
    for node in nodes:
        if len(node.gpus) > MAX_NODE_GPUS:
            raise UserError(
                f"node {node.name} has {len(node.gpus)} GPUs; at most {MAX_NODE_GPUS} per node "
                "are placed (a real node's nvidia-smi matrix holds 16 at most)"
            )
        if node.gpus and ranks_per_node is not None and ranks_per_node > len(node.gpus):
            raise UserError(
                f"node {node.name} has {len(node.gpus)} GPUs, fewer than "
                f"--ranks-per-node {ranks_per_node}"
            )


def one_fabric(nodes: Sequence[NodeTopology]) -> list[NodeTopology]:
    """The nodes with only the NICs of one link layer usable: NCCL cannot join an InfiniBand
    port to a RoCE (Ethernet) one, and each node picks its NICs by its own GPUs, so one node
    with its InfiniBand ports down planned hops from InfiniBand into Ethernet, exit 0. Of
    the layers every node with a known one has, the one whose slowest node's fastest port is
    the fastest (InfiniBand at a tie: a 100G InfiniBand storage card beside 400G RoCE rails
    must not take the ring); none: refused, naming each node's layers."""
    known = {n.name: got for n in nodes if (got := _layers(n))}
    if len(set().union(*known.values())) <= 1:
        return list(nodes)
    shared = set(LAYERS).intersection(*known.values())
    if not shared:
        said = "; ".join(f"node {name}: {'/'.join(sorted(got))}" for name, got in known.items())
        raise UserError(
            f"no link layer joins every node's usable NICs ({cut(said, 300)}): NCCL cannot "
            "join InfiniBand to RoCE; bring the ports up or leave a node out"
        )
    best = max(LAYERS, key=lambda lay: (lay in shared, _slowest_port(nodes, lay), lay == LAYERS[0]))
    return [_only_layer(n, best) for n in nodes]


LAYERS = ("infiniband", "ethernet")  # the link layers a ring's NICs are joined by


def _layer(nic: Nic) -> str | None:
    """The NIC's link layer, one of LAYERS (None: "Unknown", or none given)."""
    layer = (nic.link_layer or "").lower()
    return layer if layer in LAYERS else None


def _layers(node: NodeTopology) -> set[str]:
    """The known link layers of a node's usable NICs."""
    return {_layer(n) for n in node.nics if n.usable} - {None}


def _slowest_port(nodes: Sequence[NodeTopology], layer: str) -> float:
    """The fastest usable port of ``layer`` on the node where that is slowest."""
    rates = [
        max((n.rate_gbps or 0.0 for n in node.nics if n.usable and _layer(n) == layer), default=0)
        for node in nodes
        if _layers(node)
    ]
    return min(rates, default=0.0)


def _only_layer(node: NodeTopology, layer: str) -> NodeTopology:
    """The node with its usable NICs of the other known layer marked unusable, said why."""
    nics = [
        replace(nic, usable=False, why_unusable=f"{nic.link_layer}: the ring uses {layer}")
        if nic.usable and _layer(nic) not in (None, layer)
        else nic
        for nic in node.nics
    ]
    return replace(node, nics=nics)


def _domains(ordered, paths, switches, nvlink_blocks: bool) -> list[str | None]:
    """The multi-node NVLink domain of each node: its Slurm block, when blocks are NVLink."""
    if not nvlink_blocks or switches is None:
        return [None] * len(ordered)
    out = []
    for n in ordered:
        leaf = paths[n.name][0] if paths[n.name] else None
        group = switches.groups.get(leaf) if leaf else None
        out.append(leaf if group is not None and group.kind == "block" else None)
    return out


def prepare_nodes(nodes, ranks_per_node, switch_topology, bandwidths, gdr, nvlink_blocks):
    """What every placement starts from: (bandwidth table, GPUDirect policy, nodes in switch
    order, each node's switch path, its rank count, the NVLink domains). UserError for a
    request that cannot be met or a bad bandwidth override."""
    _check(nodes, ranks_per_node)
    try:
        table = merge_bandwidths(bandwidths)
    except ValueError as err:
        raise UserError(str(err)) from None
    ordered = order_nodes(nodes, switch_topology)
    paths = {
        n.name: switch_topology.switch_path(n.name) if switch_topology else [] for n in ordered
    }
    counts = [(ranks_per_node or len(n.gpus)) if n.gpus else (ranks_per_node or 1) for n in ordered]
    domains = _domains(ordered, paths, switch_topology, nvlink_blocks)
    if len(ordered) > 1 and (None in domains or len(set(domains)) > 1):  # hops leave a domain
        ordered = one_fabric(ordered)
    return table, gdr or GdrPolicy(), ordered, paths, counts, domains


def plan_ring(
    nodes: Sequence[NodeTopology],
    switch_topology: SwitchTopology | None = None,
    ranks_per_node: int | None = None,
    bandwidths: Mapping[str, float] | None = None,
    *,
    ring_size: int | None = None,
    gdr: GdrPolicy | None = None,
    nvlink_blocks: bool = False,
) -> RingPlan:
    """Place the ranks over `nodes`: every GPU of every node, or `ranks_per_node` of them, as
    one ring or as rings of `ring_size` consecutive ranks.

    Where no node has a GPU, each gets `ranks_per_node` (default 1) CPU ranks with gpu null.
    `nvlink_blocks`: Slurm blocks are multi-node NVLink domains (GB200/GB300 NVL72), so hops
    between nodes of one block are NVLink. Raises UserError when the request cannot be met.
    """
    table, policy, ordered, paths, counts, domains = prepare_nodes(
        nodes, ranks_per_node, switch_topology, bandwidths, gdr, nvlink_blocks
    )
    layout = choose_layout(counts, [n.name for n in ordered], paths, ring_size, domains)
    cache = NodeCache(table, policy, layout.ring_size)
    placed = {i: cache.place(ordered[i], counts[i], layout.roles[i]) for i in layout.sequence}
    ring, where = rank_entries(ordered, layout, placed, policy)
    given_net = any(k.upper() == "NET" for k in (bandwidths or {}))
    hops, groups = _rings(ring, where, ordered, layout, placed, paths, domains, table, policy)
    for h in hops:
        if h.rate_source == "assumed" and given_net:
            h.rate_source = "given"
    bottleneck = min(hops, key=lambda h: h.gbps) if hops else None
    chosen: dict[str, dict[int, int | None]] = {}
    for e, (i, local) in zip(ring, where, strict=True):
        pos = placed[i].positions[local]
        if pos is not None:
            chosen.setdefault(e.node, {})[pos] = placed[i].nics[local]
    node_dicts = [
        node_dict(ordered[i], paths[ordered[i].name], chosen.get(ordered[i].name, {}))
        for i in layout.sequence
    ]
    return RingPlan(
        ring=ring,
        hops=hops,
        bottleneck=bottleneck,
        nodes=node_dicts,
        bandwidths=table,
        groups=groups,
        ring_size=layout.ring_size,
        gdr={"level": policy.modelled_level, "read": policy.read},
        assumptions=assumption_notes(hops, table, given_net)
        + c2c_note(ordered, policy, any(h.link == "NET" for h in hops))
        + nic_name_notes(ordered),
    )


def rank_entries(ordered, layout: Layout, placed, policy) -> tuple[list[RankEntry], list]:
    ring: list[RankEntry] = []
    where: list[tuple[int, int]] = []  # (node index, local rank) per rank
    for i in layout.sequence:
        node, p = ordered[i], placed[i]
        for local, pos in enumerate(p.positions):
            j = p.nics[local]
            nic = node.nics[j] if j is not None else None
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
                    env=_env(node, nic, gpu, policy),
                    group=len(ring) // layout.ring_size,
                )
            )
            where.append((i, local))
    return ring, where


def _rings(ring, where, ordered, layout, placed, paths, domains, table, policy):
    """Every ring's hops (with NIC sharing applied) and the groups with their bottlenecks."""
    size = layout.ring_size
    pairs = []
    for start in range(0, len(ring) if size > 1 else 0, size):
        members = list(range(start, start + size))
        pairs += zip(members, members[1:] + members[:1], strict=True)
    context = (ring, where, ordered, placed, paths, domains, table, policy)
    hops = [ring_hop(a, b, *context) for a, b in pairs]
    share_nics(hops, where)
    by_group: dict[int, list[Hop]] = {}
    for h in hops:
        by_group.setdefault(h.group, []).append(h)
    domain_of = {n.name: domains[i] for i, n in enumerate(ordered)}
    groups = []
    for g, start in enumerate(range(0, len(ring), size)):
        mine = by_group.get(g, [])
        names = list(dict.fromkeys(ring[r].node for r in range(start, start + size)))
        groups.append(
            RingGroup(
                index=g,
                ranks=list(range(start, start + size)),
                bottleneck=min(mine, key=lambda h: h.gbps) if mine else None,
                nodes=names,
                span=ring_span(names, paths, domain_of),
            )
        )
    return hops, groups


def ring_hop(a, b, ring, where, ordered, placed, paths, domains, table, policy) -> Hop:
    (ia, la), (ib, lb) = where[a], where[b]
    na, nb = ordered[ia], ordered[ib]
    pa, pb = placed[ia].positions[la], placed[ib].positions[lb]
    group = ring[a].group
    if ia == ib:
        link = na.gpu_links[pa][pb] if pa is not None else "SHM"
        return Hop(a, b, link, link_gbps(link, table), group=group)
    leaf_a = paths[na.name][0] if paths[na.name] else None
    leaf_b = paths[nb.name][0] if paths[nb.name] else None
    crosses = leaf_a != leaf_b
    if domains[ia] is not None and domains[ia] == domains[ib]:
        gbps = min(
            nvlink_gbps(na, pa, table) if pa is not None else table["MNNVL"],
            nvlink_gbps(nb, pb, table) if pb is not None else table["MNNVL"],
        )
        return Hop(
            a,
            b,
            "MNNVL",
            gbps,
            crosses_switch=False,
            src_end="NVLink",
            dst_end="NVLink",
            group=group,
        )
    send = placed[ia].send.get(la) or _other_end(na, pa, placed[ia].nics[la], True, table, policy)
    recv = placed[ib].recv.get(lb) or _other_end(nb, pb, placed[ib].nics[lb], False, table, policy)
    source = "assumed" if send.assumed or recv.assumed else "ibstat"
    return Hop(
        a,
        b,
        "NET",
        min(send.gbps, recv.gbps),
        ring[a].nic,
        ring[b].nic,
        crosses,
        send.mode,
        recv.mode,
        source,
        1,
        group,
    )


def _other_end(node, pos, nic, send: bool, table, policy) -> NicEnd:
    """The end of a rank that is not a path end of its node (consecutive-rank rings)."""
    if pos is None or nic is None:
        rate = node.nics[nic].rate_gbps if nic is not None else None
        return NicEnd(nic, "host" if pos is None else "no NIC", rate or table["NET"], rate is None)
    return end_gbps(node, pos, nic, send, policy, table)


def share_nics(hops: list[Hop], where) -> None:
    """Ranks that send (receive) through one NIC at the same time split its rate."""
    users: dict[tuple, int] = {}
    keys = []
    for h in hops:
        if h.link != "NET":
            keys.append(None)
            continue
        k_out = ("out", where[h.src][0], h.src_nic) if h.src_nic else None
        k_in = ("in", where[h.dst][0], h.dst_nic) if h.dst_nic else None
        for k in (k_out, k_in):
            if k is not None:
                users[k] = users.get(k, 0) + 1
        keys.append((k_out, k_in))
    for h, ks in zip(hops, keys, strict=True):
        if ks is None:
            continue
        shared = max((users[k] for k in ks if k is not None), default=1)
        if shared > 1:
            h.shared, h.gbps = shared, h.gbps / shared


def ring_span(names, paths, domain_of) -> str:
    if len(names) == 1:
        return "node"
    doms = {domain_of[n] for n in names}
    if len(doms) == 1 and None not in doms:
        return f"nvlink domain {doms.pop()}"
    leaves = {paths[n][0] if paths[n] else None for n in names}
    if len(leaves) == 1 and None not in leaves:
        return f"leaf {leaves.pop()}"
    return "crosses switches" if any(paths[n] for n in names) else "network"


def c2c_note(ordered, policy: GdrPolicy, has_net: bool) -> list[str]:
    c2c = [n.name for n in ordered if is_c2c(n)]
    if not c2c or not has_net or policy.level is not None:
        return []
    return [
        f"{len(c2c)} node(s) with coherent NVLink-C2C GPUs (first {c2c[0]}): NCCL may use "
        "GPUDirect through C2C there (its default level P2C, left unpinned); their "
        "host-bounce ends are a lower bound"
    ]


def nic_name_notes(ordered: Sequence[NodeTopology]) -> list[str]:
    """What the plan assumed about NIC names no input gave: NICn columns matched to ibstat's
    HCAs by order, and NICs whose name is unknown (not pinned in NCCL_IB_HCA)."""
    notes = []
    for how, note in (
        (
            "ibstat order",
            "NIC columns matched to ibstat's HCAs by order, in natural order (mlx5_2 before "
            "mlx5_10; no NIC Legend in the nvidia-smi output): check that NICn is the n-th HCA, "
            "or capture the legend",
        ),
        (
            "column label",
            "NICs known only by their nvidia-smi column (no NIC Legend, no ibstat listing as "
            "many HCAs): NCCL_IB_HCA is not pinned for their ranks (NCCL chooses the HCA); give "
            "ibstat, or the legend",
        ),
        (
            "ibstat unplaced",
            "HCAs ibstat lists beside NIC columns it could not be matched to (no NIC Legend; "
            "another count): each GPU's distance to them is unknown (planned as SYS) and "
            "NCCL_IB_HCA is not pinned for their ranks (NCCL chooses the HCA); give the legend",
        ),
    ):
        nics = [
            f"{n.name}:{nic.label or nic.name}"
            for n in ordered
            for nic in n.nics
            if nic.name_from == how
        ]
        if nics:
            notes.append(f"{note} ({len(nics)} NIC(s), first {nics[0]})")
    return notes


def assumption_notes(hops: list[Hop], table, given_net: bool) -> list[str]:
    out = []
    if any(h.rate_source == "assumed" for h in hops):
        out.append(
            f"network port rate assumed {table['NET']:g} Gbit/s (no ibstat for some NIC): "
            "give ibstat, or --bandwidth NET=GBPS"
        )
    if any(h.src_end == "host bounce" or h.dst_end == "host bounce" for h in hops):
        out.append(
            "a host-bounce end moves at half its port rate, at most "
            f"HOST={table['HOST']:g} Gbit/s (nominal; --bandwidth HOST=GBPS)"
        )
    return out
