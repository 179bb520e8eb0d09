"""Parse `nvidia-smi topo -m` in every driver variant we have seen.

The matrix is split on whitespace, never on fixed columns: most pasted outputs have their tabs
expanded, NIC rows end in empty tab cells, and header names such as `CPU Affinity` contain a
space. Device columns are the leading header words that hold a digit (`GPU0`, `NIC3`,
`mlx5_0`); the words after them name information columns (`CPU Affinity`, `NUMA Affinity`,
`GPU NUMA ID`, or something newer, which is kept but not needed). Anything that would give a
wrong plan (a missing row, a short row from a wrapped terminal line, an unknown link token) is
refused with the file and line, because a silently wrong matrix places the ring badly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UserError
from ..text import cut, echo
from .links import is_link_token, normalise_token, nvlink_problem
from .model import CPU_LIST, MAX_CPU_LIST_CHARS, MAX_CPUS, NIC_NAME, Gpu, is_cpu_list

__all__ = ["SmiTopology", "parse_nvidia_smi"]

# Known information columns, longest first so `GPU NUMA ID` is not read as `GPU`.
_INFO_COLUMNS = [("GPU", "NUMA", "ID"), ("CPU", "Affinity"), ("NUMA", "Affinity")]
# ASCII digits only (\d takes '١' too, which int() reads as 1); a GPU index of at most 4 digits
_GPU_LABEL = re.compile(r"^GPU([0-9]{1,4})$")
_NIC_LEGEND = re.compile(r"^\s*(NIC[0-9]+)\s*:\s*(\S+)\s*$")


@dataclass
class SmiTopology:
    """The parsed matrix: GPUs in index order, NIC names (legend applied) and link tokens."""

    gpus: list[Gpu] = field(default_factory=list)
    nic_labels: list[str] = field(default_factory=list)
    nic_names: list[str] = field(default_factory=list)
    gpu_links: list[list[str]] = field(default_factory=list)
    gpu_nic_links: list[list[str]] = field(default_factory=list)
    nic_links: list[list[str]] = field(default_factory=list)
    extra_columns: list[str] = field(default_factory=list)


def _info_names(words: list[str]) -> list[str]:
    """Group the header words after the device columns into column names."""
    names, i = [], 0
    while i < len(words):
        for phrase in _INFO_COLUMNS:
            if tuple(words[i : i + len(phrase)]) == phrase:
                names.append(" ".join(phrase))
                i += len(phrase)
                break
        else:
            names.append(words[i])
            i += 1
    return names


def _check_info(value: str, column: str, where: str) -> None:
    if value == "N/A":
        return
    if column not in ("CPU Affinity", "NUMA Affinity"):
        return
    if len(value) > MAX_CPU_LIST_CHARS:
        raise UserError(f"{where}: {column} longer than {MAX_CPU_LIST_CHARS} characters")
    if not is_cpu_list(value):
        cut_row = (
            ""
            if CPU_LIST.fullmatch(value)
            else " (a row longer than the header: columns cut or wrapped?)"
        )
        raise UserError(
            f"{where}: expected a {column} such as 0-15,32-47 or N/A (CPUs below "
            f"{MAX_CPUS}, ranges forward), found {echo(value)}{cut_row}"
        )


def parse_nvidia_smi(text: str, source: str = "<nvidia-smi>") -> SmiTopology:
    """Parse the text of `nvidia-smi topo -m`; `source` names the file in error messages."""
    lines = text.splitlines()
    header = _read_header(lines, source)
    rows, row_info, end = _read_rows(lines, header, source)
    missing = [d for d in header.devices if d not in rows]
    if missing:
        raise UserError(
            f"{source}:{end + 1}: expected a row for {missing[0]} "
            f"(found {len(rows)} of {len(header.devices)} rows: matrix not square or truncated)"
        )
    legend = _nic_legend(lines, end, source)
    return _topology(header, rows, row_info, legend, source)


@dataclass
class _Header:
    """The matrix header: its line index, the device columns and the information columns."""

    at: int
    devices: list[str]
    info: list[str]


def _read_header(lines: list[str], source: str) -> _Header:
    """The first line starting with GPU0; its leading words holding a digit are devices."""
    header_at = None
    for i, line in enumerate(lines):
        words = line.split()
        if words and words[0] == "GPU0":
            header_at = i
            break
    if header_at is None:
        raise UserError(f"{source}:1: expected a matrix header starting with GPU0")
    words = lines[header_at].split()
    n_dev = 0
    while n_dev < len(words) and any(c.isdigit() for c in words[n_dev]):
        n_dev += 1
    devices = words[:n_dev]
    if len(set(devices)) != len(devices):
        raise UserError(f"{source}:{header_at + 1}: a device column appears twice in the header")
    for d in devices:  # an old driver names NIC columns by device: the name NCCL_IB_HCA pins
        if not _GPU_LABEL.match(d) and (d.startswith("GPU") or not NIC_NAME.fullmatch(d)):
            raise UserError(
                f"{source}:{header_at + 1}: device column {echo(d)} is neither GPU<n> (up to 4 "
                "digits) nor a NIC name (letters, digits, '.', '_', '-')"
            )
    return _Header(header_at, devices, _info_names(words[n_dev:]))


def _read_rows(lines: list[str], header: _Header, source: str):
    """(link tokens by row label, information values by row label, the line index after the
    matrix). Rows run until a blank line or a line that is not a device row."""
    devices, n_dev = header.devices, len(header.devices)
    rows: dict[str, list[str]] = {}
    row_info: dict[str, dict[str, str]] = {}
    for at in range(header.at + 1, len(lines)):
        cells = lines[at].split()
        where = f"{source}:{at + 1}"
        if not cells:
            return rows, row_info, at
        label = cells[0]
        if label not in devices:
            if len(cells) > 1 and (is_link_token(label) or is_link_token(cells[1])):
                raise UserError(
                    f"{where}: expected a row starting with one of {devices[0]}..{devices[-1]}, "
                    f"found {echo(label)} (header cut, or a row wrapped by a narrow terminal?)"
                )
            return rows, row_info, at
        if label in rows:
            raise UserError(f"{where}: row {label} appears twice")
        links = cells[1 : 1 + n_dev]
        _check_links(links, label, devices, where)
        rows[label] = [normalise_token(t) for t in links]
        row_info[label] = _row_values(cells[1 + n_dev :], header.info, where)
    return rows, row_info, len(lines)


def _check_links(links: list[str], label: str, devices: list[str], where: str) -> None:
    """One row's link cells: one per device, each a known token, X on the diagonal."""
    if len(links) < len(devices):
        raise UserError(
            f"{where}: expected {len(devices)} link cells in row {label} "
            f"({devices[0]}..{devices[-1]}), found {len(links)} (line cut or wrapped?)"
        )
    for col, token in zip(devices, links, strict=True):
        if not is_link_token(token):
            raise UserError(
                f"{where}: unknown link token {echo(token)} in row {label}, column {col} "
                "(expected X, NV<n>, PIX, PXB, PHB, NODE or SYS)"
            )
        if nvlink_problem(token):
            raise UserError(f"{where}: row {label}, column {col}: {nvlink_problem(token)}")
        if (token == "X") != (col == label):  # off it, X had no bandwidth: a traceback
            raise UserError(f"{where}: X belongs on the diagonal only (row {label}, column {col})")


