"""The device table: what one rank's device can compute and hold.

Nominal GPU entries ship in ``data/devices.json`` with their datasheet sources. A calibrated
entry (``ringctl plan --calibrate``) replaces nominal peaks with measured block-kernel
throughput on this machine and is stored in the user's device file, which overrides the table
entry by entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import UserError

USER_DEVICES = Path(os.environ.get("RINGCTL_DEVICES", "~/.config/ringctl/devices.json"))


@dataclass(frozen=True)
class Device:
    name: str
    mem_gib: float
    tflops: dict[str, float]  # peak dense throughput by dtype name
    attention_efficiency: tuple[float, float] = (0.5, 0.4)  # forward, backward share of peak
    reserve_gib: float = 2.0  # runtime context, allocator slack, communication buffers
    source: str = ""
    nvlink_gbytes_s: float = 0.0  # per direction; 0: no NVLink
    pcie_gbytes_s: float = 0.0
    # Calibrated entries only: measured throughput of one rank's block kernel, GFLOP/s, by
    # (tokens per rank) -> (forward, backward); and the cores the ranks share.
    measured_gflops: dict[int, tuple[float, float]] = field(default_factory=dict)
    cores: int | None = None
    threads_per_rank: int = 1
    p2p_gbytes_s: float | None = None  # measured rank-to-rank bandwidth, GB/s
    p2p_latency_s: float = 0.0

    def attention_flops_per_s(self, dtype: str, tokens_per_rank: int, ranks_on_host: int = 1):
        """(forward, backward) FLOP/s one rank sustains on blocks of this size."""
        if self.measured_gflops:
            sizes = sorted(self.measured_gflops)
            nearest = min(sizes, key=lambda s: abs(s - tokens_per_rank))
            fwd, bwd = self.measured_gflops[nearest]
            share = 1.0
            if self.cores:  # ranks oversubscribing the cores share them
                share = min(1.0, self.cores / max(1, ranks_on_host * self.threads_per_rank))
            return fwd * 1e9 * share, bwd * 1e9 * share
        if dtype not in self.tflops:
            raise UserError(f"device {self.name!r} has no throughput for dtype {dtype!r}")
        peak = self.tflops[dtype] * 1e12
        return peak * self.attention_efficiency[0], peak * self.attention_efficiency[1]

    def to_json(self) -> dict:
        entry = {
            "source": self.source,
            "mem_gib": self.mem_gib,
            "tflops": self.tflops,
            "attention_efficiency": list(self.attention_efficiency),
            "reserve_gib": self.reserve_gib,
            "nvlink_gbps": self.nvlink_gbytes_s,
            "pcie_gbps": self.pcie_gbytes_s,
        }
        if self.measured_gflops:
            entry.update(
                measured_gflops={str(k): list(v) for k, v in self.measured_gflops.items()},
                cores=self.cores,
                threads_per_rank=self.threads_per_rank,
                p2p_gbytes_s=self.p2p_gbytes_s,
                p2p_latency_s=self.p2p_latency_s,
            )
        return entry


def _device_from_json(name: str, entry: dict, where: str) -> Device:
    try:
        measured = {
            int(k): (float(v[0]), float(v[1])) for k, v in entry.get("measured_gflops", {}).items()
        }
        return Device(
            name=name,
            mem_gib=float(entry["mem_gib"]),
            tflops={k: float(v) for k, v in entry.get("tflops", {}).items()},
            attention_efficiency=tuple(entry.get("attention_efficiency", (0.5, 0.4))),
            reserve_gib=float(entry.get("reserve_gib", 2.0)),
            source=entry.get("source", ""),
            nvlink_gbytes_s=float(entry.get("nvlink_gbps", 0.0)),
            pcie_gbytes_s=float(entry.get("pcie_gbps", 0.0)),
            measured_gflops=measured,
            cores=entry.get("cores"),
            threads_per_rank=int(entry.get("threads_per_rank", 1)),
            p2p_gbytes_s=entry.get("p2p_gbytes_s"),
            p2p_latency_s=float(entry.get("p2p_latency_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise UserError(f"{where}: device {name!r}: bad or missing field ({err})") from None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such device file") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object of device entries")
    return data


def load_devices(extra: Path | None = None) -> dict[str, Device]:
    """The shipped table, then the user's calibrated file, then ``extra``; later wins."""
    table = json.loads(resources.files(__package__).joinpath("data/devices.json").read_text())
    sources: list[tuple[dict, str]] = [(table, "ringctl/planner/data/devices.json")]
    user = USER_DEVICES.expanduser()
    if user.exists():
        sources.append((_read(user), str(user)))
    if extra is not None:
        sources.append((_read(extra), str(extra)))
    devices: dict[str, Device] = {}
    for data, where in sources:
        for name, entry in data.items():
            if not name.startswith("_"):
                devices[name] = _device_from_json(name, entry, where)
    return devices


def get_device(name: str, extra: Path | None = None) -> Device:
    devices = load_devices(extra)
    if name not in devices:
        raise UserError(f"unknown device {name!r}; known: {', '.join(sorted(devices))}")
    return devices[name]


def save_user_device(device: Device, path: Path | None = None) -> Path:
    path = (path or USER_DEVICES).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path) if path.exists() else {}
    data[device.name] = device.to_json()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path
