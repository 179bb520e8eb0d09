"""The readable form of a plan: the ring hop by hop, with link kinds, GPUDirect marks and the
bottleneck; with rings of rings, a line per ring with its bottleneck and the worst ring; for a
hybrid plan, the Ulysses groups (where each sits, its slowest pair) and the ring across them,
a row per step from one group to the next (the slowest of the sends that cross there).

Node, NIC and switch names come from probe files written on the compute nodes and from Slurm's
topology: every line and cell is printed as plain text (`_say`, `_row`), so rich markup in a
name is shown, not applied, and control characters are escaped (`ringctl.terminal.visible`)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..terminal import console as terminal_console
from ..terminal import visible
from .hostlist import HostlistError, compress
from .plan import Hop, RankEntry, RingPlan

__all__ = ["print_plan", "rank_label"]


def _say(console: Console, line: str) -> None:
    """Print one line of the report as plain text, control characters escaped."""
    console.print(Text(visible(line)), soft_wrap=True)


def _row(table: Table, *cells: str, style: str | None = None) -> None:
    """Add a table row of plain-text cells, control characters escaped."""
    table.add_row(*(Text(visible(cell)) for cell in cells), style=style)


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
        _say(console, f"  {node['name']}{switch}: {order}{extra}")
    if len(plan.nodes) > MAX_NODE_LINES:
        _say(console, f"  ... and {len(plan.nodes) - MAX_NODE_LINES} more nodes")


def print_plan(plan: RingPlan, console: Console | None = None) -> None:
    """Print the hop table, a summary line per node and the bottleneck."""
    if console is None:
        console = terminal_console(highlight=False)
        if not console.is_terminal:
            console.width = 160  # logs and pipes: no wrapping of the hop table
    if plan.ulysses is not None:
        print_hybrid(plan, console)
        return
    _say(console, _title(plan))
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
        _row(
            table,
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
    _say(
        console,
        ("Worst ring's bottleneck" if len(plan.groups) > 1 else "Bottleneck")
        + f": {low.link} at {_gbps(low.gbps)} Gbit/s, hop {low.src}->{low.dst} "
        f"({rank_label(plan.ring[low.src])} -> {rank_label(plan.ring[low.dst])})"
        + (f"; {same} hops at that speed" if same > 1 else ""),
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
        _row(
            table,
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
    pinned = any(name.startswith("NCCL_NET_GDR") for e in plan.ring for name in e.env)
    if gdr and pinned and any(h.link == "NET" for h in plan.hops):  # CPU ranks: no GPUDirect
        _say(
            console,
            f"GPUDirect RDMA modelled with NCCL_NET_GDR_LEVEL={gdr.get('level')}, "
            f"NCCL_NET_GDR_READ {gdr.get('read')}; pinned in each rank's env"
            + (" (the level left to NCCL on C2C nodes)" if unpinned else ""),
        )
    for line in plan.assumptions:
        _say(console, f"Assumed: {line}")


def _hybrid_title(plan: RingPlan) -> str:
    u, rog = plan.ulysses, plan.ring_of_groups
    n_nodes = len(plan.nodes)
    crossings = sum(1 for h in rog.hops if h.crosses_switch and h.group == 0)
    return (
        f"Hybrid: {len(u.groups)} Ulysses group{'s' * (len(u.groups) != 1)} of {u.degree} "
        f"rank{'s' * (u.degree != 1)} (all-to-all inside), {u.degree} ring"
        f"{'s' * (u.degree != 1)} of {rog.size} group{'s' * (rog.size != 1)} across them, "
        f"{plan.world_size} ranks over {n_nodes} node{'s' * (n_nodes != 1)}"
        + (f", {crossings} switch crossing(s) per ring" if n_nodes > 1 else "")
    )


def print_hybrid(plan: RingPlan, console: Console) -> None:
    """Both groups of a hybrid plan: the Ulysses groups, then the ring across them."""
    u, rog = plan.ulysses, plan.ring_of_groups
    _say(console, _hybrid_title(plan))
    _print_nodes(plan, console)
    _say(console, f"Ulysses degree {u.degree}: {u.reason}")
    _print_ulysses_groups(plan, console)
    slow = [x for x in u.inside if x["link"] and not _is_nvlink(x["link"])]
    if slow:
        _say(
            console,
            f"Warning: the all-to-all of {len(slow)} group(s) crosses {slow[0]['link']} "
            f"({_gbps(slow[0]['gbps'])} Gbit/s), not NVLink, on every layer",
        )
    if not rog.hops:
        console.print("One Ulysses group: no ring across groups (Ulysses alone).")
    else:
        _print_ring_of_groups(plan, console)
        low = rog.bottleneck
        a, b = plan.ring[low.src], plan.ring[low.dst]
        same = sum(1 for h in rog.hops if h.gbps == low.gbps)
        src, dst = _group_where(plan, low.src // u.degree), _group_where(plan, low.dst // u.degree)
        _say(
            console,
            f"Ring-of-groups bottleneck: {low.link} at {_gbps(low.gbps)} Gbit/s, hop "
            f"{low.src}->{low.dst} ({rank_label(a)} -> {rank_label(b)}), from group {src} to {dst}"
            + (f"; {same} sends at that speed" if same > 1 else ""),
        )
    if plan.bottleneck is not None:
        flat = plan.bottleneck
        _say(
            console,
            f"Flat ring over the same ranks (a worker without Ulysses): bottleneck {flat.link} "
            f"at {_gbps(flat.gbps)} Gbit/s, hop {flat.src}->{flat.dst}",
        )
    _print_assumptions(plan, console)


def _is_nvlink(link: str) -> bool:
    """NVLink inside a node (NV#), between the nodes of a block (MNNVL), or a CPU node's SHM."""
    return all(part.startswith("NV") or part in ("MNNVL", "SHM") for part in link.split("+"))


def _print_ulysses_groups(plan: RingPlan, console: Console) -> None:
    """A row per Ulysses group: its ranks, NVLink domain, nodes and slowest pair."""
    u = plan.ulysses
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in [("group", "right"), ("ranks", "left"), ("domain", "left")]:
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("nodes", no_wrap=True)
    table.add_column("link inside (slowest pair)", no_wrap=True)
    table.add_column("Gbit/s", justify="right", no_wrap=True)
    rows = list(zip(range(len(u.groups)), u.groups, u.inside, strict=True))
    if len(rows) > MAX_ROWS:
        rows = sorted(rows, key=lambda r: (r[2]["gbps"] or 0.0, r[0]))[:MAX_ROWS]
        table.caption = f"the {MAX_ROWS} slowest of {len(u.groups)} groups"
    for g, ranks, inside in rows:
        _row(
            table,
            str(g),
            f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]),
            inside["domain"],
            _nodes_text(inside["nodes"]),
            inside["link"] or "(one rank)",
            _gbps(inside["gbps"]) if inside["gbps"] is not None else "",
        )
    console.print(table)


