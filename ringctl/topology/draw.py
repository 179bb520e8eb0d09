"""`--svg FILE`: draw the nodes, GPUs, NICs and switches with the ring over them.

Hand-written SVG (no plotting dependency) drawn from the plan alone, so a plan file can be
drawn again later. Layout: switches on top (leaves lowest), nodes in ring order below them, four
to a row; inside a node its GPUs (or CPU ranks) and then its NICs, unusable NICs greyed. The
ring is drawn as arrows coloured by link kind; the bottleneck hop is thick, dashed and labelled.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from .plan import RingPlan

__all__ = ["draw_svg"]

BOX_W, BOX_H, NIC_H, GAP = 50, 30, 18, 24
NODES_PER_ROW, NODE_GAP_X, NODE_GAP_Y, SWITCH_ROW = 4, 70, 90, 60
COLOURS = {
    "NV": "#2e7d32",
    "MNNVL": "#2e7d32",  # NVLink between nodes of one NVLink domain
    "PIX": "#ef6c00",
    "PXB": "#ef6c00",
    "PHB": "#f9a825",
    "NODE": "#f9a825",
    "SYS": "#c62828",
    "NET": "#1565c0",
    "SHM": "#757575",
}


def _colour(link: str) -> str:
    return COLOURS["NV"] if link.startswith("NV") else COLOURS.get(link, "#000000")


def _text(x: float, y: float, s: str, size: int = 11, anchor: str = "middle", **kw: str) -> str:
    attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in kw.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-family="sans-serif" {attrs}>{escape(s)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str = "#333") -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
        f'fill="{fill}" stroke="{stroke}"/>'
    )


def _clip(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """Where the segment from the centre of a GPU box towards (x2, y2) leaves that box."""
    dx, dy = x2 - x1, y2 - y1
    scale = min(
        (BOX_W / 2) / abs(dx) if dx else math.inf, (BOX_H / 2) / abs(dy) if dy else math.inf
    )
    return x1 + dx * scale, y1 + dy * scale


def _node_boxes(plan: RingPlan) -> list[list]:
    """[node, x, y, w, h, cols] per node: its size from its GPUs (or ranks) and NICs."""
    items_per_node = {n["name"]: 0 for n in plan.nodes}
    for e in plan.ring:
        items_per_node[e.node] += 1
    layout = []
    for n in plan.nodes:
        count = max(len(n["gpus"]), items_per_node[n["name"]], 1)
        cols = min(4, max(count, len(n["nics"]), 1))
        rows = math.ceil(count / cols)
        nic_rows = math.ceil(len(n["nics"]) / cols)
        w = cols * (BOX_W + GAP) - GAP + 24
        h = 30 + rows * (BOX_H + GAP) + (nic_rows * (NIC_H + 6) + 8 if nic_rows else 0) + 6
        layout.append([n, 0.0, 0.0, w, h, cols])
    return layout


def _place_nodes(layout: list[list], top: float) -> tuple[float, float]:
    """Nodes in ring order, NODES_PER_ROW to a row, below the switches; (width, height)."""
    y, x_max = top, 0.0
    for r in range(0, len(layout), NODES_PER_ROW):
        row = layout[r : r + NODES_PER_ROW]
        x = 20.0
        for item in row:
            item[1], item[2] = x, y
            x += item[3] + NODE_GAP_X
        x_max = max(x_max, x)
        y += max(item[4] for item in row) + NODE_GAP_Y
    return max(x_max, 760.0), y + 60


def _draw_node(plan: RingPlan, n, x, y, w, h, cols, pos: dict) -> list[str]:
    """One node's box, its GPU (or CPU rank) boxes with their ring ranks, and its NICs;
    records each rank's box centre in `pos`."""
    out = [
        _rect(x, y, w, h, "#fafafa"),
        _text(x + 8, y + 16, n["name"], 12, "start", font_weight="bold"),
    ]
    ranks = [e for e in plan.ring if e.node == n["name"]]
    by_gpu = {e.gpu: e for e in ranks if e.gpu is not None}
    boxes = [(g["index"], by_gpu.get(g["index"])) for g in n["gpus"]]
    if not n["gpus"]:
        boxes = [(None, e) for e in ranks]
    for i, (gpu, entry) in enumerate(boxes):
        bx = x + 12 + (i % cols) * (BOX_W + GAP)
        by = y + 26 + (i // cols) * (BOX_H + GAP)
        used = entry is not None
        out.append(_rect(bx, by, BOX_W, BOX_H, "#e8f5e9" if used else "#eeeeee"))
        label = f"GPU{gpu}" if gpu is not None else f"cpu{entry.local_rank}"
        out.append(_text(bx + BOX_W / 2, by + 13, label, 10))
        if used:
            out.append(_text(bx + BOX_W / 2, by + 25, f"r{entry.rank}", 9, fill="#555"))
            pos[entry.rank] = (bx + BOX_W / 2, by + BOX_H / 2)
    rows = math.ceil(max(len(boxes), 1) / cols)
    ny0 = y + 26 + rows * (BOX_H + GAP) + 4
    for j, nic in enumerate(n["nics"]):
        nx = x + 12 + (j % cols) * (BOX_W + GAP)
        ny = ny0 + (j // cols) * (NIC_H + 6)
        fill = "#e3f2fd" if nic["usable"] else "#e0e0e0"
        out.append(_rect(nx, ny, BOX_W, NIC_H, fill, "#90a4ae"))
        colour = "#000" if nic["usable"] else "#9e9e9e"
        out.append(_text(nx + BOX_W / 2, ny + 13, nic["name"], 9, fill=colour))
    return out


def _switch_positions(plan: RingPlan, node_top: dict, top: float, levels: int) -> dict:
    """Each switch's box position: leaves just above their nodes, parents above their
    children, each centred over what it connects."""
    sw_x: dict[str, list[float]] = {}
    sw_level: dict[str, int] = {}
    for n in plan.nodes:
        path = n.get("switch_path") or []
        for level, name in enumerate(path):
            sw_level[name] = max(sw_level.get(name, 0), level)
        if path:
            sw_x.setdefault(path[0], []).append(node_top[n["name"]][0])
    for level in range(1, levels):
        for n in plan.nodes:
            path = n.get("switch_path") or []
            if len(path) > level:
                child = path[level - 1]
                sw_x.setdefault(path[level], []).append(sum(sw_x[child]) / len(sw_x[child]))
    return {
        s: (sum(xs) / len(xs), top - (sw_level[s] + 1) * SWITCH_ROW + 10) for s, xs in sw_x.items()
    }


def _draw_switches(plan: RingPlan, node_top: dict, sw_pos: dict) -> tuple[list[str], list[str]]:
    lines, boxes_svg = [], []
    for n in plan.nodes:
        path = n.get("switch_path") or []
        chain = [node_top[n["name"]]] + [sw_pos[s] for s in path]
        for (x1, y1), (x2, y2) in zip(chain, chain[1:], strict=False):
            lines.append(
                f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2 + 22:.1f}" '
                'stroke="#b0bec5" stroke-width="1.5"/>'
            )
    for s, (sx, sy) in sw_pos.items():
        boxes_svg.append(_rect(sx - 40, sy, 80, 22, "#fff3e0", "#8d6e63"))
        boxes_svg.append(_text(sx, sy + 15, s, 11))
    return lines, boxes_svg


def _hop_path(plan: RingPlan, hop, pos: dict, node_bottom: dict) -> str:
    """The SVG path of one hop: a line or arc inside a node, a loop under the nodes between
    nodes (the wrap-around hop loops lower so it does not hide the others)."""
    (x1, y1), (x2, y2) = pos[hop.src], pos[hop.dst]
    src_node, dst_node = plan.ring[hop.src].node, plan.ring[hop.dst].node
    if src_node == dst_node:
        if abs(y1 - y2) < 1 and abs(x1 - x2) > BOX_W + GAP + 1:
            # same row, not neighbours: arc over the boxes in between
            x1, x2 = x1 + (BOX_W / 4 if x2 > x1 else -BOX_W / 4), x2
            y1, y2 = y1 - BOX_H / 2, y2 - BOX_H / 2
            return f"M{x1:.1f},{y1:.1f} Q{(x1 + x2) / 2:.1f},{y1 - 22:.1f} {x2:.1f},{y2:.1f}"
        (x1, y1), (x2, y2) = _clip(x1, y1, x2, y2), _clip(x2, y2, x1, y1)
        return f"M{x1:.1f},{y1:.1f} L{x2:.1f},{y2:.1f}"
    below = max(node_bottom[src_node], node_bottom[dst_node])
    below += 45 if hop.dst > hop.src else 75
    y1, y2 = y1 + BOX_H / 2, y2 + BOX_H / 2
    return f"M{x1:.1f},{y1:.1f} C{x1:.1f},{below:.1f} {x2:.1f},{below:.1f} {x2:.1f},{y2:.1f}"


def _draw_ring(plan: RingPlan, pos: dict, node_bottom: dict) -> list[str]:
    """Every hop as an arrow coloured by its link; the bottleneck thick and dashed."""
    low = plan.bottleneck
    ring_svg = []
    for hop in plan.hops:
        colour = _colour(hop.link)
        is_low = low is not None and (hop.src, hop.dst) == (low.src, low.dst)
        style = f'stroke="{colour}" stroke-width="{4 if is_low else 2}" fill="none"'
        if is_low:
            style += ' stroke-dasharray="6,4"'
        d = _hop_path(plan, hop, pos, node_bottom)
        ring_svg.append(f'<path d="{d}" {style} marker-end="url(#arrow-{colour.lstrip("#")})"/>')
    return ring_svg


def _markers() -> str:
    return "".join(
        f'<marker id="arrow-{c.lstrip("#")}" viewBox="0 0 10 10" refX="9" refY="5" '
        f'markerUnits="userSpaceOnUse" markerWidth="9" markerHeight="9" orient="auto">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
        for c in sorted(set(COLOURS.values()) | {"#000000"})
    )


LEGEND = [
    ("NVLink", "NV"),
    ("PIX/PXB", "PIX"),
    ("PHB/NODE", "PHB"),
    ("SYS", "SYS"),
    ("network", "NET"),
    ("shared memory", "SHM"),
]


def _legend(height: float) -> list[str]:
    legend = []
    lx = 20.0
    for name, kind in LEGEND:
        legend.append(
            f'<line x1="{lx:.1f}" y1="{height - 20:.1f}" x2="{lx + 24:.1f}" '
            f'y2="{height - 20:.1f}" stroke="{COLOURS[kind]}" stroke-width="3"/>'
        )
        legend.append(_text(lx + 30, height - 16, name, 11, "start"))
        lx += 40 + 7 * len(name)
    legend.append(
        f'<line x1="{lx:.1f}" y1="{height - 20:.1f}" x2="{lx + 24:.1f}" y2="{height - 20:.1f}" '
        'stroke="#333" stroke-width="4" stroke-dasharray="6,4"/>'
    )
    legend.append(_text(lx + 30, height - 16, "bottleneck hop", 11, "start"))
    return legend


def draw_svg(plan: RingPlan) -> str:
    """The SVG document (a string) of a plan: switches, nodes, then the ring over them."""
    layout = _node_boxes(plan)
    levels = max((len(n.get("switch_path") or []) for n in plan.nodes), default=0)
    top = 40 + levels * SWITCH_ROW
    width, height = _place_nodes(layout, top)
    out: list[str] = []
    pos: dict[int, tuple[float, float]] = {}  # rank -> centre of its box
    for n, x, y, w, h, cols in layout:
        out += _draw_node(plan, n, x, y, w, h, cols, pos)
    node_top = {n["name"]: (x + w / 2, y) for n, x, y, w, h, cols in layout}
    node_bottom = {n["name"]: y + h for n, x, y, w, h, cols in layout}
    lines, boxes_svg = _draw_switches(
        plan, node_top, _switch_positions(plan, node_top, top, levels)
    )
    low = plan.bottleneck
    title = f"ring of {plan.world_size} ranks"
    if low is not None:
        title += f"; bottleneck {low.link} {low.gbps:g} Gbit/s (hop {low.src}->{low.dst})"
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">',
            f"<defs>{_markers()}</defs>",
            '<rect width="100%" height="100%" fill="white"/>',
            _text(20, 20, title, 13, "start", font_weight="bold"),
            *lines,
            *boxes_svg,
            *out,
            *_draw_ring(plan, pos, node_bottom),
            *_legend(height),
            "</svg>",
            "",
        ]
    )
