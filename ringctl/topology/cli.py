"""`ringctl topo` and `ringctl topo probe`: argument parsing and printing only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError
from .draw import draw_svg
from .links import DEFAULT_BANDWIDTHS
from .nodes import load_node, load_node_files, parse_node_arg
from .placement import plan_ring
from .probe import write_probe
from .report import print_plan
from .slurm import SwitchTopology, parse_slurm_topology

DESCRIPTION = """\
Place the ring of ring attention where the links are fastest, and write the plan the workers
read. Every rank sends to the next at every step, so the slowest hop sets the pace: inside a
node the GPUs are ordered by NVLink/PCIe links (bottleneck first, then total bandwidth), across
nodes the nodes under one leaf switch are kept together, and each GPU gets its nearest usable
NIC. Inputs are the raw outputs of `nvidia-smi topo -m`, `ibstat` (or `ibv_devinfo`) and
Slurm's topology.conf or `scontrol show topology`, or the JSON written by `ringctl topo probe`.
"""

EPILOG = """\
examples:
  one node, from saved tool outputs:
    ringctl topo --nvidia-smi topo.txt --ibstat ibstat.txt
  several nodes (probe JSON files or directories holding nvidia-smi-topo.txt and ibstat.txt),
  ordered by the switch tree, plan written for the workers:
    ringctl topo --node n1=probes/n1.json --node n2=probes/n2.json \\
        --slurm-topology /etc/slurm/topology.conf -o plan.json --svg ring.svg
  inside a Slurm job on CPU-only nodes (one rank per node):
    srun --ntasks-per-node=1 sh -c 'ringctl topo probe -o probes/$SLURMD_NODENAME.json'
    scontrol show topology | ringctl topo --node probes/*.json --slurm-topology - \\
        --ranks-per-node 1 -o plan.json
  trust your own numbers (Gbit/s; NV is per NVLink, NET when a port rate is unknown):
    ringctl topo --nvidia-smi topo.txt --bandwidth SYS=40 --bandwidth NV=150

default bandwidths (Gbit/s, one direction): {table}
exit status: 0 ok, 2 bad input (one line naming the file and line).
"""


def _bandwidths(values: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in values or []:
        kind, sep, number = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[kind.strip().upper()] = float(number)
        except ValueError:
            raise UserError(f"--bandwidth {item}: expected KIND=GBPS, e.g. SYS=40") from None
    return out


def _switches(arg: str | None) -> SwitchTopology | None:
    if arg is None:
        return None
    if arg == "-":
        return parse_slurm_topology(sys.stdin.read(), "<stdin>")
    try:
        text = Path(arg).read_text()
    except OSError as err:
        raise UserError(f"{arg}: cannot read ({err.strerror})") from None
    return parse_slurm_topology(text, arg)


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as err:
        raise UserError(f"{path}: cannot write ({err.strerror})") from None


def run_topo(args: argparse.Namespace) -> int:
    if args.nvidia_smi and args.node:
        raise UserError("give either --nvidia-smi (one node) or --node (several), not both")
    if args.nvidia_smi:
        nodes = [load_node_files(args.nvidia_smi, args.ibstat, args.name or "node")]
    elif args.node:
        if args.ibstat:
            raise UserError("--ibstat goes with --nvidia-smi; with --node put ibstat.txt in PATH")
        nodes = [load_node(path, name) for name, path in map(parse_node_arg, args.node)]
    else:
        raise UserError("nothing to place: give --nvidia-smi FILE or --node NAME=PATH")
    plan = plan_ring(
        nodes,
        switch_topology=_switches(args.slurm_topology),
        ranks_per_node=args.ranks_per_node,
        bandwidths=_bandwidths(args.bandwidth),
    )
    if args.output:
        _write(args.output, plan.to_json() + "\n")
    if args.svg:
        _write(args.svg, draw_svg(plan))
    if args.json:
        print(plan.to_json())
    else:
        print_plan(plan)
    return 0


def run_probe(args: argparse.Namespace) -> int:
    write_probe(args.output)
    return 0


def register(subparsers) -> None:
    """Add the `topo` verb (and `topo probe`) to ringctl's sub-parsers."""
    table = ", ".join(f"{k}={v:g}" for k, v in DEFAULT_BANDWIDTHS.items())
    p = subparsers.add_parser(
        "topo",
        help="place the ring on the fastest links of nodes and switches",
        description=DESCRIPTION,
        epilog=EPILOG.format(table=table),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    one = p.add_argument_group("one node")
    one.add_argument("--nvidia-smi", metavar="FILE", help="output of `nvidia-smi topo -m`")
    one.add_argument("--ibstat", metavar="FILE", help="output of `ibstat` or `ibv_devinfo`")
    one.add_argument("--name", help="name of that node in the plan (default: node)")
    many = p.add_argument_group("several nodes")
    many.add_argument(
        "--node",
        action="extend",
        nargs="+",
        metavar="NAME=PATH",
        help="a node: probe JSON, or directory with nvidia-smi-topo.txt [ibstat.txt]; "
        "NAME= may be left out to take the probe's node name",
    )
    many.add_argument(
        "--slurm-topology",
        metavar="FILE",
        help="topology.conf or `scontrol show topology` output ('-' reads stdin)",
    )
    many.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="N",
        help="ranks per node (default: every GPU; 1 on nodes without GPUs)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON, not a table")
    out.add_argument("-o", "--output", metavar="FILE", help="write the plan JSON to FILE")
    out.add_argument("--svg", metavar="FILE", help="draw nodes, switches and the ring to FILE")
    out.add_argument(
        "--bandwidth",
        action="append",
        metavar="KIND=GBPS",
        help="override a nominal bandwidth (repeatable)",
    )
    p.set_defaults(func=run_topo)
    sub = p.add_subparsers(dest="topo_command", metavar="{probe}")
    probe = sub.add_parser(
        "probe",
        help="record this node's nvidia-smi topo -m and ibstat output as JSON",
        description=(
            "Record this node for planning elsewhere: its name ($SLURMD_NODENAME, else the "
            "short hostname), the raw output of `nvidia-smi topo -m` and `ibstat` (null when "
            "missing or failing) and its CPU count."
        ),
        epilog="example:\n  srun --ntasks-per-node=1 sh -c "
        "'ringctl topo probe -o probes/$SLURMD_NODENAME.json'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    probe.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    probe.set_defaults(func=run_probe)