def _print_ring_of_groups(plan: RingPlan, console: Console) -> None:
    """A row per step from group g to group g+1: the slowest of its U parallel sends."""
    u, rog = plan.ulysses, plan.ring_of_groups
    steps: dict[int, list[Hop]] = {}
    for h in rog.hops:
        steps.setdefault(h.src // u.degree, []).append(h)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("step", justify="right", no_wrap=True)
    for name in ("from group", "to group", "link", "sends"):
        table.add_column(name, no_wrap=True)
    table.add_column("Gbit/s", justify="right", no_wrap=True)
    table.add_column("slowest send", no_wrap=True)
    table.add_column("send -> recv", no_wrap=True)
    table.add_column("", no_wrap=True)
    low = rog.bottleneck
    rows = sorted(steps.items())
    if len(rows) > MAX_ROWS:
        rows = sorted(rows, key=lambda r: (min(h.gbps for h in r[1]), r[0]))[:MAX_ROWS]
        table.caption = f"the {MAX_ROWS} slowest of {len(steps)} steps"
    for g, hops in rows:
        worst = min(hops, key=lambda h: h.gbps)
        links = "+".join(dict.fromkeys(h.link for h in hops))
        is_low = worst.gbps == low.gbps
        _row(
            table,
            f"{g}->{worst.dst // u.degree}",
            _group_where(plan, g),
            _group_where(plan, worst.dst // u.degree),
            links,
            str(len(hops)),
            _gbps(worst.gbps),
            f"{worst.src}->{worst.dst}",
            _ends(worst),
            _note(worst, is_low),
            style="bold red" if is_low else None,
        )
    console.print(table)


def _group_where(plan: RingPlan, g: int) -> str:
    inside = plan.ulysses.inside[g] if g < len(plan.ulysses.inside) else None
    return f"{g} ({inside['domain']})" if inside else str(g)
