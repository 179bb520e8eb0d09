"""How large a table file's data is once inflated, read from its own headers before anything is.

A Parquet or Arrow IPC file is compressed page by page (Parquet) or buffer by buffer (Arrow),
and its readers inflate a whole page or record batch at once: a 26 KB file can hold 800 MiB of
text (``zstd``), and pyarrow would allocate it all before a record's length could be checked.
The sizes are written in the file before the data they describe, so they can be read first:

* Parquet: each page starts with a header (Thrift compact protocol) that gives its inflated
  size and how many values it holds (``parquet_pages``); the footer, which pyarrow reads,
  gives only a column chunk's total, which says nothing about how the values are spread.
* Arrow IPC: each record batch's metadata (a flatbuffer) lists its buffers; a compressed
  buffer starts with its inflated length (``record_batch``, ``inflated_size``).

Everything here reads hostile bytes: every read is bounds-checked, nesting is limited, and
what cannot be parsed is None (unknown), which callers treat as the worst case. Pure Python,
no pyarrow: the callers (``records.py``) hand in bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

HEADER_WINDOW = 1 << 16  # bytes read at a page header while walking a chunk's pages
MAX_HEADER = 1 << 20  # a page header longer than this is no writer's (statistics: 4 KiB)
_DEPTH = 8  # Thrift structs nested deeper than this: unknown

# Parquet's PageType, and the Encodings of a data page that holds dictionary indices
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
PLAIN_DICTIONARY, RLE_DICTIONARY = 2, 8


class MalformedMetadata(ValueError):
    """Bytes that are not what the format says (or run past the end): the size is unknown."""


@dataclass(frozen=True)
class Page:
    """One Parquet page: its kind, the values it holds, its inflated size in bytes, where its
    data is in the file (``stored`` bytes at ``data_at``), and (a data page) its encoding."""

    kind: int
    values: int
    inflated: int
    data_at: int = 0
    stored: int = 0
    encoding: int = -1

    @property
    def indexed(self) -> bool:
        """Whether a data page holds dictionary indices rather than values."""
        return self.encoding in (PLAIN_DICTIONARY, RLE_DICTIONARY)


# --- Thrift compact protocol: Parquet page headers ---------------------------------------------


class _Compact:
    """A reader of Thrift's compact protocol over bytes, just enough for a PageHeader: the
    scalar fields of a struct by id, nested structs as dicts, everything else skipped."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise MalformedMetadata("past the end")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise MalformedMetadata("varint too long")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self, depth: int = 0) -> dict[int, object]:
        """{field id: int, or a nested struct's dict} of one struct (other fields skipped)."""
        if depth > _DEPTH:
            raise MalformedMetadata("nested too deeply")
        fields: dict[int, object] = {}
        last = 0
        while (head := self.byte()) != 0:
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            if kind in (5, 6, 4):  # i32, i64, i16
                fields[last] = self.zigzag()
            elif kind == 12:
                fields[last] = self.struct(depth + 1)
            else:
                self.skip(kind, depth)
        return fields

    def skip(self, kind: int, depth: int) -> None:
        """Read past one value of compact type ``kind``."""
        if kind in (1, 2):  # booleans live in the field header
            return
        if kind == 3:
            self.pos += 1
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.pos += 8
        elif kind == 8:
            size = self.varint()  # before the +=, which would read pos first
            self.pos += size
        elif kind in (9, 10):
            self._skip_list(depth)
        elif kind == 11:
            self._skip_map(depth)
        elif kind == 12:
            self.struct(depth + 1)
        else:
            raise MalformedMetadata(f"unknown type {kind}")
        if self.pos > len(self.data):
            raise MalformedMetadata("past the end")

    def element(self, kind: int, depth: int) -> None:
        """Read past one element of a list or map (a boolean there takes a byte)."""
        if kind in (1, 2):
            self.byte()
        else:
            self.skip(kind, depth)

    def _skip_list(self, depth: int) -> None:
        head = self.byte()
        size = head >> 4 if head >> 4 != 15 else self.varint()
        for _ in range(size):
            self.element(head & 0x0F, depth + 1)

    def _skip_map(self, depth: int) -> None:
        size = self.varint()
        if size:
            kinds = self.byte()
            for _ in range(size):
                self.element(kinds >> 4, depth + 1)
                self.element(kinds & 0x0F, depth + 1)


def _page(header: dict[int, object], data_at: int) -> Page:
    """The Page of a parsed PageHeader whose data starts at ``data_at``."""
    kind, inflated, compressed = header.get(1), header.get(2), header.get(3)
    if not all(isinstance(v, int) and v >= 0 for v in (kind, inflated, compressed)):
        raise MalformedMetadata("a page header without its sizes")
    inner = header.get({DATA_PAGE: 5, DICTIONARY_PAGE: 7, DATA_PAGE_V2: 8}.get(kind, 0), {})
    inner = inner if isinstance(inner, dict) else {}
    values, encoding = inner.get(1, 0), inner.get(4 if kind == DATA_PAGE_V2 else 2, -1)
    if not isinstance(values, int) or values < 0 or not isinstance(encoding, int):
        raise MalformedMetadata("a negative count of values")
    return Page(kind, values, inflated, data_at, compressed, encoding)


