"""Build a NodeTopology from tool outputs: files, a directory of them, or a probe JSON.

The join of the matrix and ibstat lives here because neither tool alone says which NIC is
worth using: nvidia-smi lists every NIC (down or Ethernet ones too) with its PCIe distance,
ibstat says which ports are up and how fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..bounded_read import read_regular
from ..errors import UserError, naming
from ..text import cut, echo
from .ibstat import parse_hca_text
from .model import Hca, Nic, NodeTopology
from .nvidia_smi import SmiTopology, parse_nvidia_smi

__all__ = [
    "build_node",
    "check_node_name",
    "decode_tool_output",
    "load_node",
    "load_node_files",
    "natural_key",
    "parse_node_arg",
    "read_text",
]

SMI_FILE = "nvidia-smi-topo.txt"
HCA_FILES = ("ibstat.txt", "ibv_devinfo.txt")
# Where a NIC known only from ibstat sits relative to the GPUs: unknown, so assume the worst.
UNKNOWN_PATH = "SYS"
# A node's name as hosts and Slurm spell it (letters, digits, '.', '_', '-'; at most 253). A
# probe file is written on a compute node and may come back from a remote job directory: a
# name with markup or control characters would be printed into the user's terminal.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def _nic_from_hca(name: str, label: str | None, hca: Hca | None, known: bool) -> Nic:
    nic = Nic(name=name, label=label)
    if not known:
        return nic  # no ibstat at all: usable, speed unknown
    if hca is None:
        nic.usable, nic.why_unusable = False, "not listed by ibstat/ibv_devinfo"
        return nic
    port = hca.best_port()
    if port is None:
        nic.usable, nic.why_unusable = False, "no port is active"
        first = hca.ports[0] if hca.ports else None
        nic.link_layer = first.link_layer if first else None
        return nic
    nic.port, nic.rate_gbps, nic.link_layer = port.number, port.rate_gbps, port.link_layer
    return nic


def natural_key(name: str) -> list[str | int]:
    """Sort key reading digit runs as numbers: mlx5_2 before mlx5_10."""
    return [int(p) if p.isdigit() else p for p in _DIGIT_RUNS.split(name)]


_DIGIT_RUNS = re.compile(r"([0-9]+)")
_COLUMN_LABEL = re.compile(r"NIC[0-9]+")


def _nic_names(smi: SmiTopology, hcas: list[Hca] | None) -> tuple[list[str], str | None]:
    """The NIC columns' names and how they are known when not from the matrix (None: from
    it). NICn columns without their legend are matched to ibstat's HCAs by order when the
    counts agree, in natural order (mlx5_2 before mlx5_10): the kernel numbers mlx5 devices as
    it probes them, close to PCI order, the order of nvidia-smi's columns, while ibstat lists
    them alphabetically (mlx5_10 before mlx5_2), which put NIC2 on mlx5_10. Without ibstat (or
    with a count that differs) such a column's real name is unknown: "column label"."""
    names = list(smi.nic_names)
    placeholders = all(
        n == lbl and _COLUMN_LABEL.fullmatch(lbl)
        for n, lbl in zip(names, smi.nic_labels, strict=True)
    )
    if not names or not placeholders:
        return names, None
    if hcas is not None and len(hcas) == len(names):
        return sorted((h.name for h in hcas), key=natural_key), "ibstat order"
    return names, "column label"


def build_node(
    name: str,
    smi: SmiTopology | None,
    hcas: list[Hca] | None = None,
    cpu_count: int | None = None,
) -> NodeTopology:
    """Join a parsed matrix (None: no GPU) with ibstat's HCAs (None: not captured)."""
    node = NodeTopology(name=name, cpu_count=cpu_count)
    by_name = {h.name: h for h in hcas or []}
    known = hcas is not None
    name_from = None
    if smi is not None:
        node.gpus = list(smi.gpus)
        node.gpu_links = [list(r) for r in smi.gpu_links]
        node.gpu_nic_links = [list(r) for r in smi.gpu_nic_links]
        names, name_from = _nic_names(smi, hcas)
        for label, nic_name in zip(smi.nic_labels, names, strict=True):
            nic = _nic_from_hca(nic_name, label, by_name.get(nic_name), known)
            nic.name_from = name_from or nic.name_from
            node.nics.append(nic)
    listed = {n.name for n in node.nics if n.name_known}
    for hca in hcas or []:
        if hca.name not in listed:
            node.nics.append(_nic_from_hca(hca.name, None, hca, True))
            node.nics[-1].name_from = "ibstat unplaced" if name_from == "column label" else "ibstat"
            for row in node.gpu_nic_links:
                row.append(UNKNOWN_PATH)
    return node