def _row_values(rest: list[str], info: list[str], where: str) -> dict[str, str]:
    """The information cells after the links, by column name (each checked)."""
    values: dict[str, str] = {}
    for column, value in zip(info, rest, strict=False):
        _check_info(value, column, where)
        values[column] = value
    return values


def _nic_legend(lines: list[str], start: int, source: str) -> dict[str, str]:
    """`NIC0: mlx5_0` lines after the matrix (from line index `start`): the NICs' real names,
    each one a device name (it is pinned in NCCL_IB_HCA, whose separators it may not hold)."""
    legend: dict[str, str] = {}
    for at in range(start, len(lines)):
        m = _NIC_LEGEND.match(lines[at])
        if not m:
            continue
        if not NIC_NAME.fullmatch(m.group(2)):
            raise UserError(
                f"{source}:{at + 1}: NIC Legend name {echo(m.group(2))} of {cut(m.group(1))} is "
                "not a device name (letters, digits, '.', '_', '-'; at most 64)"
            )
        legend[m.group(1)] = m.group(2)
    return legend


def _topology(header: _Header, rows, row_info, legend: dict[str, str], source) -> SmiTopology:
    """The checked matrix as GPUs in index order, NIC names and the three link blocks."""
    devices = header.devices
    gpu_cols = [d for d in devices if _GPU_LABEL.match(d)]
    nic_cols = [d for d in devices if not _GPU_LABEL.match(d)]
    if not gpu_cols:
        raise UserError(f"{source}:{header.at + 1}: expected at least one GPU column")
    gpu_cols.sort(key=lambda d: int(d[3:]))
    for a, b in zip(gpu_cols, gpu_cols[1:], strict=False):
        if int(a[3:]) == int(b[3:]):  # GPU0 and GPU00: two ranks pinned to one device
            raise UserError(f"{source}:{header.at + 1}: {a} and {b} are one GPU index")
    idx = {d: devices.index(d) for d in devices}
    _check_symmetric(devices, rows, header.at, source)
    topo = SmiTopology(extra_columns=[c for c in header.info if c not in _KNOWN])
    for d in gpu_cols:
        vals = row_info[d]
        topo.gpus.append(
            Gpu(
                index=int(d[3:]),
                cpu_affinity=vals.get("CPU Affinity"),
                numa_affinity=vals.get("NUMA Affinity"),
                gpu_numa_id=vals.get("GPU NUMA ID"),
            )
        )
        topo.gpu_links.append([rows[d][idx[e]] for e in gpu_cols])
        topo.gpu_nic_links.append([rows[d][idx[e]] for e in nic_cols])
    topo.nic_labels = nic_cols
    topo.nic_names = [legend.get(d, d) for d in nic_cols]
    topo.nic_links = [[rows[d][idx[e]] for e in nic_cols] for d in nic_cols]
    return topo


def _check_symmetric(devices: list[str], rows: dict, at: int, source: str) -> None:
    """A link reads the same both ways in nvidia-smi's matrix; one that does not (a row
    edited or pasted from two machines) was read from the upper triangle alone and planned.
    Named at the later of the two rows' lines (rows follow the header, ``at``, line by line)."""
    line = {label: at + 2 + n for n, label in enumerate(rows)}
    for i, a in enumerate(devices):
        for j in range(i + 1, len(devices)):
            b = devices[j]
            if rows[a][j] != rows[b][i]:
                first, later = sorted(((a, j), (b, i)), key=lambda r: line[r[0]])
                raise UserError(
                    f"{source}:{line[later[0]]}: {later[0]} to {first[0]} reads "
                    f"{echo(rows[later[0]][later[1]])} but {first[0]} to {later[0]} (line "
                    f"{line[first[0]]}) reads {echo(rows[first[0]][first[1]])}: the matrix is "
                    "not symmetric"
                )


_KNOWN = {" ".join(p) for p in _INFO_COLUMNS}
