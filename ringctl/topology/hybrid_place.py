"""Place a hybrid job: Ulysses groups inside NVLink domains, rings of groups across them.

``ringattn.hybrid_attention`` runs an all-to-all inside each group of U consecutive ranks and U
rings across the groups (ring u links member u of every group, all U at once). So:

* the ranks keep the flat placement's order (`placement.py`): nodes in switch order (a
  depth-first walk, so the rings of groups cross switches as few times as the flat ring), each
  node's GPUs in its best path. A group of whole nodes is then simply a node (or consecutive
  nodes of one NVLink block), and a worker that ignores the groups still runs a good flat ring;
* when a node holds several groups (U below its GPU count), its GPUs are split into groups
  whose worst pair is best (`ulysses.partition_cliques`: the all-to-all's pace), the group
  whose members receive best from the network first and the one that sends best last: those
  are the members whose ring hops enter and leave the node;
* every rank of a group that borders another domain sends (and receives) over the network at
  once, so each takes its own nearest NIC, balanced over equally near ones (`assign_nics`),
  not the flat path's entry/exit choice; member u of identical nodes is the same GPU, so the
  ring u of groups stays on one rail. Ranks sharing a NIC split its rate (`Hop.shared`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from ..errors import UserError
from .gdr import GDR, GdrPolicy, end_gbps
from .groups import Layout, choose_layout
from .links import link_gbps, nic_path_rank
from .model import NodeTopology
from .placement import (
    NodeCache,
    PlacedNode,
    assign_nics,
    assumption_notes,
    c2c_note,
    gpu_weights,
    nic_name_notes,
    node_dict,
    nvlink_gbps,
    prepare_nodes,
    rank_entries,
    ring_hop,
    ring_span,
    share_nics,
)
from .plan import Hop, RingGroup, RingOfGroups, RingPlan, UlyssesGroups
from .slurm import SwitchTopology
from .ulysses import Domain, choose_degree, domain_runs, partition_cliques

__all__ = ["plan_hybrid"]


def plan_hybrid(
    nodes: Sequence[NodeTopology],
    switch_topology: SwitchTopology | None = None,
    ranks_per_node: int | None = None,
    bandwidths: Mapping[str, float] | None = None,
    *,
    ulysses: int | str,
    heads: int | None = None,
    kv_heads: int | None = None,
    gdr: GdrPolicy | None = None,
    nvlink_blocks: bool = False,
) -> RingPlan:
    """A hybrid plan: `ulysses` is "auto" (needs `heads`) or the degree U. The plan's
    `ulysses` and `ring_of_groups` hold both groups; UserError when U cannot be placed."""
    table, policy, ordered, paths, counts, blocks = prepare_nodes(
        nodes, ranks_per_node, switch_topology, bandwidths, gdr, nvlink_blocks
    )
    names = [n.name for n in ordered]
    domains = domain_runs(names, counts, blocks)
    flat = choose_layout(counts, names, paths, None, blocks)
    base = _flat_nodes(ordered, counts, flat.roles, table, policy)
    degree, reason = choose_degree(
        ulysses, domains, heads, kv_heads, lambda u: _not_nvlink(ordered, base, u)
    )
    placed = _place_nodes(ordered, base, degree, table, policy)
    world = sum(counts)
    layout = Layout(list(range(len(ordered))), flat.roles, world, "ulysses")
    ring, where = rank_entries(ordered, layout, placed, policy)
    context = (ring, where, ordered, placed, paths, blocks, table, policy)
    given_net = any(k.upper() == "NET" for k in (bandwidths or {}))
    flat_hops = _ring_hops([list(range(world))], context, given_net)
    rings = [list(range(u, world, degree)) for u in range(degree)]
    rog_hops = _ring_hops(rings, context, given_net)
    bottleneck = _slowest(flat_hops)
    span = ring_span(names, paths, dict(zip(names, blocks, strict=True)))
    groups = [RingGroup(0, list(range(world)), bottleneck, names, span)]
    ulysses_groups = UlyssesGroups(
        degree,
        [list(range(s, s + degree)) for s in range(0, world, degree)],
        reason,
        _inside(ring, where, ordered, placed, domains, degree, table),
        heads,
        kv_heads if kv_heads is not None or heads is None else heads,
    )
    chosen = _chosen_nics(ring, where, placed)
    return RingPlan(
        ring=ring,
        hops=flat_hops,
        bottleneck=bottleneck,
        nodes=[node_dict(n, paths[n.name], chosen.get(n.name, {})) for n in ordered],
        bandwidths=table,
        groups=groups,
        ring_size=world,
        gdr={"level": policy.modelled_level, "read": policy.read},
        assumptions=_notes(flat_hops + rog_hops, ordered, table, policy, given_net, heads),
        ulysses=ulysses_groups,
        ring_of_groups=RingOfGroups(world // degree, rings, rog_hops, _slowest(rog_hops)),
    )


def _chosen_nics(ring, where, placed) -> dict[str, dict[int, int | None]]:
    """node -> GPU position -> the NIC its rank uses (for the plan's node records)."""
    chosen: dict[str, dict[int, int | None]] = {}
    for e, (i, local) in zip(ring, where, strict=True):
        if (pos := placed[i].positions[local]) is not None:
            chosen.setdefault(e.node, {})[pos] = placed[i].nics[local]
    return chosen


def _notes(hops, ordered, table, policy, given_net: bool, heads: int | None) -> list[str]:
    notes = assumption_notes(hops, table, given_net)
    notes += c2c_note(ordered, policy, any(h.link == "NET" for h in hops))
    notes += nic_name_notes(ordered)
    if heads is None:
        notes.append(
            "heads not given: the Ulysses degree was not checked against the model "
            "(--heads, --kv-heads)"
        )
    return notes


def _slowest(hops: list[Hop]) -> Hop | None:
    return min(hops, key=lambda h: h.gbps) if hops else None


def _ring_hops(rings: list[list[int]], context, given_net: bool) -> list[Hop]:
    """The sends of rings that run at the same time (NIC sharing among all of them);
    `Hop.group` is the ring's index."""
    hops = []
    for index, members in enumerate(rings):
        if len(members) < 2:
            continue
        for a, b in zip(members, members[1:] + members[:1], strict=True):
            hop = ring_hop(a, b, *context)
            hop.group = index
            if hop.rate_source == "assumed" and given_net:
                hop.rate_source = "given"
            hops.append(hop)
    share_nics(hops, context[1])
    return hops


def _layout_key(node: NodeTopology, *extra) -> tuple:
    return (
        tuple(map(tuple, node.gpu_links)),
        tuple(map(tuple, node.gpu_nic_links)),
        tuple((n.usable, n.rate_gbps) for n in node.nics),
        *extra,
    )


def _flat_nodes(ordered, counts, roles, table, policy) -> dict[int, PlacedNode]:
    """Each node's flat-ring placement (its GPUs in path order); identical nodes once."""
    cache = NodeCache(table, policy, sum(counts))
    return {i: cache.place(node, counts[i], roles[i]) for i, node in enumerate(ordered)}


def _splits_node(count: int, degree: int) -> bool:
    """Whether a node of `count` ranks holds several whole groups (else its ranks belong to
    one group, or to groups that continue on the next node of an NVLink block)."""
    return degree < count and count % degree == 0


def _not_nvlink(ordered, base: dict[int, PlacedNode], degree: int) -> str | None:
    """Why groups of `degree` would have a pair inside a node that is not NVLink, or None."""
    seen: set[tuple] = set()
    for i, node in enumerate(ordered):
        positions = base[i].positions
        key = _layout_key(node, tuple(positions), degree)
        if not node.gpus or key in seen:
            continue
        seen.add(key)
        if _splits_node(len(positions), degree):
            gpus = range(len(node.gpus))
            nv = [[float(node.gpu_links[a][b].startswith("NV")) for b in gpus] for a in gpus]
            groups = partition_cliques(nv, positions, degree)  # all NVLink if any split is
        else:
            groups = [positions]
        slow = [
            node.gpu_links[a][b]
            for g in groups
            for a, b in itertools.combinations(g, 2)
            if not node.gpu_links[a][b].startswith("NV")
        ]
        if slow:
            return f"groups of {degree} on node {node.name} would have a {slow[0]} pair, not NVLink"
    return None


def _place_nodes(ordered, base, degree, table, policy) -> dict[int, PlacedNode]:
    """Each node's ranks: the flat path, regrouped when the node holds several groups; NICs
    spread over the ranks that cross the network at once. Identical nodes are placed once."""
    memo: dict[tuple, PlacedNode] = {}
    out = {}
    for i, node in enumerate(ordered):
        key = _layout_key(node, tuple(base[i].positions))
        if key not in memo:
            memo[key] = _place_node(node, base[i], degree, table, policy)
        out[i] = memo[key]
    return out


def _place_node(node, base: PlacedNode, degree: int, table, policy) -> PlacedNode:
    if not node.gpus:
        return base
    positions, count = list(base.positions), len(base.positions)
    if not _splits_node(count, degree):  # every rank sends and receives
        return PlacedNode(positions, _balanced_nics(node, positions, None, policy, table), {}, {})
    positions = groups_in_node(node, positions, degree, table, policy)
    nearest = assign_nics(node)
    nics = [nearest[p] for p in positions]
    first, last = slice(0, degree), slice(count - degree, count)
    nics[first] = _balanced_nics(node, positions[first], False, policy, table)
    nics[last] = _balanced_nics(node, positions[last], True, policy, table)
    return PlacedNode(positions, nics, {}, {})


def _balanced_nics(node, gpus: list[int], send: bool | None, policy, table) -> list[int | None]:
    """A NIC for each of `gpus`, which all cross the network at once (`send`: True sends,
    False receives, None both). Ranks on one NIC share its rate, so, greedily, the (rank, NIC)
    pair that leaves that NIC's slowest user fastest goes next; then GPUDirect, the nearer
    path, the earlier rank, the lower index. Usually one NIC per rank: rail by rail."""
    directions = (send,) if send is not None else (True, False)
    rate: dict[tuple[int, int], tuple[float, bool]] = {}
    for at, p in enumerate(gpus):
        for j, nic in enumerate(node.nics):
            if nic.usable:
                ends = [end_gbps(node, p, j, d, policy, table) for d in directions]
                rate[at, j] = (min(e.gbps for e in ends), any(e.mode != GDR for e in ends))
    users: dict[int, list[float]] = {}
    out: list[int | None] = [None] * len(gpus)
    left = set(range(len(gpus)))
    while left and rate:
        best_key, best = None, None
        for (at, j), (gbps, bounce) in rate.items():
            if at not in left:
                continue
            on_j = users.get(j, [])
            slowest = min([*on_j, gbps]) / (len(on_j) + 1)
            path = nic_path_rank(node.gpu_nic_links[gpus[at]][j])
            key = (-slowest, bounce, path, at, j)
            if best_key is None or key < best_key:
                best_key, best = key, (at, j)
        at, j = best
        users.setdefault(j, []).append(rate[at, j][0])
        out[at] = j
        left.discard(at)
    return out


def groups_in_node(node, positions: list[int], degree: int, table, policy) -> list[int]:
    """The node's GPUs as groups of `degree` with the best worst pair, in flat-path order,
    the best receiving group first and the best sending group last."""
    along = {p: i for i, p in enumerate(positions)}
    groups = partition_cliques(gpu_weights(node, table), positions, degree)
    groups = sorted((sorted(g, key=along.get) for g in groups), key=lambda g: along[g[0]])
    nearest = assign_nics(node)

    def worst_end(group: list[int], send: bool) -> float:
        rates = [
            end_gbps(node, p, nearest[p], send, policy, table).gbps
            if nearest[p] is not None
            else table["NET"]
            for p in group
        ]
        return min(rates)

    entry = max(groups, key=lambda g: worst_end(g, False))  # first best: stable
    rest = [g for g in groups if g is not entry]
    exit_ = max(reversed(rest), key=lambda g: worst_end(g, True))  # last best
    middle = [g for g in rest if g is not exit_]
    return [p for g in [entry, *middle, exit_] for p in g]


def _pair_link(a, b, where, ordered, placed, table) -> tuple[str, float]:
    (ia, la), (ib, lb) = where[a], where[b]
    pa, pb = placed[ia].positions[la], placed[ib].positions[lb]
    if ia == ib:
        link = ordered[ia].gpu_links[pa][pb] if pa is not None else "SHM"
        return link, link_gbps(link, table)
    ends = [
        nvlink_gbps(ordered[i], p, table) if p is not None else table["MNNVL"]
        for i, p in ((ia, pa), (ib, pb))
    ]
    return "MNNVL", min(ends)


def _inside(ring, where, ordered, placed, domains: list[Domain], degree, table) -> list[dict]:
    """Per Ulysses group: its domain, nodes and slowest pair (the all-to-all's pace)."""
    domain_of = {i: d for d in domains for i in d.nodes}
    out = []
    for start in range(0, len(ring), degree):
        members = list(range(start, start + degree))
        doms = {domain_of[where[r][0]].name for r in members}
        if len(doms) != 1:  # the degree check makes this impossible; never write such a plan
            raise UserError(f"Ulysses group of ranks {start}-{start + degree - 1} spans {doms}")
        pairs = [
            _pair_link(a, b, where, ordered, placed, table)
            for a, b in itertools.combinations(members, 2)
        ]
        gbps = min(p[1] for p in pairs) if pairs else None
        link = "+".join(dict.fromkeys(k for k, r in pairs if r == gbps)) if pairs else None
        out.append(
            {
                "domain": doms.pop(),
                "nodes": list(dict.fromkeys(ring[r].node for r in members)),
                "link": link,
                "gbps": gbps,
            }
        )
    return out
