"""Parse `ibstat` and `ibv_devinfo`: which HCAs a node has, which ports are up, how fast.

A NIC that nvidia-smi lists may still be useless for the ring: its port can be down, or it may
not be an RDMA device at all. Ethernet (RoCE) ports are told apart by `link_layer`, never by
`transport`, because `ibv_devinfo` prints `transport: InfiniBand (0)` for RoCE ports too.
"""

from __future__ import annotations

import re

from ..errors import UserError
from .model import Hca, Port

__all__ = ["parse_hca_text", "parse_ibstat", "parse_ibv_devinfo"]

_CA = re.compile(r"^CA\s+'([^']+)'\s*$")
_PORT = re.compile(r"^Port\s+(\d+)\s*:\s*$")
_KEY = re.compile(r"^([A-Za-z_][\w ]*?)\s*:\s*(.*)$")
_NUMBER = re.compile(r"[\d.]+")


def _is_prompt(line: str) -> bool:
    return line.lstrip().startswith(("$", "#"))


def _number(value: str, where: str) -> float:
    m = _NUMBER.match(value.strip())
    if not m:
        raise UserError(f"{where}: expected a number, found {value!r}")
    return float(m.group(0))


def parse_ibstat(text: str, source: str = "<ibstat>") -> list[Hca]:
    """HCAs of `ibstat` output: `CA 'mlx5_0'` blocks with indented `Port N:` sections."""
    hcas: list[Hca] = []
    port: Port | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{source}:{n}"
        if not line or (not hcas and _is_prompt(raw)):
            continue
        if m := _CA.match(line):
            hcas.append(Hca(name=m.group(1)))
            port = None
            continue
        if not hcas:
            raise UserError(f"{where}: expected a line CA 'NAME' before {line!r}")
        if m := _PORT.match(line):
            port = Port(number=int(m.group(1)))
            hcas[-1].ports.append(port)
            continue
        m = _KEY.match(line)
        if not m:
            raise UserError(f"{where}: expected 'Key: value', found {line!r}")
        if port is None:
            continue  # CA-level facts (type, firmware, GUIDs) are not needed
        key, value = m.group(1).lower(), m.group(2).strip()
        if key == "state":
            port.state = value
        elif key == "physical state":
            port.phys_state = value
        elif key == "rate":
            port.rate_gbps = _number(value, where)
        elif key == "link layer":
            port.link_layer = value
    return hcas


def parse_ibv_devinfo(text: str, source: str = "<ibv_devinfo>") -> list[Hca]:
    """HCAs of `ibv_devinfo` (plain or -v): `hca_id:` blocks with `port:` sections.

    Plain output has no rate; with -v, `active_width` x `active_speed` gives it.
    """
    hcas: list[Hca] = []
    port: Port | None = None
    width: float | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{source}:{n}"
        if not line or (not hcas and _is_prompt(raw)):
            continue
        m = _KEY.match(line)
        if not m:
            if hcas:
                continue  # -v prints GID tables and other free text
            raise UserError(f"{where}: expected 'hca_id: NAME', found {line!r}")
        key, value = m.group(1).lower(), m.group(2).strip()
        if key == "hca_id":
            hcas.append(Hca(name=value))
            port = None
            continue
        if not hcas:
            raise UserError(f"{where}: expected 'hca_id: NAME' before {line!r}")
        if key == "port":
            port = Port(number=int(_number(value, where)))
            hcas[-1].ports.append(port)
            width = None
            continue
        if port is None:
            continue
        if key == "state":
            port.state = value.split()[0] if value else ""
        elif key == "phys_state":
            port.phys_state = value.split()[0] if value else None
        elif key == "link_layer":
            port.link_layer = value
        elif key == "active_width":
            width = _number(value, where)  # "4X (2)"
        elif key == "active_speed" and width is not None:
            port.rate_gbps = width * _number(value, where)  # "25.0 Gbps (32)"
    return hcas


def parse_hca_text(text: str, source: str = "<hca>") -> list[Hca]:
    """Either format, told apart by its first meaningful line."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or _is_prompt(raw):
            continue
        if line.startswith("hca_id"):
            return parse_ibv_devinfo(text, source)
        return parse_ibstat(text, source)
    return []
