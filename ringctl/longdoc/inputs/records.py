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
one starts; the whitespace before an element counts against its limit, and is dropped as it is
passed (time linear in the file, memory one chunk). Blank lines of a ``.jsonl`` file are read
past a buffer at a time. A longer document belongs in a ``.txt`` file of its own, which is not
parsed.

Parquet and Arrow files are read by ``tables.py`` a bounded batch at a time (only the text and
id columns, the text measured, not converted); a document is read back from its row group
(Parquet) or record batch (Arrow). Whatever the file, a record with an integer too long for
Python to convert (``huge_integer``) is a bad record, not a traceback.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...bounded_read import open_input
from .inflate import GzipError, GzipReader
from .tables import PYARROW_INSTALL as PYARROW_INSTALL
from .tables import TableError, TableText, cell, rows

# 256 MiB: 256M tokens of ASCII text under the byte tokenizer (64M with a model's tokenizer),
# what a ring of 64 ranks at 1M tokens per rank holds. Parsing one takes about 4x that.
MAX_RECORD_BYTES = 256 << 20
CHUNK = 1 << 20


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
    except ValueError:  # the one other error of json: an integer too long to convert
        raise DocumentError(huge_integer(where)) from None


def huge_integer(where: str) -> str:
    """Why a record with an integer of more digits than Python converts is bad. Python refuses
    them (``sys.set_int_max_str_digits``) because converting one takes quadratic time; such a
    number is no text and no id, so the record is bad, not the file."""
    limit = sys.get_int_max_str_digits()
    return f"{where}: an integer of more than {limit:,} digits (the most Python converts)"


def record_text(record, where: str, text_field: str) -> bytes | TableText:
    """The record's text, as bytes (a table's cell while listing: its ``TableText``, whose
    ``len`` is its size in bytes); a DocumentError naming the record when it has none."""
    if not isinstance(record, dict):
        raise DocumentError(f"{where}: a JSON object is expected, not {type(record).__name__}")
    if text_field not in record:
        raise DocumentError(
            f"{where}: no field {text_field!r} (fields: {', '.join(sorted(record))}); "
            "set text_field"
        )
    value = record[text_field]
    if isinstance(value, TableText):  # a table's cell as listed: its size, all that is needed
        return value
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


def _opened(path: Path):
    """A record file opened for reading: a regular file, never a pipe (``open_input``)."""
    try:
        return open_input(path)
    except ValueError as err:
        raise DocumentError(str(err)) from None


def gzip_reader(path: Path) -> GzipReader:
    st = path.stat()
    return _gzip_reader(str(path), st.st_mtime_ns, st.st_size)


def file_chunks(path: Path) -> Iterator[bytes]:
    with _opened(path) as f:
        while chunk := f.read(CHUNK):
            yield chunk


