"""The device table: what one rank's device can compute and hold.

Nominal GPU entries ship in ``data/devices.json`` with their datasheet sources. A calibrated
entry (``ringctl plan --calibrate``) replaces nominal peaks with measured block-kernel
throughput on this machine and is stored in the user's device file, which overrides the table
entry by entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import UserError
from ..text import cut

USER_DEVICES = Path(os.environ.get("RINGCTL_DEVICES", "~/.config/ringctl/devices.json"))


# The three block shapes a ring step computes (see ringattn.ring.block_plan), as
# (share of n query rows, share of n key rows, causal): a whole block, the diagonal block of
# a causal mask (half the FLOPs), and the half block of every later zigzag step.
BLOCK_KINDS = {"full": (1.0, 1.0, False), "diag": (1.0, 1.0, True), "half": (0.5, 1.0, False)}


def block_flops(kind: str, n: float, *, batch: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of one block of n tokens per rank (backward: 2.5 times these)."""
    full = 4.0 * batch * heads * n * n * head_dim
    return full if kind == "full" else full / 2


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
    # Share of peak the projections' and MLP's matmuls reach (whole-model time).
    matmul_efficiency: float = 0.6
    # The inter-node network of the device's reference system: one NIC per GPU.
    net_gbit: float = 400.0
    net_name: str = "NDR InfiniBand"
    net_latency_s: float = 5e-6
    nvlink_latency_s: float = 3e-6
    gpus_per_node: int = 8  # the NVLink (or PCIe) domain of one node
    efficiency_source: str = ""
    # Calibrated entries only: measured seconds of one ring step's block work (kernel plus the
    # merge or gradient accumulation around it), forward and backward, by head dim, block kind
    # and tokens per rank, for one sequence of `calib_heads` heads, with every core busy. By
    # head dim because a CPU kernel's rate depends on it (heads of 16 run at about 0.6x the
    # FLOP rate of heads of 64): a job is priced from the tables around its own head dim.
    block_seconds: dict[int, dict[str, dict[int, tuple[float, float]]]] = field(
        default_factory=dict
    )
    calib_heads: int = 8
    cores: int | None = None
    threads_per_rank: int = 1
    p2p_gbytes_s: float | None = None  # measured rank-to-rank bandwidth, GB/s
    p2p_latency_s: float = 0.0
    # Fixed seconds per ring step (forward, backward) by ranks on this host: what a step
    # costs besides its block (rank checks, transfers posted and waited on, scheduling).
    step_overhead_s: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Calibrated entries only: GB/s one rank writes through a layer's elementwise ops (norms,
    # RoPE, activations, residuals; planner.calibrate times them) with every core busy. On a
    # CPU these memory-bound ops cost more than a small model's matmuls (a fifth of a tiny
    # Mistral's scoring time at 256k tokens per rank); None: not priced (datasheet entries).
    elementwise_gbytes_s: float | None = None
    # Calibrated entries only: TFLOP/s of a (tokens x w) @ (w x w) matmul by the width w it sums
    # over, in the dtype of ``tflops``, with every core busy. A CPU runs a 64-wide projection at
    # about a quarter of a 1024-wide one's rate; {}: every matmul at tflops x matmul_efficiency.
    matmul_tflops_by_width: dict[int, float] = field(default_factory=dict)

    def matmul_rate(self, dtype: str, inner: int | None, ranks_on_host: int = 1) -> float:
        """FLOP/s of one rank's matmul summing over ``inner`` values (None: over tokens, as a
        weight gradient does: the widest measured rate), shared beyond the cores. Between two
        measured widths the rate is interpolated in log-log; beyond them, the nearest one."""
        if dtype not in self.tflops:
            raise UserError(f"device {self.name!r} has no throughput for dtype {dtype!r}")
        table = self.matmul_tflops_by_width
        if not table:
            tflops = self.tflops[dtype]
        else:
            width = max(table) if inner is None else inner
            lo, hi = _around(table, width)
            tflops = _log_mix(width, lo, hi, table[lo], table[hi])
        return tflops * self.matmul_efficiency * 1e12 / self.time_shared(ranks_on_host)

    def step_overhead(self, ranks_on_host: int) -> tuple[float, float]:
        if not self.step_overhead_s:
            return (0.0, 0.0)
        nearest = min(self.step_overhead_s, key=lambda r: (abs(r - ranks_on_host), -r))
        return self.step_overhead_s[nearest]

    def block_time(
        self,
        kind: str,
        n: float,
        *,
        dtype: str,
        batch: int,
        heads: int,
        head_dim: int,
        ranks_on_host: int = 1,
    ) -> tuple[float, float]:
        """(forward, backward) seconds one rank spends on a block of this kind and size."""
        flops = block_flops(kind, n, batch=batch, heads=heads, head_dim=head_dim)
        if not self.block_seconds:
            if dtype not in self.tflops:
                raise UserError(f"device {self.name!r} has no throughput for dtype {dtype!r}")
            peak = self.tflops[dtype] * 1e12
            return (
                flops / (peak * self.attention_efficiency[0]),
                2.5 * flops / (peak * self.attention_efficiency[1]),
            )
        fwd, bwd = self._table_time(kind, n, head_dim)
        scale = batch * heads / self.calib_heads  # FLOPs and bytes are linear in these
        if self.cores:  # ranks beyond the cores time-share them
            scale *= self.time_shared(ranks_on_host)
        return fwd * scale, bwd * scale

    def time_shared(self, ranks_on_host: int) -> float:
        """How much slower each rank runs when its host's ranks want more threads than it
        has cores (a calibrated CPU entry: 1 up to one thread per core)."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks_on_host * self.threads_per_rank / self.cores)

    def _table_time(self, kind: str, n: float, head_dim: int) -> tuple[float, float]:
        """Calibrated seconds of a block at ``head_dim`` for ``calib_heads`` heads: the
        measured tables at the nearest head dims, each scaled linearly to ``head_dim`` (the
        FLOPs), interpolated between the two around it in log(head dim) (the kernel's rate
        changes with it); beyond the measured head dims, the nearest one alone."""
        lo, hi = _around(self.block_seconds, head_dim)
        at_lo = [t * head_dim / lo for t in _interpolate(self.block_seconds[lo][kind], n)]
        at_hi = [t * head_dim / hi for t in _interpolate(self.block_seconds[hi][kind], n)]
        pairs = zip(at_lo, at_hi, strict=True)
        f, b = (_log_mix(head_dim, lo, hi, a, c) for a, c in pairs)
        return f, b

    def rect_time(
        self,
        rows: float,
        keys: float,
        *,
        dtype: str,
        batch: int,
        heads: int,
        head_dim: int,
        ranks_on_host: int = 1,
    ) -> tuple[float, float]:
        """(forward, backward) seconds of a rows x keys block with no mask: the whole block
        of the square side with as many scores (the FLOPs are the same; a calibrated table
        is read at that side)."""
        side = (rows * keys) ** 0.5
        shape = dict(batch=batch, heads=heads, head_dim=head_dim, ranks_on_host=ranks_on_host)
        return self.block_time("full", side, dtype=dtype, **shape)

    def to_json(self) -> dict:
        entry = {
            "source": self.source,
            "mem_gib": self.mem_gib,
            "tflops": self.tflops,
            "attention_efficiency": list(self.attention_efficiency),
            "reserve_gib": self.reserve_gib,
            "nvlink_gbps": self.nvlink_gbytes_s,
            "pcie_gbps": self.pcie_gbytes_s,
            "matmul_efficiency": self.matmul_efficiency,
            "net_gbit": self.net_gbit,
            "net_name": self.net_name,
            "net_latency_s": self.net_latency_s,
            "nvlink_latency_s": self.nvlink_latency_s,
            "gpus_per_node": self.gpus_per_node,
            "efficiency_source": self.efficiency_source,
        }
        if self.block_seconds:
            entry.update(
                block_seconds={
                    str(d): {
                        kind: {str(n): list(t) for n, t in sizes.items()}
                        for kind, sizes in table.items()
                    }
                    for d, table in self.block_seconds.items()
                },
                calib_heads=self.calib_heads,
                cores=self.cores,
                threads_per_rank=self.threads_per_rank,
                p2p_gbytes_s=self.p2p_gbytes_s,
                p2p_latency_s=self.p2p_latency_s,
                step_overhead_s={str(r): list(t) for r, t in self.step_overhead_s.items()},
                elementwise_gbytes_s=self.elementwise_gbytes_s,
                matmul_tflops_by_width={str(w): t for w, t in self.matmul_tflops_by_width.items()},
            )
        return entry


def _interpolate(table: dict[int, tuple[float, float]], n: float) -> tuple[float, float]:
    """Seconds at n from measured sizes: log-log between neighbours; beyond the ends, the
    nearest measured size scaled as n^2 (the FLOPs)."""
    sizes = sorted(table)
    if n <= sizes[0] or n >= sizes[-1]:
        edge = sizes[0] if n <= sizes[0] else sizes[-1]
        f = (n / edge) ** 2
        return table[edge][0] * f, table[edge][1] * f
    lo, hi = _around(sizes, n)
    return tuple(  # type: ignore[return-value]
        _log_mix(n, lo, hi, a, b) for a, b in zip(table[lo], table[hi], strict=True)
    )


def _around(measured, x: float) -> tuple[int, int]:
    """The measured points (keys) around x: (x's own, x's own) where it was measured, the
    nearest one twice beyond the ends."""
    points = sorted(measured)
    lo = max((p for p in points if p <= x), default=points[0])
    hi = min((p for p in points if p >= x), default=points[-1])
    return lo, hi


def _log_mix(x: float, lo: float, hi: float, at_lo: float, at_hi: float) -> float:
    """The value at x between (lo, at_lo) and (hi, at_hi), linear in log-log (at_lo when the
    two points are one)."""
    if hi == lo:
        return at_lo
    u = math.log(x / lo) / math.log(hi / lo)
    return math.exp((1 - u) * math.log(at_lo) + u * math.log(at_hi))


MIN_SHARE = 1e-3  # a kernel at a thousandth of peak; 1e-320 made every time infinite


def share_problem(values) -> str | None:
    """Why efficiencies (shares of peak) are not, or None: each in [MIN_SHARE, 1]. The one
    rule of device files and `ringctl plan`'s --attention-efficiency / --matmul-efficiency."""
    if all(isinstance(v, (int, float)) and MIN_SHARE <= v <= 1 for v in values):
        return None
    return f"must be shares of peak in [{MIN_SHARE:g}, 1], got {list(values)}"


