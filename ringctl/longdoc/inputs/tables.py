"""Parquet and Arrow IPC files as records: listed in bounded memory, read back a row at a time.

A row is a record (``{column: value}`` of the text and id columns). Listing measures the text
column (``TableText``: its size in bytes, from the column's offsets) and never converts it to
Python: that happens when a document is read (``cell``), after its size passed the record
limit. pyarrow inflates a Parquet page or an Arrow record batch whole, and a 26 KB file can
hold 800 MiB of text, so what it inflates is sized from the file's own headers first
(``table_meta``), and anything that would inflate past one record's limit and
TABLE_BATCH_BYTES (``inflate_cap``) refuses the file, by name, before it is inflated:

* Parquet: a row group is decoded in batches of as many rows as its pages' headers say fit in
  TABLE_BATCH_BYTES (one row at least: then the bound is the page). A column whose data pages
  hold dictionary indices only is read as a dictionary, never expanded (one long value in
  every row is a dictionary bomb); where some rows are values and some indices, a row may
  decode to the dictionary's longest value, which bounds the batch.
* Arrow IPC: an uncompressed file is memory-mapped (nothing is copied); a compressed batch
  says each buffer's inflated length in front of it (there is no reading part of one).

Memory is then a few copies of one page or batch (pyarrow's own), whatever the file declares.
A document is read back from its Parquet row group or Arrow record batch, decoded in those same
batches and kept in a cache of TABLE_CACHE_BYTES for all files; an open Parquet file (its
footer parsed once) is kept too. Errors are ``TableError`` (``records.py`` names them as bad
records or refused files); this module knows nothing of JSON records.
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...bounded_read import open_input
from .inflate import SizedCache
from .table_meta import (
    DATA_PAGE,
    DATA_PAGE_V2,
    DICTIONARY_PAGE,
    MalformedMetadata,
    inflated_size,
    longest_value,
    parquet_pages,
    record_batch,
)

PYARROW_INSTALL = "pip install pyarrow (or pip install 'ringctl[parquet]')"
TABLE_BATCH_BYTES = 4 << 20  # inflated bytes of a table decoded at a time (or one page)
TABLE_CACHE_BYTES = 1 << 30  # decoded batches kept for reading documents back, all files
MAX_BATCH_ROWS = 1 << 20  # rows of a table decoded at a time, however small
DENSE_ROWS = 256  # a dictionary column is expanded when this many rows fit the batch


class TableError(ValueError):
    """A table file, or one row of it, that cannot be read (says which and why)."""


class TableText:
    """A text cell as listed: its size in UTF-8 bytes (``len``), the text itself not read."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


