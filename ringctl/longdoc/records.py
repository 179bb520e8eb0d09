"""The records of an input file, read one at a time in bounded memory, and read back by span.

Every JSON flavour goes through the same two steps: a reader finds each record's bytes (a
``.jsonl`` line, the same line of a ``.jsonl.gz`` file's inflated stream, an element of a
``.json`` array), and ``parse_record`` parses them, so a bad record is the same bad record
whatever file holds it. A record is located by its span (offset and length in the file's
bytes, inflated for ``.jsonl.gz``): reading one document later reads its span only.

Memory: a reader holds one record and one chunk (``CHUNK``), never more than
``MAX_RECORD_BYTES`` of a record: a longer line is read past in chunks and is a bad record
(skipped or refused per ``on_bad_record``). A ``.json`` array is streamed too, element by
element (``json.JSONDecoder.raw_decode`` over a buffer that grows only while an element is
incomplete), rather than refused above a size: its elements' spans let a document be read
back alone, where a whole-file parse would be needed again for each one. An element over the
limit (or one that cannot be parsed) refuses the file, as there is no telling where the next
one starts. A longer document belongs in a ``.txt`` file of its own, which is not parsed.

Parquet and Arrow files are read a record batch at a time (only the text and id columns); a
document is read back from its row group (Parquet) or the memory-mapped file (Arrow).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .inflate import GzipError, GzipReader

# 256 MiB: 256M tokens of ASCII text under the byte tokenizer (64M with a model's tokenizer),
# what a ring of 64 ranks at 1M tokens per rank holds. Parsing one takes about 4x that.
MAX_RECORD_BYTES = 256 << 20
CHUNK = 1 << 20
TABLE_BATCH = 256  # rows turned into Python objects at a time
PYARROW_INSTALL = "pip install pyarrow (or pip install 'ringctl[parquet]')"


class DocumentError(ValueError):
    """An input that cannot be read as documents (says which file and why)."""


@dataclass(frozen=True)
class Raw:
    """One record as found: its number (1-based line, element or row), its span (byte offset
    and length; for a table row, offset is the row index), and the parsed record, or the
    DocumentError that says why it could not be parsed."""

    number: int
    offset: int
    length: int
    record: object


def to_bytes(text: str) -> bytes:
    """The bytes behind a str from JSON: lone surrogates from undecodable bytes go back to
    those bytes; an escaped lone surrogate (``"\\ud800"``, not a character) becomes U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape")