def _check_shares(device: Device, where: str) -> Device:
    shares = {
        "attention_efficiency": device.attention_efficiency,
        "matmul_efficiency": (device.matmul_efficiency,),
    }
    for key, values in shares.items():
        size = 2 if key == "attention_efficiency" else 1
        why = share_problem(values) if len(values) == size else f"needs {size} values"
        if why:
            raise UserError(f"{where}: device {device.name!r}: {key} {why}")
    return device


def _device_from_json(name: str, entry: dict, where: str) -> Device:
    return _check_shares(_check_magnitudes(_parse_device(name, entry, where), where), where)


# No device figure (GiB, TFLOP/s, GB/s, Gbit/s, seconds, counts) is outside these bounds; a
# 1e-300 TFLOP/s or a mem_gib of 1e308 made every plan absurd (or "fits") without a word.
PLAUSIBLE = (1e-12, 1e12)


def _check_magnitudes(device: Device, where: str) -> Device:
    """Refuse a number that is not finite (JSON's NaN and Infinity parse as floats) or not
    0 and outside PLAUSIBLE, a memory that is not positive and a reserve not below it: any
    would win or break every plan silently."""
    low, high = PLAUSIBLE
    for item in dataclasses.fields(device):
        value = getattr(device, item.name)
        numbers = _numbers(value)
        if not all(math.isfinite(v) for v in numbers):
            raise UserError(
                f"{where}: device {device.name!r}: bad field {item.name} ({value!r}: not finite)"
            )
        if not all(v == 0 or low <= abs(v) <= high for v in numbers):
            raise UserError(
                f"{where}: device {device.name!r}: bad field {item.name} "
                f"({cut(repr(value), 80)}: each figure is 0 or between {low:g} and {high:g})"
            )
    if device.mem_gib <= 0:
        raise UserError(f"{where}: device {device.name!r}: bad field mem_gib ({device.mem_gib!r})")
    if device.reserve_gib >= device.mem_gib:  # nothing left for a rank: every plan refused
        raise UserError(
            f"{where}: device {device.name!r}: bad field reserve_gib ({device.reserve_gib:g}: "
            f"not less than mem_gib, {device.mem_gib:g})"
        )
    return device


