"""Random access into a gzip file's inflated bytes, in bounded memory.

gzip has no index: byte X of the inflated stream is reached by inflating everything before it.
A long-document job reads the records of a ``.jsonl.gz`` file in its schedule's order (longest
first), not the file's, so a ``GzipReader`` keeps checkpoints: the inflater's state (zlib's
``Decompress.copy``: its 32 KiB window and little else) every ``CHECKPOINT`` inflated bytes,
and reads a record from the checkpoint before it, as zlib's own ``examples/zran.c`` does. The
checkpoints are taken while the file is first read through (when it is listed), so they cost
no extra pass: 2 GiB of inflated data keeps 512 of them (about 30 MiB). The inflated stretch
between two checkpoints (a window) is kept once read, up to ``WINDOW_CACHE`` bytes for all
files together, so the records of a small file, or neighbours in a large one, are inflated
once.

Every step inflates at most ``STEP`` bytes (zlib's ``max_length``), so a gzip bomb is read one
bounded piece at a time, never whole. Concatenated members (``cat a.gz b.gz``) and zero padding
after a member are read as the ``gzip`` module reads them. Corrupt deflate data, a wrong check
value and a truncated file raise ``GzipError``, which says at which inflated byte.
"""

from __future__ import annotations

import bisect
import io
import itertools
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from ...bounded_read import open_input

CHUNK = 1 << 14  # compressed bytes read at a time (a checkpoint keeps at most this many)
STEP = 1 << 20  # the most inflated bytes one step produces
CHECKPOINT = 4 << 20  # inflated bytes between two checkpoints
WINDOW_CACHE = 64 << 20  # inflated bytes of windows kept, all files together
GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib reads (and checks) the gzip header and trailer


class GzipError(ValueError):
    """Bytes that cannot be inflated: corrupt, truncated, or not gzip at all."""


@dataclass(frozen=True)
class _Point:
    out: int  # inflated offset
    pos: int  # compressed offset of the next byte to read from the file
    pending: bytes = b""  # compressed bytes read but not yet inflated
    inflater: object = None  # zlib's Decompress here (copied before use); None: a member starts


class SizedCache:
    """What was read lately, up to ``limit`` bytes (``size`` of each value) for all its users
    together; the oldest go first, the newest stays whatever its size. Inflated gzip windows
    use one; decoded table batches (``tables.py``) another."""

    def __init__(self, limit: int, size: Callable[[Any], int] = len) -> None:
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()
        self._limit, self._size, self._bytes = limit, size, 0

    def get(self, key: Hashable):
        value = self._kept.get(key)
        if value is not None:
            self._kept.move_to_end(key)
        return value

    def keep(self, key: Hashable, value) -> None:
        if key in self._kept:
            self._bytes -= self._size(self._kept.pop(key))
        self._kept[key] = value
        self._bytes += self._size(value)
        while self._bytes > self._limit and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self._bytes -= self._size(dropped)


_WINDOWS = SizedCache(WINDOW_CACHE)
_READER_IDS = itertools.count()


class GzipReader:
    """The inflated bytes of one gzip file: streamed whole, or read at an offset."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self._id = next(_READER_IDS)  # its windows' key (an id() may be reused)
        self._points = [_Point(0, 0)]

    def stream(self) -> Iterator[bytes]:
        """The whole inflated stream, piece by piece (each at most STEP bytes)."""
        for _, piece in self._inflate(self._points[0]):
            yield piece

    def open(self) -> io.BufferedReader:
        """The whole inflated stream as a binary file (``readline`` with a limit reads a
        bounded piece of a line, however long the line is)."""
        return io.BufferedReader(_Pieces(self.stream()), CHUNK)

    def read(self, offset: int, length: int) -> bytes:
        """``length`` inflated bytes from ``offset``: from the windows that hold them."""
        parts, end = [], offset + length
        while offset < end:
            start, window = self._window_at(offset)
            part = window[offset - start : end - start]
            if not part:
                raise GzipError(f"it ends before inflated byte {end:,}")
            parts.append(part)
            offset += len(part)
        return b"".join(parts)

    def _window_at(self, offset: int) -> tuple[int, bytes]:
        """(start, bytes) of the window holding ``offset`` (the last one if none does): from
        its checkpoint to the next, which reading may take on the way."""
        i = bisect.bisect_right([p.out for p in self._points], offset) - 1
        while True:
            window = _WINDOWS.get((self._id, i))
            if window is None:
                window = self._inflate_window(i)
                _WINDOWS.keep((self._id, i), window)
            start = self._points[i].out
            if offset < start + len(window) or i + 1 == len(self._points):
                return start, window
            i += 1

    def _inflate_window(self, i: int) -> bytes:
        parts = []
        for at, piece in self._inflate(self._points[i]):
            if i + 1 < len(self._points) and at >= self._points[i + 1].out:
                break  # the next checkpoint (known, or just taken on the way)
            parts.append(piece)
        return b"".join(parts)

    def _opened(self):
        """The compressed file, a regular one (never a pipe swapped in: ``open_input``)."""
        try:
            return open_input(self.path)
        except ValueError as err:
            raise GzipError(str(err)) from None

    def _inflate(self, point: _Point) -> Iterator[tuple[int, bytes]]:
        """(inflated offset, bytes) from ``point`` to the end, taking checkpoints past the
        last one on the way."""
        out, pos, data = point.out, point.pos, point.pending
        inflater = point.inflater.copy() if point.inflater is not None else None
        ended = between = False
        with self._opened() as f:
            f.seek(pos)
            while True:
                if not data and not ended:
                    data = f.read(CHUNK)
                    pos, ended = pos + len(data), not data
                if inflater is None:  # a member starts, or (between) zero padding or the end
                    data = data.lstrip(b"\0") if between else data
                    if not data:
                        if ended:
                            return
                        continue
                    inflater = zlib.decompressobj(GZIP_WBITS)
                piece = _step(inflater, data, out)
                if inflater.eof:
                    data, inflater, between = inflater.unused_data, None, True
                else:
                    data = inflater.unconsumed_tail
                    if ended and not data and not piece:
                        raise GzipError(
                            f"truncated: the file ends inside its data, at inflated byte {out:,}"
                        )
                if piece:
                    yield out, piece
                    out += len(piece)
                if inflater is not None and out >= self._points[-1].out + CHECKPOINT:
                    self._points.append(_Point(out, pos, bytes(data), inflater.copy()))


class _Pieces(io.RawIOBase):
    """A raw binary stream over an iterator of byte pieces."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._left:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._left = memoryview(piece)
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


def _step(inflater, data: bytes, out: int) -> bytes:
    try:
        return inflater.decompress(data, STEP)
    except zlib.error as err:
        raise GzipError(f"corrupt gzip data at inflated byte {out:,} ({err})") from None
