"""Parse `ibstat` and `ibv_devinfo`: which HCAs a node has, which ports are up, how fast.

A NIC that nvidia-smi lists may still be useless for the ring: its port can be down, or it may
not be an RDMA device at all. Ethernet (RoCE) ports are told apart by `link_layer`, never by
`transport`, because `ibv_devinfo` prints `transport: InfiniBand (0)` for RoCE ports too.
"""

from __future__ import annotations

import re

from ..errors import UserError
from ..text import echo
from .model import NIC_NAME, Hca, Port

__all__ = ["parse_hca_text", "parse_ibstat", "parse_ibv_devinfo"]

_CA = re.compile(r"^CA\s+'([^']+)'\s*$")
_PORT = re.compile(r"^Port\s+([0-9]{1,3})\s*:\s*$")  # an HCA port number is 1-255
_KEY = re.compile(r"^([A-Za-z_][\w ]*?)\s*:\s*(.*)$")
_NUMBER = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")  # ASCII digits: float() takes '١' too
MAX_PORT = 255


def _is_prompt(line: str) -> bool:
    return line.lstrip().startswith(("$", "#"))


def _number(value: str, where: str) -> float:
    m = _NUMBER.match(value.strip())
    if not m:
        raise UserError(f"{where}: expected a number, found {echo(value)}")
    return float(m.group(0))


def _rate_factor(value: str, where: str) -> float | None:
    """An `active_width` or `active_speed` of `ibv_devinfo -v` as a number, None when it says
    `invalid width`/`invalid speed (0)`: rdma-core's words for a code it does not know (a down
    port, or an XDR port read by an older rdma-core). That port's rate is unknown; refusing
    the whole file failed the placement of every node with one idle port."""
    if value.strip().lower().startswith("invalid"):
        return None
    return _number(value, where)


def _port_number(value: str, where: str) -> int:
    number = _number(value, where)
    if number != int(number) or not 1 <= number <= MAX_PORT:
        raise UserError(f"{where}: expected a port number 1-{MAX_PORT}, found {echo(value)}")
    return int(number)


def _hca(name: str, where: str) -> Hca:
    """An HCA by its name, a device name: the plan pins it in NCCL_IB_HCA."""
    if not NIC_NAME.fullmatch(name):
        raise UserError(
            f"{where}: HCA name {echo(name)} is not a device name (letters, digits, '.', '_', "
            "'-'; at most 64)"
        )
    return Hca(name=name)


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
            hcas.append(_hca(m.group(1), where))
            port = None
            continue
        if not hcas:
            raise UserError(f"{where}: expected a line CA 'NAME' before {echo(line)}")
        if m := _PORT.match(line):
            port = Port(number=int(m.group(1)))
            hcas[-1].ports.append(port)
            continue
        m = _KEY.match(line)
        if not m:
            raise UserError(f"{where}: expected 'Key: value', found {echo(line)}")
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
            raise UserError(f"{where}: expected 'hca_id: NAME', found {echo(line)}")
        key, value = m.group(1).lower(), m.group(2).strip()
        if key == "hca_id":
            hcas.append(_hca(value, where))
            port = None
            continue
        if not hcas:
            raise UserError(f"{where}: expected 'hca_id: NAME' before {echo(line)}")
        if key == "port":
            port = Port(number=_port_number(value, where))
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
            width = _rate_factor(value, where)  # "4X (2)"
        elif key == "active_speed" and width is not None:
            speed = _rate_factor(value, where)  # "25.0 Gbps (32)"
            port.rate_gbps = None if speed is None else width * speed
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
