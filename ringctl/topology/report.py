"""The readable form of a plan: the ring hop by hop, with link kinds, GPUDirect marks and the
bottleneck; with rings of rings, a line per ring with its bottleneck and the worst ring."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from .hostlist import HostlistError, compress
from .plan import Hop, RankEntry, RingPlan

__all__ = ["print_plan", "rank_label"]


def rank_label(entry: RankEntry) -> str:
    """`n1:GPU3 mlx5_3`, or `n1:cpu0` for a CPU rank."""
    where = f"GPU{entry.gpu}" if entry.gpu is not None else f"cpu{entry.local_rank}"
    return f"{entry.node}:{where}" + (f" {entry.nic}" if entry.nic else "")


def _gbps(value: float) -> str:
    return f"{value:g}"


def _ends(hop: Hop) -> str:
    """`GDR -> host bounce`: how the sending and the receiving rank reach their NICs."""
    if hop.link not in ("NET", "MNNVL"):
        return ""
    return f"{hop.src_end or '?'} -> {hop.dst_end or '?'}"


def _note(hop: Hop, is_low: bool) -> str:
    notes = ["bottleneck"] if is_low else []
    if hop.crosses_switch:
        notes.append("switch")
    if hop.rate_source == "assumed":
        notes.append("assumed rate")
    if hop.shared > 1:
        notes.append(f"NIC shared by {hop.shared}")
    return ", ".join(notes)


def _nodes_text(names: list[str]) -> str:
    try:
        return compress(names)
    except HostlistError:
        return ",".join(names)


def _title(plan: RingPlan) -> str:
    n_nodes = len(plan.nodes)
    where = f"over {n_nodes} node{'s' if n_nodes != 1 else ''}"
    if len(plan.groups) > 1:
        text = f"{len(plan.groups)} rings of {plan.ring_size} ranks ({plan.world_size} ranks) "
    else:
        text = f"Ring of {plan.world_size} rank{'s' if plan.world_size != 1 else ''} "
    text += where
    if n_nodes > 1:
        text += f", {plan.switch_crossings()} switch crossing(s)"
    return text


MAX_ROWS = 256  # hop and ring rows printed; larger plans show their slowest (JSON has all)
MAX_NODE_LINES = 64


def _hops_shown(plan: RingPlan) -> list[Hop]:
    """Every hop of a small plan; of a large one the hops between nodes, slowest first."""
    if len(plan.hops) <= MAX_ROWS:
        return plan.hops
    between = [h for h in plan.hops if plan.ring[h.src].node != plan.ring[h.dst].node]
    between = between or list(plan.hops)
    return sorted(between, key=lambda h: (h.gbps, h.src))[:MAX_ROWS]


def _print_nodes(plan: RingPlan, console: Console) -> None:
    """A line per node: its switch path, its ranks in ring order, its unusable NICs."""
    labels: dict[str, list[str]] = {}
    for e in plan.ring:
        labels.setdefault(e.node, []).append(rank_label(e).split(":", 1)[1])
    for node in plan.nodes[:MAX_NODE_LINES]:
        switch = " under " + " < ".join(node["switch_path"]) if node.get("switch_path") else ""
        down = [n["name"] for n in node["nics"] if not n["usable"]]
        extra = f"; unusable NICs: {', '.join(down)}" if down else ""
        order = " -> ".join(labels.get(node["name"], []))
        console.print(f"  {node['name']}{switch}: {order}{extra}", soft_wrap=True)
    if len(plan.nodes) > MAX_NODE_LINES:
        console.print(f"  ... and {len(plan.nodes) - MAX_NODE_LINES} more nodes")


def print_plan(plan: RingPlan, console: Console | None = None) -> None:
    """Print the hop table, a summary line per node and the bottleneck."""
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 160  # logs and pipes: no wrapping of the hop table
    console.print(_title(plan), soft_wrap=True)
    _print_nodes(plan, console)
    if not plan.hops:
        console.print("Every ring is one rank: nothing to send, no bottleneck.")
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in [("hop", "right"), ("from", "left"), ("to", "left")]:
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("link", no_wrap=True)
    table.add_column("Gbit/s", justify="right", no_wrap=True)
    table.add_column("send -> recv", no_wrap=True)
    table.add_column("", no_wrap=True)
    low = plan.bottleneck
    shown = _hops_shown(plan)
    for hop in shown:
        is_low = low is not None and (hop.src, hop.dst) == (low.src, low.dst)
        table.add_row(
            f"{hop.src}->{hop.dst}",
            rank_label(plan.ring[hop.src]),
            rank_label(plan.ring[hop.dst]),
            hop.link,
            _gbps(hop.gbps),
            _ends(hop),
            _note(hop, is_low),
            style="bold red" if is_low else None,
        )
    if len(shown) < len(plan.hops):
        table.caption = (
            f"{len(shown)} of {len(plan.hops)} hops: those between nodes, slowest first "
            "(the plan JSON has every hop)"
        )
    console.print(table)
    if len(plan.groups) > 1:
        _print_groups(plan, console)
    same = sum(1 for h in plan.hops if h.gbps == low.gbps)
    console.print(
        ("Worst ring's bottleneck" if len(plan.groups) > 1 else "Bottleneck")
        + f": {low.link} at {_gbps(low.gbps)} Gbit/s, hop {low.src}->{low.dst} "
        f"({rank_label(plan.ring[low.src])} -> {rank_label(plan.ring[low.dst])})"
        + (f"; {same} hops at that speed" if same > 1 else ""),
        soft_wrap=True,
    )
    _print_assumptions(plan, console)


def _print_groups(plan: RingPlan, console: Console) -> None:
    """One line per ring: its ranks, nodes, where it lives and its bottleneck."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for name, justify in [("ring", "right"), ("ranks", "left"), ("nodes", "left")]:
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("span", no_wrap=True)
    table.add_column("bottleneck", no_wrap=True)
    table.add_column("Gbit/s", justify="right", no_wrap=True)
    lows = [g.bottleneck.gbps for g in plan.groups if g.bottleneck]
    worst = min(lows) if lows else None
    groups = plan.groups
    if len(groups) > MAX_ROWS:
        groups = sorted(groups, key=lambda g: (g.bottleneck.gbps if g.bottleneck else 0, g.index))
        groups = groups[:MAX_ROWS]
        table.caption = f"the {MAX_ROWS} slowest of {len(plan.groups)} rings"
    for g in groups:
        low = g.bottleneck
        table.add_row(
            str(g.index),
            f"{g.ranks[0]}-{g.ranks[-1]}" if len(g.ranks) > 1 else str(g.ranks[0]),
            _nodes_text(g.nodes),
            g.span,
            f"{low.link} {low.src}->{low.dst}" if low else "(one rank)",
            _gbps(low.gbps) if low else "",
            style="bold red" if low and low.gbps == worst else None,
        )
    console.print(table)


def _print_assumptions(plan: RingPlan, console: Console) -> None:
    gdr = plan.gdr
    unpinned = any("NCCL_IB_HCA" in e.env and "NCCL_NET_GDR_LEVEL" not in e.env for e in plan.ring)
    if gdr and any(h.link == "NET" for h in plan.hops):
        console.print(
            f"GPUDirect RDMA modelled with NCCL_NET_GDR_LEVEL={gdr.get('level')}, "
            f"NCCL_NET_GDR_READ {gdr.get('read')}; pinned in each rank's env"
            + (" (the level left to NCCL on C2C nodes)" if unpinned else ""),
            soft_wrap=True,
        )
    for line in plan.assumptions:
        console.print(f"Assumed: {line}", soft_wrap=True)