MAX_TOOL_OUTPUT_BYTES = 64 << 20  # nvidia-smi/ibstat text, or a probe holding both


def read_text(path: Path) -> str:
    """A tool output as text (see `decode_tool_output`): a regular file, opened without
    following a link (a link is refused, not resolved: the node probes in a job directory are
    written by the nodes, and one linking outside was read as a node's layout), within
    MAX_TOOL_OUTPUT_BYTES (a FIFO or /dev/zero there hung the placement)."""
    try:
        data = read_regular(Path(path), MAX_TOOL_OUTPUT_BYTES)
    except ValueError as err:
        raise UserError(naming(path, str(err))) from None
    return decode_tool_output(data, str(path))


def decode_tool_output(data: bytes, source: str) -> str:
    """The bytes of a tool's output as text; a binary or non-UTF-8 input is refused in one
    line (the tools print ASCII, so such a file is the wrong file, not a format to guess at)."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserError(
            f"{source}: a binary file (NUL byte at {nul}), expected the text output of the tool"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{source}: not UTF-8 text (byte {err.start}), expected the text output of the tool"
        ) from None


def check_node_name(name: str, source: str) -> str:
    """name, when it is a host name (NODE_NAME); else UserError naming where it came from.
    Checked where it enters (--name, NAME=, a directory's or probe's name): the plan's reader
    refuses any other, so a plan holding one was written and then refused by every worker."""
    if not NODE_NAME.fullmatch(name):
        raise UserError(
            f"{source}: node name {echo(name)} is not a host name (letters, digits, '.', '_' "
            "and '-', at most 253)"
        )
    return name


def load_node_files(
    nvidia_smi: str | Path | None,
    hca_file: str | Path | None = None,
    name: str = "node",
    name_source: str = "--name",
) -> NodeTopology:
    """A node from an `nvidia-smi topo -m` file and optionally an ibstat/ibv_devinfo file;
    `name_source` says where `name` came from, for the error when it is no host name."""
    smi = None
    if nvidia_smi is not None:
        smi = parse_nvidia_smi(read_text(Path(nvidia_smi)), str(nvidia_smi))
    hcas = None
    if hca_file is not None:
        hcas = parse_hca_text(read_text(Path(hca_file)), str(hca_file))
    return build_node(check_node_name(name, name_source), smi, hcas)


MAX_CPUS = 1 << 16  # a node's CPUs (os.cpu_count) in a probe: thousands at most


def _load_probe(path: Path, name: str | None) -> NodeTopology:
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: expected a probe JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # a number of 5,000 digits, deep nesting
        raise UserError(f"{path}: expected a probe JSON ({type(err).__name__})") from None
    if not isinstance(data, dict) or "nvidia_smi_topo" not in data:
        raise UserError(f"{path}:1: expected a probe JSON with key nvidia_smi_topo")
    for key in ("nvidia_smi_topo", "ibstat", "ibv_devinfo", "node"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise UserError(f"{path}: key {key} must be a string or null")
    node_name = check_node_name(name or data.get("node") or path.stem, str(path))
    smi_text = data.get("nvidia_smi_topo")
    smi = parse_nvidia_smi(smi_text, f"{path}[nvidia_smi_topo]") if smi_text else None
    hcas = None
    for key in ("ibstat", "ibv_devinfo"):
        if data.get(key):
            hcas = parse_hca_text(data[key], f"{path}[{key}]")
            break
    cpus = data.get("cpu_count")
    if cpus is not None and not (
        isinstance(cpus, int) and not isinstance(cpus, bool) and 0 < cpus <= MAX_CPUS
    ):  # copied into placement.json as it came (NaN, a list)
        raise UserError(f"{path}: cpu_count must be a count from 1 to {MAX_CPUS} or null")
    return build_node(node_name, smi, hcas, cpus)


def load_node(path: str | Path, name: str | None = None) -> NodeTopology:
    """A node from a probe JSON, or from a directory holding `nvidia-smi-topo.txt` and
    optionally `ibstat.txt` or `ibv_devinfo.txt`."""
    path = Path(path)
    if path.is_dir():
        smi_path = path / SMI_FILE
        if not smi_path.is_file():
            raise UserError(f"{path}: expected a probe JSON or a directory holding {SMI_FILE}")
        hca = next((path / f for f in HCA_FILES if (path / f).is_file()), None)
        source = f"{path} (the directory's name; give NAME=PATH)" if name is None else "NAME="
        return load_node_files(smi_path, hca, name or path.name, source)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    return _load_probe(path, name)


def parse_node_arg(arg: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a bare PATH takes its name from the probe or directory."""
    name, sep, path = arg.partition("=")
    if sep and name and "/" not in name:
        return check_node_name(name, f"--node {cut(name)}=..."), path
    return None, arg