def pyarrow_modules(path: Path):
    """(pyarrow, pyarrow.parquet), or a TableError with the install line."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        why = f"reading {path.suffix} needs pyarrow: {PYARROW_INSTALL}"
        raise TableError(f"{path}: {why}") from None
    return pa, pq


# --- listing ------------------------------------------------------------------------------------


def rows(
    path: Path, text_field: str, id_field: str | None, limit: int
) -> Iterator[tuple[int, object]]:
    """(row number from 1, its record: {text_field: TableText or None, id_field: its id}, or
    the TableError that makes it bad: an id over ``limit`` bytes). A table without the text
    column gives (0, a TableError naming the file's columns); an unreadable file raises one."""
    pa, pq = pyarrow_modules(path)
    try:
        names, batches = _batches(path, pa, pq, [text_field, id_field], limit)
        if text_field not in names:
            why = f"no column {text_field!r} (columns: {', '.join(names)}); set text_field"
            yield 0, TableError(f"{path}: {why}")
            return
        row = 0
        for batch in batches:
            for record in _batch_records(pa, batch, text_field, id_field, limit):
                row += 1
                yield row, _checked_id(record, id_field, f"{path}:{row}", limit)
    except (OSError, pa.ArrowException) as err:
        raise TableError(f"{path}: not a readable {path.suffix} table ({err})") from None


def _batch_records(pa, batch, text_field: str, id_field: str | None, limit: int):
    """The records of one batch: text cells measured, not converted; ids converted (the batch
    is bounded), except one over ``limit``."""
    names = batch.schema.names
    texts = _text_cells(pa, batch.column(names.index(text_field)))
    if id_field is None or id_field not in names:
        return ({text_field: text} for text in texts)
    ids = _id_cells(pa, batch.column(names.index(id_field)), limit)
    return ({text_field: text, id_field: i} for text, i in zip(texts, ids, strict=True))


def _text_cells(pa, column) -> list:
    """A TableText per string cell (None: null). Another column's cells are what the listing
    refuses as not text: ``b""`` stands for each, unread (they may be as large)."""
    lengths = _byte_lengths(pa, column)
    if lengths is None:
        return [b""] * len(column)
    return [None if n is None else TableText(n) for n in lengths]


def _byte_lengths(pa, column) -> list[int | None] | None:
    """The size in bytes of each cell of a string column (None: null), from its offsets, its
    values unread; None: not a string column."""
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        if not _is_string(pa, column.type.value_type):
            return None
        lengths = pc.binary_length(_offsets_form(pa, column.dictionary))
        return lengths.take(column.indices).to_pylist()
    if not _is_string(pa, column.type):
        return None
    return pc.binary_length(_offsets_form(pa, column)).to_pylist()


def _is_string(pa, arrow_type) -> bool:
    t = pa.types
    return t.is_string(arrow_type) or t.is_large_string(arrow_type) or t.is_string_view(arrow_type)


def _offsets_form(pa, column):
    """A string-view column as large strings (binary_length has no kernel for views)."""
    return column.cast(pa.large_string()) if pa.types.is_string_view(column.type) else column


_TOO_LONG = object()  # an id cell over the record limit, left unconverted


def _id_cells(pa, column, limit: int) -> list:
    """The id column's values, a string id over ``limit`` bytes left unconverted."""
    lengths = _byte_lengths(pa, column)
    if lengths is not None and any(n is not None and n > limit for n in lengths):
        return [
            _TOO_LONG if n is not None and n > limit else cell_value(pa, column[i])
            for i, n in enumerate(lengths)
        ]
    try:
        return column.to_pylist()
    except UnicodeDecodeError:  # invalid UTF-8: kept as a JSON string keeps it
        return [cell_value(pa, column[i]) for i in range(len(column))]


def _checked_id(record: dict, id_field: str | None, where: str, limit: int):
    if id_field is not None and record.get(id_field) is _TOO_LONG:
        return TableError(f"{where}: id field {id_field!r} is longer than {limit:,} bytes")
    return record


def cell_value(pa, scalar):
    """A cell as Python: a string decoded as JSON strings are here (an invalid byte kept as a
    lone surrogate, so ``records.to_bytes`` gives its exact bytes back), else ``as_py``."""
    if pa.types.is_dictionary(scalar.type):
        scalar = scalar.value
    if scalar is None or not scalar.is_valid:
        return None
    if _is_string(pa, scalar.type):
        return scalar.as_buffer().to_pybytes().decode("utf-8", "surrogateescape")
    return scalar.as_py()


def _batches(path: Path, pa, pq, wanted: list[str | None], limit: int):
    """(the table's column names, its batches of the wanted columns, each bounded)."""
    if path.suffix.lower() == ".parquet":
        names = parquet_file(str(path), path.stat().st_mtime_ns).schema_arrow.names
        columns = [c for c in wanted if c in names]
        return names, _parquet_batches(path, columns, limit)
    index = ipc_index(str(path), path.stat().st_mtime_ns)
    index.check(limit)
    columns = [c for c in wanted if c in index.schema.names]
    return index.schema.names, index.read_all(pa, columns)


def inflate_cap(limit: int) -> int:
    """The most bytes one Parquet page or compressed Arrow batch may inflate to: one record's
    ``limit`` and TABLE_BATCH_BYTES (pyarrow inflates either whole, and no record is longer)."""
    return limit + TABLE_BATCH_BYTES


def _too_large(where: str, inflated: int, stored: int, limit: int, fix: str) -> TableError:
    return TableError(
        f"{where} inflates to {inflated:,} bytes from {stored:,}, more than {inflate_cap(limit):,} "
        f"(one record's limit and {TABLE_BATCH_BYTES >> 20} MiB), and is read whole: {fix}, "
        "or put documents this long in .txt files"
    )


# --- Parquet: batches sized by the pages --------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How to decode a row group: ``rows`` at a time, the ``dictionary`` columns as
    dictionaries (their data pages hold indices only: never expanded, which a dictionary
    bomb, one long value in every row, would need)."""

    rows: int
    dictionary: tuple[str, ...] = ()


def _parquet_batches(path: Path, columns: list[str], limit: int) -> Iterator:
    """Row group by row group, each as its pages say (``group_plan``, which refuses the file
    before any is inflated if one page would be too large); neighbouring groups with the same
    plan are read together."""
    source, version = str(path), path.stat().st_mtime_ns
    table = parquet_file(source, version)
    runs: list[tuple[Plan, list[int]]] = []
    with _opened(source) as f:
        for group in range(table.metadata.num_row_groups):
            plan = group_plan(_Chunks(f, source, group, limit), table, columns)
            if runs and runs[-1][0] == plan:
                runs[-1][1].append(group)
            else:
                runs.append((plan, [group]))
    for plan, groups in runs:
        reader = parquet_file(source, version, plan.dictionary)
        yield from reader.iter_batches(batch_size=plan.rows, row_groups=groups, columns=columns)


@dataclass(frozen=True)
class _Chunks:
    """Where a row group's column chunks are read from, and the limit their pages answer to."""

    f: BinaryIO
    source: str
    group: int
    limit: int


def group_plan(chunks: _Chunks, table, columns: list[str]) -> Plan:
    """How a row group decodes within TABLE_BATCH_BYTES at a time: the fewest rows any wanted
    column's pages allow (1 at least: then the bound is the page, which ``_check_pages`` keeps
    within ``inflate_cap``), rounded down to a power of two so that neighbouring groups share
    a plan (and their batches, a bound per row, may span them)."""
    meta = table.metadata.row_group(chunks.group)
    schema = table.schema  # the Parquet leaves: a nested column has several
    fits, dictionary = [MAX_BATCH_ROWS], []
    for i in range(len(schema)):
        name = schema.column(i).path
        if name.split(".")[0] not in columns:
            continue
        fit, indexed = _chunk_plan(chunks, meta.column(i), meta.num_rows, name)
        fits.append(fit)
        dictionary += [name] if indexed and name in columns else []
    return Plan(1 << (max(1, min(fits)).bit_length() - 1), tuple(dictionary))


def _chunk_plan(chunks: _Chunks, chunk, rows: int, name: str) -> tuple[int, bool]:
    """(rows of one column chunk that decode within TABLE_BATCH_BYTES, whether to read it as a
    dictionary), from its page headers: the footer's totals say nothing of how a chunk's bytes
    are spread over its rows. As a dictionary only where that matters (a row may decode to a
    long value: fewer than DENSE_ROWS fit) and every data page holds indices."""
    f = chunks.f
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    pages = parquet_pages(f, start or 0, chunk.total_compressed_size)
    if pages is None:  # how much a page inflates to is unknown: pyarrow would find out
        where = f"{chunks.source}: row group {chunks.group + 1}, column {name!r}"
        raise TableError(
            f"{where}: its page headers cannot be read, so what they inflate to is unknown"
        )
    _check_pages(chunks, pages, name)
    data = [p for p in pages if p.kind in (DATA_PAGE, DATA_PAGE_V2)]
    dictionary = [p for p in pages if p.kind == DICTIONARY_PAGE]
    fits = [TABLE_BATCH_BYTES * p.values // max(p.inflated, 1) for p in data]
    for page in dictionary:  # its indices' pages say nothing of the values they stand for
        fits.append(TABLE_BATCH_BYTES // max(_dictionary_row(f, chunk, page, rows), 1))
    fit = min(fits, default=MAX_BATCH_ROWS)
    indexed = chunk.physical_type == "BYTE_ARRAY" and all(p.indexed for p in data)
    if dictionary and indexed and fit < min(rows, DENSE_ROWS):
        return TABLE_BATCH_BYTES // 4, True  # 4 bytes an index; the dictionary is one page
    return fit, False


def _check_pages(chunks: _Chunks, pages: list, name: str) -> None:
    """Refuse the file, naming the page and its rows, if one page would inflate past
    ``inflate_cap``: pyarrow inflates a page whole (a few copies of it), before any of its
    values could be measured."""
    first = 0
    for page in pages:
        values = page.values if page.kind in (DATA_PAGE, DATA_PAGE_V2) else 0
        if page.inflated > inflate_cap(chunks.limit):
            kind = "dictionary page" if page.kind == DICTIONARY_PAGE else "page"
            rows = f" (rows {first + 1:,}-{first + values:,} of the group)" if values else ""
            where = (
                f"{chunks.source}: row group {chunks.group + 1}, column {name!r}: a {kind}{rows}"
            )
            fix = "write it with smaller pages (pyarrow: write_table(..., write_batch_size=1, "
            raise _too_large(
                where, page.inflated, page.stored, chunks.limit, fix + "use_dictionary=False))"
            )
        first += values


# Parquet's codec names -> pyarrow's. Parquet's older "LZ4" is raw LZ4 behind a Hadoop frame
# header, or (as pyarrow writes it) without one (``_unframed``).
_CODECS = {
    "SNAPPY": "snappy",
    "GZIP": "gzip",
    "BROTLI": "brotli",
    "ZSTD": "zstd",
    "LZ4_RAW": "lz4_raw",
    "LZ4": "lz4_raw",
}


def _dictionary_row(f: BinaryIO, chunk, page, rows: int) -> int:
    """The most bytes one row may decode to through this dictionary page (its data pages hold
    indices, so their sizes say nothing): the longest string in it, read from the page when
    that matters and the page is small; else the whole page (or a fixed width)."""
    if chunk.physical_type != "BYTE_ARRAY":
        return page.inflated // max(page.values, 1)
    if page.inflated * rows <= TABLE_BATCH_BYTES or page.inflated > TABLE_BATCH_BYTES:
        return page.inflated  # every row fits already, or one row per batch anyway
    plain = _inflate_page(f, chunk.compression, page)
    longest = longest_value(plain, page.values) if plain is not None else None
    return page.inflated if longest is None else longest


def _inflate_page(f: BinaryIO, compression: str, page) -> bytes | None:
    """A page's data inflated (it is at most TABLE_BATCH_BYTES), or None: an unknown codec."""
    import pyarrow as pa

    f.seek(page.data_at)
    stored = f.read(page.stored)
    if compression == "UNCOMPRESSED":
        return stored
    if compression not in _CODECS:
        return None
    if compression == "LZ4":
        stored = _unframed(stored, page.inflated)
    try:
        codec = pa.Codec(_CODECS[compression])
        return codec.decompress(stored, decompressed_size=page.inflated, asbytes=True)
    except (pa.ArrowException, ValueError):
        return None


def _unframed(stored: bytes, inflated: int) -> bytes:
    """LZ4 data without the Hadoop frame header (big-endian inflated and stored sizes) that
    Parquet's "LZ4" may have, as parquet-cpp reads it."""
    if len(stored) >= 8 and struct.unpack(">II", stored[:8]) == (inflated, len(stored) - 8):
        return stored[8:]
    return stored


@functools.lru_cache(maxsize=8)
def parquet_file(source: str, version: int, dictionary: tuple[str, ...] = ()):
    """An open Parquet file (its footer parsed once, kept: a document read is no new parse),
    reading the ``dictionary`` columns as dictionaries."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(_opened(source), read_dictionary=list(dictionary) or None)


def _opened(source: str):
    """A table file opened for reading: a regular file, never a pipe swapped in after the
    listing (``open_input``: it blocked every rank reading it)."""
    try:
        return open_input(source)
    except ValueError as err:
        raise TableError(str(err)) from None


@functools.lru_cache(maxsize=8)
def _group_firsts(source: str, version: int) -> list[int]:
    """The first row of each row group, and the row count last."""
    meta, firsts = parquet_file(source, version).metadata, [0]
    for group in range(meta.num_row_groups):
        firsts.append(firsts[-1] + meta.row_group(group).num_rows)
    return firsts


# --- Arrow IPC: batches checked by their metadata -----------------------------------------------


@dataclass(frozen=True)
class _IpcBatch:
    offset: int  # of its message in the file
    first: int  # its first row (a dictionary batch: -1)
    rows: int
    stored: int  # its body's bytes in the file
    inflated: int | None  # its buffers' bytes once inflated (None: unknown)
    compressed: bool


@dataclass(frozen=True)
class IpcIndex:
    """An Arrow IPC file's schema and batches, read from its messages' metadata alone."""

    source: str
    schema: object
    batches: list[_IpcBatch]

    def check(self, limit: int) -> None:
        """Refuse a compressed batch that would inflate past ``inflate_cap`` (or by an amount
        its metadata does not tell): pyarrow inflates a batch whole."""
        for n, b in enumerate(self.batches, 1):
            if not b.compressed or (b.inflated is not None and b.inflated <= inflate_cap(limit)):
                continue
            what = f"record batch {n} (rows {b.first + 1:,}-{b.first + b.rows:,})"
            where = f"{self.source}: {what if b.first >= 0 else f'dictionary batch {n}'}"
            fix = "write the table uncompressed (as datasets' save_to_disk does) or in smaller "
            fix += "record batches"
            if b.inflated is None:
                raise TableError(f"{where} is compressed, by an amount its metadata does not tell")
            raise _too_large(f"{where}, compressed,", b.inflated, b.stored, limit, fix)

    @property
    def firsts(self) -> list[int]:
        return [b.first for b in self.batches if b.first >= 0]

    @property
    def dictionaries(self) -> bool:
        return any(b.first < 0 for b in self.batches)

    def read_all(self, pa, columns: list[str]) -> Iterator:
        """Every record batch, of the wanted columns only (the others are not inflated)."""
        fields = [self.schema.names.index(c) for c in columns]
        options = pa.ipc.IpcReadOptions(included_fields=fields)
        source = pa.memory_map(self.source)
        try:
            yield from pa.ipc.open_stream(source, options=options)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source, options=options)
            yield from (file.get_batch(i) for i in range(file.num_record_batches))

    def read(self, pa, k: int, column: str):
        """Record batch ``k``'s column: its message alone, where no dictionary batch is needed
        to decode it; else the batches read in order up to it."""
        if self.dictionaries:
            for i, batch in enumerate(self.read_all(pa, [column])):
                if i == k:
                    return batch.column(0)
            raise TableError(f"{self.source}: no record batch {k + 1}")
        source = pa.memory_map(self.source)
        source.seek([b for b in self.batches if b.first >= 0][k].offset)
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(source), self.schema)
        return batch.column(self.schema.names.index(column))


@functools.lru_cache(maxsize=8)
def ipc_index(source: str, version: int) -> IpcIndex:
    """The file's batches from its messages, whose bodies (memory-mapped) are not inflated: a
    stream (what save_to_disk writes) or a file (its magic, then a stream)."""
    import pyarrow as pa

    mapped = pa.memory_map(source)
    mapped.seek(8 if mapped.read(6) == b"ARROW1" else 0)
    schema, batches, first = None, [], 0
    while True:
        offset = mapped.tell()
        try:
            message = pa.ipc.read_message(mapped)
        except EOFError:
            break
        if message.type == "schema":
            schema = pa.ipc.read_schema(message)
        elif message.type in ("record batch", "dictionary"):
            batch = _ipc_batch(message, offset, first if message.type == "record batch" else -1)
            first += max(batch.rows, 0) if batch.first >= 0 else 0
            batches.append(batch)
    if schema is None:
        raise pa.ArrowInvalid("no schema message")
    return IpcIndex(source, schema, batches)


def _ipc_batch(message, offset: int, first: int) -> _IpcBatch:
    body = message.body
    stored = body.size if body is not None else 0
    layout = record_batch(memoryview(message.metadata))
    if layout is None:
        return _IpcBatch(offset, first, 0, stored, None, True)
    rows, buffers, compressed = layout
    view = memoryview(body) if body is not None else memoryview(b"")
    try:
        inflated = inflated_size(lambda at: bytes(view[at : at + 8]), buffers, compressed)
    except MalformedMetadata:
        inflated = None
    return _IpcBatch(offset, first, rows, stored, inflated, compressed)


# --- reading a row back -------------------------------------------------------------------------

_DECODED = SizedCache(TABLE_CACHE_BYTES, size=lambda column: column.nbytes)


def cell(source: str, row: int, column: str, limit: int):
    """The value at ``row`` (0-based) of ``column``, as Python (``cell_value``): from the
    decoded batch that holds it."""
    path = Path(source)
    pa, _ = pyarrow_modules(path)
    version = path.stat().st_mtime_ns
    try:
        if path.suffix.lower() == ".parquet":
            values, at = _parquet_values(source, version, row, column, limit)
        else:
            values, at = _ipc_values(pa, source, version, row, column, limit)
        return cell_value(pa, values[at])
    except (OSError, pa.ArrowException, IndexError, KeyError, ValueError) as err:
        raise TableError(f"{source}: row {row + 1} cannot be read ({err})") from None


def _parquet_values(source: str, version: int, row: int, column: str, limit: int):
    """(the decoded batch of ``column`` that holds ``row``, the row's index in it): its row
    group decoded as its plan says, each batch kept in the cache as it goes by."""
    firsts = _group_firsts(source, version)
    group = bisect.bisect_right(firsts, row) - 1
    if not 0 <= group < len(firsts) - 1:
        raise IndexError(f"the file has {firsts[-1]} rows")
    local = row - firsts[group]
    plan = _read_back_plan(source, version, group, column, limit)
    key = (source, version, group, column, local // plan.rows)
    values = _DECODED.get(key)
    if values is None:
        reader = parquet_file(source, version, plan.dictionary)
        batches = reader.iter_batches(batch_size=plan.rows, row_groups=[group], columns=[column])
        for k, batch in enumerate(batches):
            _DECODED.keep(key[:-1] + (k,), batch.column(0))
            if k == key[-1]:
                values = batch.column(0)
                break
    if values is None:
        raise IndexError(f"row group {group + 1} ends before row {row + 1}")
    return values, local % plan.rows


@functools.lru_cache(maxsize=256)
def _read_back_plan(source: str, version: int, group: int, column: str, limit: int) -> Plan:
    with _opened(source) as f:
        return group_plan(_Chunks(f, source, group, limit), parquet_file(source, version), [column])


def _ipc_values(pa, source: str, version: int, row: int, column: str, limit: int):
    """(the decoded record batch column that holds ``row``, the row's index in it)."""
    index = ipc_index(source, version)
    index.check(limit)
    firsts = index.firsts
    k = bisect.bisect_right(firsts, row) - 1
    if k < 0:
        raise IndexError(f"row {row + 1} is in no record batch")
    key = (source, version, k, column)
    values = _DECODED.get(key)
    if values is None:
        values = index.read(pa, k, column)
        _DECODED.keep(key, values)
    return values, row - firsts[k]


__all__ = [
    "PYARROW_INSTALL",
    "TableError",
    "TableText",
    "cell",
    "ipc_index",
    "group_plan",
    "parquet_file",
    "pyarrow_modules",
    "rows",
]