def _numbers(value) -> list[float]:
    """The numbers in a field as floats: itself, or those in its tuple or (nested) dict
    values (an int past any float's range reads as infinite)."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, int) and not isinstance(value, bool):
        return [float(value) if abs(value) < 10**300 else math.inf]
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _numbers(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in _numbers(item)]
    return []


def _parse_device(name: str, entry: dict, where: str) -> Device:
    """An entry of a device file, each field checked by its kind (``_number``, ``_count``):
    a negative rate, latency or reserve, a tflops of 0 or a string "10" where a number goes
    gave negative times, a division by zero or a traceback in every plan."""
    try:
        if not isinstance(entry, dict):
            raise ValueError(f"the entry must be a JSON object, got {cut(repr(entry), 40)}")
        blocks, heads = _block_tables(entry)
        mem = _number(entry["mem_gib"], "mem_gib", positive=True)
        reserve = _number(entry.get("reserve_gib", 2.0), "reserve_gib", positive=False)
        return Device(
            name=name,
            mem_gib=mem,
            tflops=_rates(entry.get("tflops", {}), "tflops"),
            attention_efficiency=tuple(
                _real(v, "attention_efficiency")
                for v in _pair(
                    entry.get("attention_efficiency", (0.5, 0.4)), "attention_efficiency"
                )
            ),
            reserve_gib=reserve,
            source=str(entry.get("source", "")),
            nvlink_gbytes_s=_number(entry.get("nvlink_gbps", 0.0), "nvlink_gbps", positive=False),
            pcie_gbytes_s=_number(entry.get("pcie_gbps", 0.0), "pcie_gbps", positive=False),
            matmul_efficiency=_real(entry.get("matmul_efficiency", 0.6), "matmul_efficiency"),
            net_gbit=_number(entry.get("net_gbit", 400.0), "net_gbit", positive=True),
            net_name=str(entry.get("net_name", "NDR InfiniBand")),
            net_latency_s=_number(
                entry.get("net_latency_s", 5e-6), "net_latency_s", positive=False
            ),
            nvlink_latency_s=_number(
                entry.get("nvlink_latency_s", 3e-6), "nvlink_latency_s", positive=False
            ),
            gpus_per_node=_count(entry.get("gpus_per_node", 8), "gpus_per_node"),
            efficiency_source=str(entry.get("efficiency_source", "")),
            block_seconds=blocks,
            calib_heads=heads,
            cores=None if entry.get("cores") is None else _count(entry["cores"], "cores"),
            threads_per_rank=_count(entry.get("threads_per_rank", 1), "threads_per_rank"),
            p2p_gbytes_s=_positive_or_none(entry.get("p2p_gbytes_s"), "p2p_gbytes_s"),
            p2p_latency_s=_number(entry.get("p2p_latency_s", 0.0), "p2p_latency_s", positive=False),
            step_overhead_s={
                _count(_key(r, "step_overhead_s"), "step_overhead_s (ranks)"): tuple(
                    _number(v, "step_overhead_s", positive=False)
                    for v in _pair(t, "step_overhead_s")
                )
                for r, t in _object(entry.get("step_overhead_s", {}), "step_overhead_s").items()
            },
            elementwise_gbytes_s=_positive_or_none(
                entry.get("elementwise_gbytes_s"), "elementwise_gbytes_s"
            ),
            matmul_tflops_by_width={
                _positive_int(w, "matmul_tflops_by_width"): _positive(t, "matmul_tflops_by_width")
                for w, t in entry.get("matmul_tflops_by_width", {}).items()
            },
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise UserError(f"{where}: device {name!r}: bad or missing field ({err})") from None


def _number(value, key: str, *, positive: bool) -> float:
    """A JSON number of the entry (not a string, not a bool): more than 0 for a rate, a
    memory or a measured time (``positive``), at least 0 for a latency, an overhead or a
    reserve. NaN and infinities pass here: ``_check_magnitudes`` names them."""
    value = _real(value, key)
    if math.isfinite(value) and (value < 0 or (positive and value == 0)):
        raise ValueError(f"{key}: {value!r} is not {'positive' if positive else 'at least 0'}")
    return float(value)


def _real(value, key: str) -> float:
    """A JSON number (a string "10" or true is none); its range is the caller's."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: {cut(repr(value), 40)} is not a number")
    return float(value)