def read_span(source: str, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of a file (of its inflated stream for ``.gz``)."""
    path = Path(source)
    if source.lower().endswith(".gz"):  # the listed name's suffix, any case
        try:
            return gzip_reader(path).read(offset, length)
        except GzipError as err:
            raise DocumentError(f"{source}: {err}") from None
    with _opened(path) as f:
        f.seek(offset)
        return f.read(length)


# --- JSON lines (.jsonl, .jsonl.gz) -------------------------------------------------------------


def json_lines(source: str, f: BinaryIO, limit: int) -> Iterator[Raw]:
    """One Raw per non-blank line of a binary file (a buffered one: ``peek``); a line over
    ``limit`` bytes is a bad record, never held whole."""
    for number, offset, line, length in _lines(f, limit):
        if line is None:
            yield Raw(number, offset, length, DocumentError(too_long(f"{source}:{number}", limit)))
        else:
            try:
                record = parse_record(line, f"{source}:{number}")
            except DocumentError as err:
                record = err
            yield Raw(number, offset, length, record)


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, int, bytes | None, int]]:
    """(number, offset, the line or None when over ``limit``, its length) of every line that
    is not blank; blank lines are counted, those after a blank one read past in bulk
    (``_blank_lines``)."""
    number = offset = 0
    while line := f.readline(limit + 1):
        if number == 0 and line.startswith(BOM):  # a UTF-8 byte-order mark: not the record's
            line, offset = line[len(BOM) :], len(BOM)
        number, length = number + 1, len(line)
        over = length > limit and not line.endswith(b"\n")
        while over and line and not line.endswith(b"\n"):  # read past the rest of it
            line = f.readline(CHUNK)
            length += len(line)
        if over or not line.isspace():
            yield number, offset, None if over else line, length
            offset += length
            continue
        lines, skipped = _blank_lines(f)
        number, offset = number + lines, offset + length + skipped


BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; a record never does
_BLANK = b" \t\n\r\x0b\x0c"  # what bytes.strip() strips: a line of only these is blank


def _blank_lines(f: BinaryIO) -> tuple[int, int]:
    """(lines, bytes) of the blank lines at ``f``'s position, read past a buffer at a time (a
    line at a time, a 255 KB .jsonl.gz inflating to 255 M empty lines took 52 s of CPU)."""
    lines = skipped = 0
    while True:
        ahead = f.peek(1)  # what is buffered (one read when nothing is)
        blank = len(ahead) - len(ahead.lstrip(_BLANK))
        end = ahead.rfind(b"\n", 0, blank) + 1  # through the last newline of the blank run
        if not end:
            return lines, skipped
        lines, skipped = lines + ahead.count(b"\n", 0, end), skipped + end
        f.read(end)
        if end < len(ahead):
            return lines, skipped


def plain_lines(path: Path, limit: int) -> Iterator[Raw]:
    with _opened(path) as f:
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
# Finds where an element with a too-long integer ends, converting no integer (the element is
# a bad record: ``huge_integer``).
_SCANNER = json.JSONDecoder(parse_int=lambda digits: 0)


class _Text:
    """The decoded text of a byte stream, read on demand. Undecodable bytes are one lone
    surrogate each, so every slice encodes back to its exact bytes: ``text[mark]`` is at byte
    ``mark_byte`` of the stream, and each span is measured from the last one, which ended at
    byte ``span_end``."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.text, self.eof = "", False
        self.mark = self.mark_byte = self.span_end = 0

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

    def skip_space(self, pos: int, most: int) -> int:
        """Where the whitespace from ``pos`` ends (or the end), reading on as needed, but not
        past ``most`` bytes since the last span (``gap``). Whitespace held up to the end of the
        text is dropped before reading on: a long run costs linear time and one chunk of
        memory (joining it to each chunk read made it quadratic, and it was held whole)."""
        while True:
            end = _WHITESPACE.match(self.text, pos).end()
            if end < len(self.text) or self.eof or self.gap(end) > most:
                return end
            self._drop(end)
            self.more(CHUNK)
            pos = 0

    def gap(self, pos: int) -> int:
        """Bytes from the last span's end to ``text[pos]``."""
        return self.mark_byte + _utf8_length(self.text[self.mark : pos]) - self.span_end

    def _drop(self, end: int) -> None:
        """Forget ``text[:end]`` (past the last span), keeping the byte count."""
        self.mark_byte += _utf8_length(self.text[self.mark : end])
        self.text, self.mark = self.text[end:], 0

    def span(self, start: int, end: int) -> tuple[int, int]:
        """(byte offset, byte length) of ``text[start:end]``, which follows the last span."""
        offset = self.mark_byte + _utf8_length(self.text[self.mark : start])
        length = _utf8_length(self.text[start:end])
        self.mark, self.mark_byte = end, offset + length
        self.span_end = self.mark_byte
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
    where the next one starts. What comes before an element (``[`` or ``,`` and whitespace)
    counts against its limit, and what comes after the last one against a limit of its own."""
    buf = _Text(chunks)
    start = 1 if buf.at(0) == "\ufeff" else 0  # a UTF-8 byte-order mark
    pos = _space(buf, start, limit, source, "before the array")
    if buf.at(pos) != "[":
        raise DocumentError(f"{source}: a .json input must hold an array of records")
    pos, number = _space(buf, pos + 1, limit, source, "before element 1"), 0
    while buf.at(pos) != "]":
        where = f"{source}: element {number + 1}"
        if buf.at(pos) is None:
            raise DocumentError(f"{where}: not valid JSON (the array is not closed)")
        if number:
            if buf.at(pos) != ",":
                raise DocumentError(f"{where}: not valid JSON (',' or ']' expected before it)")
            pos = _space(buf, pos + 1, limit, source, f"before element {number + 1}")
        number += 1
        gap = buf.gap(pos)
        record, end = _element(buf, pos, where, limit, gap)
        offset, length = buf.span(pos, end)
        if gap + length > limit:  # read whole before the check in _element saw it
            raise DocumentError(too_long(where, limit))
        yield Raw(number, offset, length, record)
        pos = _space(buf, buf.release(), limit, source, f"after element {number}")
    if buf.at(_space(buf, pos + 1, limit, source, "after the array")) is not None:
        raise DocumentError(f"{source}: not valid JSON (data after the array)")


def _space(buf: _Text, pos: int, limit: int, source: str, place: str) -> int:
    """Where the whitespace from ``pos`` ends; more than ``limit`` bytes of it since the last
    element (what would come before the next one) refuses the file, as a longer element does."""
    end = buf.skip_space(pos, limit)
    if buf.gap(end) > limit:
        raise DocumentError(
            f"{source}: more than {limit:,} bytes of whitespace {place} (whitespace between "
            "records counts against the most one record may hold)"
        )
    return end


def _element(buf: _Text, pos: int, where: str, limit: int, used: int):
    """(the element at ``pos``, or the DocumentError that makes it a bad record; where it
    ends), reading on while it may be incomplete; ``used``: bytes of the limit spent before
    it (whitespace)."""
    decoder = _DECODER
    while True:
        try:
            record, end = decoder.raw_decode(buf.text, pos)
            if end < len(buf.text) or buf.eof:  # a number at the end may go on
                bad = decoder is _SCANNER
                return (DocumentError(huge_integer(where)) if bad else record), end
        except json.JSONDecodeError as err:
            if buf.eof or not _may_be_cut(err, buf.text):
                raise DocumentError(f"{where}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise DocumentError(f"{where}: nested too deeply to parse") from None
        except ValueError:  # an integer too long to convert: find the element's end
            decoder = _SCANNER
            continue
        if len(buf.text) - pos + used > limit:  # characters: never fewer than its bytes / 4
            raise DocumentError(too_long(where, limit))
        buf.more(max(CHUNK, len(buf.text) - pos))  # doubles what is held: linear overall


def _may_be_cut(err: json.JSONDecodeError, text: str) -> bool:
    """Whether the error may only be the end of what is read so far."""
    return err.msg.startswith("Unterminated string") or len(text) - err.pos < 16


# --- Parquet and Arrow tables (tables.py) -------------------------------------------------------


def table_rows(
    path: Path, text_field: str, id_field: str | None, limit: int = MAX_RECORD_BYTES
) -> Iterator[Raw]:
    """One Raw per row ({column: value} of the text and id columns; the text a ``TableText``,
    its size, unread), a bounded batch at a time; a page or compressed batch that would
    inflate past ``tables.inflate_cap(limit)`` refuses the file. A table without the text
    column gives one bad record that names the file's columns."""
    try:
        for row, record in rows(path, text_field, id_field, limit):
            if isinstance(record, TableError):
                record = DocumentError(str(record))
            yield Raw(row, max(row - 1, 0), 0, record)
    except TableError as err:
        raise DocumentError(str(err)) from None


def table_cell(source: str, row: int, column: str):
    """The value at ``row`` (0-based) of ``column``: from the Parquet row group or Arrow record
    batch that holds it, decoded in bounded batches."""
    try:
        return cell(source, row, column, MAX_RECORD_BYTES)
    except TableError as err:
        raise DocumentError(str(err)) from None