def parquet_pages(f: BinaryIO, start: int, length: int) -> list[Page] | None:
    """The pages of the column chunk at ``start`` (``length`` bytes as stored, its footer's
    total_compressed_size), read from their headers; None: unknown (not parseable). The pages'
    data is skipped: a window of the file is read at a header (HEADER_WINDOW bytes, the
    headers of many small pages, or the start of a large one), again only for a header that
    runs past it (up to MAX_HEADER)."""
    pages: list[Page] = []
    pos, end = start, start + length
    window, at = b"", start
    try:
        while pos < end:
            if not at <= pos < at + len(window):
                window, at = _read(f, pos, min(HEADER_WINDOW, end - pos)), pos
            page = _header(window, pos - at, at)
            if page is None and at + len(window) < end:  # cut by the window: read it whole
                window, at = _read(f, pos, min(MAX_HEADER, end - pos)), pos
                page = _header(window, 0, at)
            if page is None:
                return None
            pages.append(page)
            pos = page.data_at + page.stored
    except (MalformedMetadata, OSError):
        return None
    return pages if pos == end else None


def _read(f: BinaryIO, pos: int, size: int) -> bytes:
    f.seek(pos)
    return f.read(size)


def _header(window: bytes, offset: int, at: int) -> Page | None:
    """The Page whose header is at ``window[offset:]`` (the window is at file offset ``at``);
    None: it does not end within the window, or within MAX_HEADER."""
    reader = _Compact(window, offset)
    try:
        header = reader.struct()
    except MalformedMetadata:
        if reader.pos < len(window):
            raise
        return None  # past the window's end
    if reader.pos - offset > MAX_HEADER:
        raise MalformedMetadata("a page header longer than any writer's")
    return _page(header, at + reader.pos)


def longest_value(plain, count: int) -> int | None:
    """The longest of ``count`` BYTE_ARRAY values in PLAIN encoding (each a 4-byte length,
    then its bytes), as a dictionary page holds them; None: not that."""
    longest, pos = 0, 0
    for _ in range(count):
        if pos + 4 > len(plain):
            return None
        size = struct.unpack_from("<I", plain, pos)[0]
        longest, pos = max(longest, size), pos + 4 + size
    return longest if pos <= len(plain) else None


# --- flatbuffers: Arrow IPC record batch metadata ----------------------------------------------

_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # Message.header_type (Schema.fbs MessageHeader)


def _u32(data: bytes, pos: int) -> int:
    if not 0 <= pos <= len(data) - 4:
        raise MalformedMetadata("past the end")
    return struct.unpack_from("<I", data, pos)[0]


def _field(data: bytes, table: int, slot: int) -> int | None:
    """Where field ``slot`` of the flatbuffer table at ``table`` is, or None (absent)."""
    if not 0 <= table <= len(data) - 4:
        raise MalformedMetadata("a table outside the buffer")
    vtable = table - struct.unpack_from("<i", data, table)[0]
    if not 0 <= vtable <= len(data) - 4:
        raise MalformedMetadata("a vtable outside the buffer")
    size = struct.unpack_from("<H", data, vtable)[0]
    entry = vtable + 4 + 2 * slot
    if entry + 2 > vtable + size or entry + 2 > len(data):
        return None
    offset = struct.unpack_from("<H", data, entry)[0]
    return table + offset if offset else None


def _table(data: bytes, table: int, slot: int) -> int | None:
    at = _field(data, table, slot)
    return None if at is None else at + _u32(data, at)


def record_batch(metadata: bytes) -> tuple[int, list[tuple[int, int]], bool] | None:
    """(rows, buffers as (offset, length) in the body, compressed?) of an IPC message that
    holds a record batch or a dictionary batch; None: another message, or unparseable."""
    try:
        root = _u32(metadata, 0)
        kind_at = _field(metadata, root, 1)
        kind = metadata[kind_at] if kind_at is not None and kind_at < len(metadata) else 0
        if kind not in (_RECORD_BATCH, _DICTIONARY_BATCH):
            return None
        batch = _table(metadata, root, 2)
        if batch is not None and kind == _DICTIONARY_BATCH:
            batch = _table(metadata, batch, 1)  # DictionaryBatch.data
        if batch is None:
            return None
        return _batch_layout(metadata, batch)
    except (MalformedMetadata, struct.error):
        return None


def _batch_layout(data: bytes, batch: int) -> tuple[int, list[tuple[int, int]], bool]:
    length_at = _field(data, batch, 0)
    rows = struct.unpack_from("<q", data, length_at)[0] if length_at is not None else 0
    buffers: list[tuple[int, int]] = []
    vector = _table(data, batch, 2)
    if vector is not None:
        count = _u32(data, vector)
        if vector + 4 + 16 * count > len(data):
            raise MalformedMetadata("a buffer list past the end")
        buffers = [struct.unpack_from("<qq", data, vector + 4 + 16 * i) for i in range(count)]
    if rows < 0 or any(offset < 0 or size < 0 for offset, size in buffers):
        raise MalformedMetadata("negative sizes")
    return rows, buffers, _field(data, batch, 3) is not None


def inflated_size(read8, buffers: list[tuple[int, int]], compressed: bool) -> int | None:
    """The bytes a record batch's buffers take once inflated; ``read8(offset)``: the 8 bytes
    of the body at ``offset`` (a compressed buffer's inflated length, -1: stored as is).
    None: a length that cannot be right; MalformedMetadata: a buffer past the body."""
    if not compressed:
        return sum(size for _, size in buffers)
    total = 0
    for offset, size in buffers:
        if size == 0:
            continue
        if size < 8:
            return None
        head = read8(offset)
        if len(head) != 8:
            raise MalformedMetadata("a buffer past the body's end")
        declared = struct.unpack("<q", head)[0]
        if declared < -1:
            return None
        total += size - 8 if declared == -1 else declared
    return total
