"""`ringctl topo` and `ringctl topo probe`: argument parsing and printing only (the placement
itself is ringctl.topology)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..atomic import atomic_write
from ..errors import UserError
from ..text import cut, is_ascii_number
from ..topology.draw import draw_svg
from ..topology.gdr import GDR_LEVELS, GDR_READ_CHOICES, GdrPolicy
from ..topology.hybrid_place import plan_hybrid
from ..topology.links import DEFAULT_BANDWIDTHS
from ..topology.nodes import (
    MAX_TOOL_OUTPUT_BYTES,
    decode_tool_output,
    load_node,
    load_node_files,
    parse_node_arg,
    read_text,
)
from ..topology.placement import plan_ring
from ..topology.plan import RingPlan, parse_plan
from ..topology.probe import write_probe
from ..topology.report import print_plan
from ..topology.slurm import SwitchTopology, parse_slurm_topology

DESCRIPTION = """\
Place the ring of ring attention where the links are fastest, and write the placement the workers
read. Every rank sends to the next at every step, so the slowest hop sets the pace: inside a
node the GPUs are ordered by NVLink/PCIe links (bottleneck first, then total bandwidth), across
nodes the nodes under one leaf switch are kept together, and a node is entered and left through
GPUs with GPUDirect RDMA reach to a usable NIC (else the hop is marked "host bounce"). With
--ring-size N the ranks form rings of N, packed inside nodes, NVLink domains and leaves first,
and each ring's bottleneck is reported. With --ulysses auto|N the job is hybrid: Ulysses groups
of N consecutive ranks, each inside one NVLink domain (a node, or an NVL72 block), and the ring
across them; auto takes the largest N that one domain holds and --heads/--kv-heads allow.
Inputs are the raw outputs of `nvidia-smi topo -m`, `ibstat` (or `ibv_devinfo`) and Slurm's
topology.conf or `scontrol show topology`, or the JSON written by `ringctl topo probe`.
"""

EPILOG = """\
examples:
  one node, from saved tool outputs:
    ringctl topo --nvidia-smi topo.txt --ibstat ibstat.txt
  several nodes (probe JSON files or directories holding nvidia-smi-topo.txt and ibstat.txt),
  ordered by the switch tree, plan written for the workers:
    ringctl topo --node n1=probes/n1.json --node n2=probes/n2.json \\
        --slurm-topology /etc/slurm/topology.conf -o placement.json --svg ring.svg
  inside a Slurm job on CPU-only nodes (one rank per node):
    srun --ntasks-per-node=1 sh -c 'ringctl topo probe -o probes/$SLURMD_NODENAME.json'
    scontrol show topology | ringctl topo --node probes/*.json --slurm-topology - \\
        --ranks-per-node 1 -o placement.json
  trust your own numbers (Gbit/s; NV is per NVLink, NET when a port rate is unknown):
    ringctl topo --nvidia-smi topo.txt --bandwidth SYS=40 --bandwidth NV=150
  hybrid Ulysses x ring, the degree chosen from the nodes and the model's heads:
    ringctl topo --node probes/*.json --slurm-topology topology.conf \\
        --ulysses auto --heads 32 --kv-heads 8 -o placement.json
  rings of 8 ranks on GB200 NVL72 racks (Slurm topology/block, blocks = NVLink domains):
    scontrol show topology | ringctl topo --node probes/*.json --slurm-topology - \\
        --nvlink-blocks --ring-size 8 -o placement.json

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
        return parse_slurm_topology(_read_stdin(), "<stdin>")
    return parse_slurm_topology(read_text(Path(arg)), arg)


def _read_stdin() -> str:
    """stdin as a file is read: at most MAX_TOOL_OUTPUT_BYTES, no NUL, UTF-8 (it was read
    whole, so `--slurm-topology -` fed from a runaway pipe took all the memory)."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream put in its place (tests, embedding)
        data = sys.stdin.read(MAX_TOOL_OUTPUT_BYTES + 1).encode("utf-8", "surrogateescape")
    else:
        data = stream.read(MAX_TOOL_OUTPUT_BYTES + 1)
    if len(data) > MAX_TOOL_OUTPUT_BYTES:
        raise UserError(f"<stdin>: longer than {MAX_TOOL_OUTPUT_BYTES} bytes")
    return decode_tool_output(data, "<stdin>")


def _write(path: str, text: str) -> None:
    """Write a whole new file and rename it over path: a link planted at path is replaced,
    never followed (Path.write_text wrote through one, over the file it pointed to)."""
    try:
        atomic_write(path, text)
    except OSError as err:
        raise UserError(f"{path}: cannot write ({err.strerror})") from None


def _plan_text(plan: RingPlan, path: str) -> str:
    """The plan file's text, read back through the workers' reader (`parse_plan`) first: a
    plan they would refuse is not written (exit 2 here, not a failed job later)."""
    text = plan.to_json() + "\n"
    try:
        parse_plan(text.encode("utf-8"), path)
    except UserError as err:
        raise UserError(f"{path}: not written, the workers would refuse this plan: {err}") from None
    return text


MAX_ULYSSES_DIGITS = 9  # a degree divides the ranks; str.isdigit() took '²' (see text.py)


def _ulysses(args: argparse.Namespace) -> int | str | None:
    """--ulysses as "auto" or a positive int; None for a plain ring plan."""
    if args.ulysses is None:
        if args.heads is not None or args.kv_heads is not None:
            raise UserError("--heads and --kv-heads go with --ulysses auto|N")
        return None
    if args.ring_size is not None:
        raise UserError("give --ring-size (rings of rings) or --ulysses (hybrid), not both")
    value = args.ulysses.strip().lower()
    if value == "auto":
        return value
    if not is_ascii_number(value, MAX_ULYSSES_DIGITS) or int(value) < 1:
        raise UserError(
            f"--ulysses {cut(args.ulysses)}: expected auto or a positive integer "
            f"(ASCII digits, at most {MAX_ULYSSES_DIGITS})"
        )
    return int(value)


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
    if args.cpu:
        nodes = [node.without_gpus() for node in nodes]
    switches = _switches(args.slurm_topology)
    if args.nvlink_blocks and (switches is None or not switches.by_kind("block")):
        raise UserError("--nvlink-blocks needs a --slurm-topology with BlockName= lines")
    common = dict(
        switch_topology=switches,
        ranks_per_node=args.ranks_per_node,
        bandwidths=_bandwidths(args.bandwidth),
        gdr=GdrPolicy(args.gdr_level.upper() if args.gdr_level else None, args.gdr_read),
        nvlink_blocks=args.nvlink_blocks,
    )
    ulysses = _ulysses(args)
    if ulysses is None:
        plan = plan_ring(nodes, ring_size=args.ring_size, **common)
    else:
        plan = plan_hybrid(
            nodes, ulysses=ulysses, heads=args.heads, kv_heads=args.kv_heads, **common
        )
    if args.output:
        _write(args.output, _plan_text(plan, args.output))
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
        help="Place the ring on the fastest links of nodes and switches.",
        description=DESCRIPTION,
        epilog=EPILOG.format(table=table),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    many = _add_node_inputs(p)
    _add_hybrid(p, many)
    _add_network(p)
    _add_output(p)
    p.set_defaults(func=run_topo)
    _add_probe(p)


def _add_node_inputs(p):
    """One node's files, or several nodes and the switches between them; returns the
    several-nodes group (``_add_hybrid`` adds --nvlink-blocks to it)."""
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
        help="ranks per node (default: every GPU; 1 where no node has a GPU)",
    )
    many.add_argument(
        "--ring-size",
        type=int,
        metavar="N",
        help="rings of N consecutive ranks (a divisor of the ranks), placed inside nodes, "
        "NVLink domains and leaf switches where the sizes allow (default: one ring)",
    )
    many.add_argument(
        "--cpu",
        action="store_true",
        help="place CPU ranks (a gloo job): the nodes' GPUs are left out, so GPU and "
        "CPU-only nodes may share the ring (without it a node with no GPU beside GPU nodes "
        "is refused: its nvidia-smi may have failed)",
    )
    return many


def _add_hybrid(p, many) -> None:
    """Ulysses groups inside NVLink domains, and --nvlink-blocks (NVLink domains across nodes)
    in the several-nodes group, added after them as before (the usage line keeps its order)."""
    hybrid = p.add_argument_group("hybrid Ulysses x ring (ringattn.hybrid_attention)")
    hybrid.add_argument(
        "--ulysses",
        metavar="auto|N",
        help="Ulysses groups of N consecutive ranks inside one NVLink domain, the ring across "
        "them; auto: the most GPUs of one domain that the heads allow (needs --heads)",
    )
    hybrid.add_argument("--heads", type=int, metavar="H", help="the model's attention heads")
    hybrid.add_argument(
        "--kv-heads", type=int, metavar="K", help="its key/value heads (default: --heads)"
    )
    many.add_argument(
        "--nvlink-blocks",
        action="store_true",
        help="the topology's blocks are multi-node NVLink domains (GB200/GB300 NVL72): hops "
        "between nodes of one block use NVLink",
    )


def _add_network(p) -> None:
    net = p.add_argument_group("GPUDirect RDMA (what NCCL will do; pinned in each rank's env)")
    net.add_argument(
        "--gdr-level",
        metavar="LEVEL",
        help=f"largest GPU-NIC distance with GPUDirect RDMA: {', '.join(GDR_LEVELS)} "
        "(default: NCCL's, PXB; left to NCCL on Grace C2C nodes)",
    )
    net.add_argument(
        "--gdr-read",
        default="auto",
        choices=GDR_READ_CHOICES,
        help="GPUDirect for sends; auto: on where the node's GPUs have NVLink (NCCL's "
        "documented default)",
    )


def _add_output(p) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON, not a table")
    out.add_argument(
        "-o", "--output", metavar="FILE", help="write the placement JSON (placement.json) to FILE"
    )
    out.add_argument("--svg", metavar="FILE", help="draw nodes, switches and the ring to FILE")
    out.add_argument(
        "--bandwidth",
        action="append",
        metavar="KIND=GBPS",
        help="override a nominal bandwidth, in Gbit/s (repeatable); a link's rate is still "
        "the slowest on its path (NET=400 behind a 200 Gbit/s PCIe switch shows 200)",
    )


def _add_probe(p) -> None:
    """`topo probe`: record this node for planning elsewhere."""
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
