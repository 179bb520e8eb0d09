"""The readable form of a plan: the ring hop by hop, with link kinds and the bottleneck."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from .plan import RankEntry, RingPlan

__all__ = ["print_plan", "rank_label"]


def rank_label(entry: RankEntry) -> str:
    """`n1:GPU3 mlx5_3`, or `n1:cpu0` for a CPU rank."""
    where = f"GPU{entry.gpu}" if entry.gpu is not None else f"cpu{entry.local_rank}"
    return f"{entry.node}:{where}" + (f" {entry.nic}" if entry.nic else "")


def _gbps(value: float) -> str:
    return f"{value:g}"


def print_plan(plan: RingPlan, console: Console | None = None) -> None:
    """Print the hop table, a summary line per node and the bottleneck."""
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 120  # logs and pipes: no wrapping of the hop table
    nodes = plan.nodes
    n_nodes = len(nodes)
    console.print(
        f"Ring of {plan.world_size} rank{'s' if plan.world_size != 1 else ''} "
        f"over {n_nodes} node{'s' if n_nodes != 1 else ''}"
        + (f", {plan.switch_crossings()} switch crossing(s)" if n_nodes > 1 else ""),
        soft_wrap=True,
    )
    for node in nodes:
        switch = " under " + " < ".join(node["switch_path"]) if node.get("switch_path") else ""
        order = [rank_label(e).split(":", 1)[1] for e in plan.ring if e.node == node["name"]]
        down = [n["name"] for n in node["nics"] if not n["usable"]]
        extra = f"; unusable NICs: {', '.join(down)}" if down else ""
        console.print(f"  {node['name']}{switch}: {' -> '.join(order)}{extra}", soft_wrap=True)
    if not plan.hops:
        console.print("One rank: nothing to send, no bottleneck.")
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in [("hop", "right"), ("from", "left"), ("to", "left")]:
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("link", no_wrap=True)
    table.add_column("Gbit/s", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)
    low = plan.bottleneck
    for hop in plan.hops:
        is_low = low is not None and (hop.src, hop.dst) == (low.src, low.dst)
        note = "bottleneck" if is_low else ("switch" if hop.crosses_switch else "")
        style = "bold red" if is_low else None
        table.add_row(
            f"{hop.src}->{hop.dst}",
            rank_label(plan.ring[hop.src]),
            rank_label(plan.ring[hop.dst]),
            hop.link,
            _gbps(hop.gbps),
            note,
            style=style,
        )
    console.print(table)
    same = sum(1 for h in plan.hops if h.gbps == low.gbps)
    console.print(
        f"Bottleneck: {low.link} at {_gbps(low.gbps)} Gbit/s, hop {low.src}->{low.dst} "
        f"({rank_label(plan.ring[low.src])} -> {rank_label(plan.ring[low.dst])})"
        + (f"; {same} hops at that speed" if same > 1 else ""),
        soft_wrap=True,
    )