_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def parse_record(raw: bytes, where: str):
    """One JSON record from its bytes (invalid UTF-8 kept as lone surrogates)."""
    try:
        return json.loads(raw.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as err:
        raise DocumentError(f"{where}: not valid JSON ({err.msg})") from None
    except RecursionError:
        raise DocumentError(f"{where}: nested too deeply to parse") from None


def record_text(record, where: str, text_field: str) -> bytes:
    """The record's text, as bytes; a DocumentError naming the record when it has none."""
    if not isinstance(record, dict):
        raise DocumentError(f"{where}: a JSON object is expected, not {type(record).__name__}")
    if text_field not in record:
        raise DocumentError(
            f"{where}: no field {text_field!r} (fields: {', '.join(sorted(record))}); "
            "set text_field"
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise DocumentError(f"{where}: field {text_field!r} is not a string")
    return to_bytes(value)


def too_long(where: str, limit: int) -> str:
    return (
        f"{where}: a record longer than {limit:,} bytes (the most one record may hold); "
        "put a longer document in a .txt file of its own"
    )


# --- the bytes of a file ------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _gzip_reader(source: str, mtime_ns: int, size: int) -> GzipReader:
    """One reader (and its checkpoints: ~15 KiB per inflated MiB) per file version, shared
    by listing and reading."""
    return GzipReader(source)


def gzip_reader(path: Path) -> GzipReader:
    st = path.stat()
    return _gzip_reader(str(path), st.st_mtime_ns, st.st_size)


def file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def read_span(source: str, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of a file (of its inflated stream for ``.gz``)."""
    path = Path(source)
    if source.endswith(".gz"):
        try:
            return gzip_reader(path).read(offset, length)
        except GzipError as err:
            raise DocumentError(f"{source}: {err}") from None
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


# --- JSON lines (.jsonl, .jsonl.gz) -------------------------------------------------------------


def json_lines(source: str, f: BinaryIO, limit: int) -> Iterator[Raw]:
    """One Raw per non-blank line of a binary file; a line over ``limit`` bytes is a bad
    record, never held whole."""
    for number, offset, line, length in _lines(f, limit):
        if line is None:
            yield Raw(number, offset, length, DocumentError(too_long(f"{source}:{number}", limit)))
        elif line.strip():
            try:
                record = parse_record(line, f"{source}:{number}")
            except DocumentError as err:
                record = err
            yield Raw(number, offset, length, record)


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, int, bytes | None, int]]:
    """(number, offset, the line or None when over ``limit``, its length) of every line."""
    number = offset = 0
    while line := f.readline(limit + 1):
        number, length = number + 1, len(line)
        over = length > limit and not line.endswith(b"\n")
        while over and line and not line.endswith(b"\n"):  # read past the rest of it
            line = f.readline(CHUNK)
            length += len(line)
        yield number, offset, None if over else line, length
        offset += length


def plain_lines(path: Path, limit: int) -> Iterator[Raw]:
    with open(path, "rb") as f:
        yield from json_lines(str(path), f, limit)


def gzip_lines(path: Path, limit: int) -> Iterator[Raw]:
    """The lines of a .jsonl.gz file; a file that cannot be inflated is refused by name, with
    the last line read before the damage."""
    number = 0
    try:
        for raw in json_lines(str(path), gzip_reader(path).open(), limit):
            number = raw.number
            yield raw
    except GzipError as err:
        why = f"not a readable gzip file after line {number}"
        raise DocumentError(f"{path}: {why} ({err})") from None


# --- a .json array ------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Text:
    """The decoded text of a byte stream, read on demand. Undecodable bytes are one lone
    surrogate each, so every slice encodes back to its exact bytes: ``text[mark]`` is at byte
    ``mark_byte`` of the stream, and each span is measured from the last one."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.text, self.eof = "", False
        self.mark = self.mark_byte = 0

    def more(self, chars: int) -> None:
        """Read on until ``chars`` more characters are held (or the end)."""
        parts, held = [self.text], 0
        while held < chars and not self.eof:
            chunk = next(self._chunks, None)
            self.eof = chunk is None
            part = self._decoder.decode(chunk or b"", final=self.eof)
            parts.append(part)
            held += len(part)
        self.text = "".join(parts)

    def at(self, pos: int) -> str | None:
        """The character at ``pos`` (reading on if needed), None at the end."""
        while pos >= len(self.text) and not self.eof:
            self.more(CHUNK)
        return self.text[pos] if pos < len(self.text) else None

    def skip_space(self, pos: int) -> int:
        while True:
            end = _WHITESPACE.match(self.text, pos).end()
            if end < len(self.text) or self.eof:
                return end
            self.more(CHUNK)
            pos = end

    def span(self, start: int, end: int) -> tuple[int, int]:
        """(byte offset, byte length) of ``text[start:end]``, which follows the last span."""
        offset = self.mark_byte + _utf8_length(self.text[self.mark : start])
        length = _utf8_length(self.text[start:end])
        self.mark, self.mark_byte = end, offset + length
        return offset, length

    def release(self) -> int:
        """Forget the text before the last span's end, when that is worth a copy; the index
        of that end in what is kept."""
        if self.mark >= CHUNK:
            self.text, self.mark = self.text[self.mark :], 0
        return self.mark


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogateescape"))


def json_elements(source: str, chunks: Iterable[bytes], limit: int) -> Iterator[Raw]:
    """One Raw per element of the file's top-level array, read a bounded piece at a time. An
    element that cannot be parsed, or is over ``limit``, refuses the file: there is no telling
    where the next one starts."""
    buf = _Text(chunks)
    pos = buf.skip_space(0)
    if buf.at(pos) != "[":
        raise DocumentError(f"{source}: a .json input must hold an array of records")
    pos, number = buf.skip_space(pos + 1), 0
    while buf.at(pos) != "]":
        where = f"{source}: element {number + 1}"
        if buf.at(pos) is None:
            raise DocumentError(f"{where}: not valid JSON (the array is not closed)")
        if number:
            if buf.at(pos) != ",":
                raise DocumentError(f"{where}: not valid JSON (',' or ']' expected before it)")
            pos = buf.skip_space(pos + 1)
        number += 1
        record, end = _element(buf, pos, where, limit)
        offset, length = buf.span(pos, end)
        yield Raw(number, offset, length, record)
        pos = buf.skip_space(buf.release())
    if buf.at(buf.skip_space(pos + 1)) is not None:
        raise DocumentError(f"{source}: not valid JSON (data after the array)")


def _element(buf: _Text, pos: int, where: str, limit: int):
    """(the element at ``pos``, where it ends), reading on while it may be incomplete."""
    while True:
        try:
            record, end = _DECODER.raw_decode(buf.text, pos)
            if end < len(buf.text) or buf.eof:  # a number at the end may go on
                return record, end
        except json.JSONDecodeError as err:
            if buf.eof or not _may_be_cut(err, buf.text):
                raise DocumentError(f"{where}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise DocumentError(f"{where}: nested too deeply to parse") from None
        if len(buf.text) - pos > limit:  # characters: never fewer than its bytes / 4
            raise DocumentError(too_long(where, limit))
        buf.more(max(CHUNK, len(buf.text) - pos))  # doubles what is held: linear overall


def _may_be_cut(err: json.JSONDecodeError, text: str) -> bool:
    """Whether the error may only be the end of what is read so far."""
    return err.msg.startswith("Unterminated string") or len(text) - err.pos < 16


# --- Parquet and Arrow tables -------------------------------------------------------------------


def _pyarrow(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        why = f"reading {path.suffix} needs pyarrow: {PYARROW_INSTALL}"
        raise DocumentError(f"{path}: {why}") from None
    return pa, pq


def table_rows(path: Path, text_field: str, id_field: str | None) -> Iterator[Raw]:
    """One Raw per row ({column: value} of the text and id columns), a batch at a time. A
    table without the text column gives one bad record that names the file's columns."""
    pa, pq = _pyarrow(path)
    try:
        names, batches = _batches(path, pa, pq, [text_field, id_field])
        if text_field not in names:
            why = f"no column {text_field!r} (columns: {', '.join(names)}); set text_field"
            yield Raw(0, 0, 0, DocumentError(f"{path}: {why}"))
            return
        row = 0
        for batch in batches:
            for start in range(0, batch.num_rows, TABLE_BATCH):
                for record in batch.slice(start, TABLE_BATCH).to_pylist():
                    row += 1
                    yield Raw(row, row - 1, 0, record)
    except (OSError, pa.ArrowException) as err:
        raise DocumentError(f"{path}: not a readable {path.suffix} table ({err})") from None


def _batches(path: Path, pa, pq, wanted: list[str | None]):
    """(the table's column names, its record batches of the wanted columns)."""
    if path.suffix == ".parquet":
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
        columns = [c for c in wanted if c in names]
        return names, table.iter_batches(batch_size=TABLE_BATCH, columns=columns)
    schema, batches = _arrow_batches(pa, path)
    columns = [c for c in wanted if c in schema.names]
    return schema.names, (batch.select(columns) for batch in batches)


def _arrow_batches(pa, path: Path):
    """(schema, record batches) of an Arrow IPC file, memory-mapped: the stream format (what
    ``save_to_disk`` writes), else the file format."""
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        source.seek(0)
        file = pa.ipc.open_file(source)
        return file.schema, (file.get_batch(i) for i in range(file.num_record_batches))


def table_cell(source: str, row: int, column: str):
    """The value at ``row`` (0-based) of ``column``: a Parquet row group, or the memory-mapped
    Arrow file, holds it."""
    path = Path(source)
    pa, pq = _pyarrow(path)
    version = path.stat().st_mtime_ns
    try:
        if path.suffix == ".parquet":
            group, first = _row_group(source, version, row)
            return _parquet_group(source, version, group, column)[row - first].as_py()
        return _arrow_column(source, version, column)[row].as_py()
    except (OSError, pa.ArrowException, IndexError, KeyError) as err:
        raise DocumentError(f"{source}: row {row + 1} cannot be read ({err})") from None


def _row_group(source: str, version: int, row: int) -> tuple[int, int]:
    import pyarrow.parquet as pq

    meta, first = pq.ParquetFile(source).metadata, 0
    for group in range(meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        if row < first + rows:
            return group, first
        first += rows
    raise IndexError(f"the file has {first} rows")


@functools.lru_cache(maxsize=2)
def _parquet_group(source: str, version: int, group: int, column: str):
    import pyarrow.parquet as pq

    return pq.ParquetFile(source).read_row_group(group, columns=[column]).column(0)


@functools.lru_cache(maxsize=2)
def _arrow_column(source: str, version: int, column: str):
    """The column over the memory-mapped file: its data is not copied."""
    import pyarrow as pa

    schema, batches = _arrow_batches(pa, Path(source))
    return pa.Table.from_batches(list(batches), schema=schema).column(column)