def _count(value, key: str) -> int:
    """A whole number of the entry, at least 1 (cores, GPUs per node, ranks, threads)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: {cut(repr(value), 40)} is not a whole number >= 1")
    return value


def _key(text: str, key: str) -> int:
    """A JSON object's key that is a number ("1024" tokens, "2" ranks)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}: key {cut(repr(text), 40)} is not a whole number") from None


def _object(value, key: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{key}: {cut(repr(value), 40)} is not a JSON object")
    return value


def _pair(value, key: str) -> tuple:
    """A (forward, backward) pair: a list of two."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{key}: {cut(repr(value), 40)} is not a pair (forward, backward)")
    return tuple(value)


def _rates(value, key: str) -> dict[str, float]:
    """{dtype: TFLOP/s}, each positive (a peak of 0 divided every time by zero)."""
    return {str(k): _number(v, f"{key}.{k}", positive=True) for k, v in _object(value, key).items()}


def _positive_or_none(value, key: str) -> float | None:
    return None if value is None else _positive(value, key)


def _positive(value, key: str) -> float:
    return _number(value, key, positive=True)


def _positive_int(value, key: str) -> int:
    if int(value) <= 0:
        raise ValueError(f"{key}: widths must be positive, got {value!r}")
    return int(value)


def _block_tables(entry: dict) -> tuple[dict, int]:
    """(tables by head dim, heads) of an entry's ``block_seconds``: keyed by head dim, or, as
    entries calibrated before head dims were measured store it, one table of block kinds at
    ``calib_shape`` = (batch 1, heads, head dim). Every kind's table has at least one size,
    each a positive number of tokens with positive (forward, backward) seconds."""
    raw = _object(entry.get("block_seconds", {}), "block_seconds")
    if set(raw) & set(BLOCK_KINDS):
        batch, heads, head_dim = entry.get("calib_shape", (1, 8, 64))
        if int(batch) != 1:
            raise ValueError(f"calib_shape batch {batch} (expected 1)")
        raw, heads = {head_dim: raw}, heads
    else:
        heads = entry.get("calib_heads", 8)
    tables = {
        _count(_key(d, "block_seconds") if isinstance(d, str) else d, "block_seconds (head dim)"): {
            kind: _block_table(_object(table, "block_seconds")[kind], f"block_seconds.{kind}")
            for kind in BLOCK_KINDS
        }
        for d, table in raw.items()
    }
    return tables, _count(heads, "calib_heads")


def _block_table(table, key: str) -> dict[int, tuple[float, float]]:
    """{tokens: (forward, backward) seconds} of one block kind: not empty, all positive."""
    rows = {
        _count(_key(n, key), f"{key} (tokens)"): tuple(
            _number(t, key, positive=True) for t in _pair(times, key)
        )
        for n, times in _object(table, key).items()
    }
    if not rows:
        raise ValueError(f"{key}: no measured sizes")
    return rows  # type: ignore[return-value]


MAX_DEVICE_FILE_BYTES = 16 << 20  # a device file is kilobytes; a file this large is not one


def read_json_file(path: Path, what: str, limit: int = MAX_DEVICE_FILE_BYTES):
    """The JSON of a file the user names (a device file, a `ringctl topo` plan), read through
    the project's bounded reader: a regular file (a FIFO there hung every plan, /dev/zero
    filled the memory), within ``limit`` bytes, UTF-8. A link is followed (a dotfile may be
    one) to a regular file. A UserError of one line naming the file otherwise."""
    from ..bounded_read import read_regular

    path = Path(path).expanduser()
    real = path.resolve()
    try:
        data = json.loads(read_regular(real, limit).decode("utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: unreadable {what} (not UTF-8 text: {err.reason})") from None
    except (ValueError, OSError) as err:
        said = str(err).removeprefix(f"{real}: ")  # the reader names the file it opened
        raise UserError(f"{path}: unreadable {what} ({said})") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise UserError(f"{path}: unreadable {what} (nested too deeply to parse)") from None
    return data


def _read(path: Path) -> dict:
    data = read_json_file(path, "device file")
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
