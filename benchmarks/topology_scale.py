"""How `ringctl topo` scales: placement time and peak memory for 64, 512 and 4,096 nodes.

    python -m benchmarks.topology_scale                      # 64, 512, 4096 nodes
    python -m benchmarks.topology_scale --nodes 64 --json /tmp/t.json   # a quick check

Each size is a synthetic cluster of 8-GPU nodes (the all-NVLink node whose two NICs sit next to
GPU3 and GPU6 only, tests/fixtures/topology/synthetic) under a three-level Slurm tree: leaf
switches of 16 nodes, pods of 16 leaves, one spine. Timed, in one process, one size after the
other: reading the topology.conf text, placing one ring over every GPU, placing rings of 16
(two nodes each), and writing the plan JSON. Peak memory is tracemalloc's peak over the whole
size (Python allocations: the plan, the parsed layout, the JSON text). It also times the
hostlist expansion of `n[1-1000000]` and the refusal of `a[1-1000]b[1-1000]c[1-1000]`.
A table is printed and the figures are written as JSON (default
benchmarks/results/topology-scale.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import tracemalloc
from pathlib import Path

from ringctl.topology import load_node_files, parse_slurm_topology, plan_ring
from ringctl.topology.hostlist import HostlistError, expand
from ringctl.topology.model import NodeTopology

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "topology" / "synthetic"
SMI = FIX / "nvidia-smi-8gpu-nv12-2nic-pix-to-gpu3-and-gpu6-only.txt"
IBSTAT = FIX / "ibstat-mlx5_0-mlx5_1-edr-100-active.txt"
DEFAULT_OUT = Path("benchmarks/results/topology-scale.json")
NODES_PER_LEAF, LEAVES_PER_POD = 16, 16


def three_level_tree(
    n_nodes: int, per_leaf: int = NODES_PER_LEAF, per_pod: int = LEAVES_PER_POD
) -> str:
    """topology.conf text: leaves of `per_leaf` nodes n00001.., pods of `per_pod` leaves, a
    spine over the pods. Leaves are listed in reverse so file order is not placement order."""
    lines = []
    leaves = (n_nodes + per_leaf - 1) // per_leaf
    for leaf in reversed(range(leaves)):
        lo, hi = leaf * per_leaf + 1, min(n_nodes, (leaf + 1) * per_leaf)
        lines.append(f"SwitchName=leaf{leaf:04d} Nodes=n[{lo:05d}-{hi:05d}]")
    pods = (leaves + per_pod - 1) // per_pod
    for pod in range(pods):
        lo, hi = pod * per_pod, min(leaves, (pod + 1) * per_pod) - 1
        lines.append(f"SwitchName=pod{pod:03d} Switches=leaf[{lo:04d}-{hi:04d}]")
    lines.append(f"SwitchName=spine Switches=pod[000-{pods - 1:03d}]")
    return "\n".join(lines) + "\n"


def cluster_nodes(n_nodes: int) -> list[NodeTopology]:
    """n_nodes copies of the fixture node named n00001.. (separate objects, like parsed probes)."""
    template = load_node_files(SMI, IBSTAT)
    nodes = []
    for i in range(1, n_nodes + 1):
        node = copy.deepcopy(template)
        node.name = f"n{i:05d}"
        nodes.append(node)
    return nodes


def _run(nodes, text) -> tuple[list[float], object, object, str]:
    t = [time.perf_counter()]
    switches = parse_slurm_topology(text, "topology.conf")
    t.append(time.perf_counter())
    plan = plan_ring(nodes, switches)
    t.append(time.perf_counter())
    rings = plan_ring(nodes, switches, ring_size=16)
    t.append(time.perf_counter())
    data = plan.to_json()
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:], strict=False)], plan, rings, data


def measure(n_nodes: int) -> dict:
    """Times (a plain run) and peak memory (a second run under tracemalloc, which slows
    allocation, so its times are not used) of one size; nodes are built beforehand."""
    nodes = cluster_nodes(n_nodes)
    text = three_level_tree(n_nodes)
    (parse_s, ring_s, rings_s, json_s), plan, rings, data = _run(nodes, text)
    del plan, rings, data
    tracemalloc.start()
    _, plan, rings, data = _run(nodes, text)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "nodes": n_nodes,
        "ranks": plan.world_size,
        "parse_s": parse_s,
        "one_ring_s": ring_s,
        "rings_of_16_s": rings_s,
        "json_s": json_s,
        "total_s": parse_s + ring_s + rings_s + json_s,
        "peak_mib": peak / 2**20,
        "json_mib": len(data) / 2**20,
        "switch_crossings": plan.switch_crossings(),
        "rings_not_inside_a_leaf": sum(not g.span.startswith("leaf") for g in rings.groups),
        "bottleneck_gbps": plan.bottleneck.gbps,
    }


def measure_hostlist() -> dict:
    t0 = time.perf_counter()
    names = expand("n[1-1000000]")
    t1 = time.perf_counter()
    try:
        expand("a[1-1000]b[1-1000]c[1-1000]")
        refused = False
    except HostlistError:
        refused = True
    t2 = time.perf_counter()
    return {
        "expand_1e6_s": t1 - t0,
        "names": len(names),
        "refuse_1e9_s": t2 - t1,
        "refused": refused,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.topology_scale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--json", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    rows = [measure(n) for n in args.nodes]
    host = measure_hostlist()
    header = (
        "nodes",
        "ranks",
        "parse s",
        "1 ring s",
        "rings/16 s",
        "json s",
        "total s",
        "peak MiB",
        "JSON MiB",
        "crossings",
    )
    print(" ".join(f"{h:>10}" for h in header))
    for r in rows:
        cells = (
            r["nodes"],
            r["ranks"],
            f"{r['parse_s']:.3f}",
            f"{r['one_ring_s']:.3f}",
            f"{r['rings_of_16_s']:.3f}",
            f"{r['json_s']:.3f}",
            f"{r['total_s']:.3f}",
            f"{r['peak_mib']:.1f}",
            f"{r['json_mib']:.1f}",
            r["switch_crossings"],
        )
        print(" ".join(f"{c:>10}" for c in cells))
    print(
        f"hostlist n[1-1000000]: {host['expand_1e6_s']:.3f} s for {host['names']} names; "
        f"a[1-1000]b[1-1000]c[1-1000] refused in {host['refuse_1e9_s'] * 1e3:.2f} ms"
    )
    result = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "sizes": rows,
        "hostlist": host,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
