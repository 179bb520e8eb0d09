"""Which documents a long-document job reads, in a stable order, with stable ids.

Inputs (``LongDocParams.inputs``: one path or a list of paths):

* a ``.txt`` or ``.md`` file: one document, its whole content;
* a ``.jsonl`` or ``.jsonl.gz`` file: one document per non-empty line, the JSON object's
  ``text_field`` (default ``"text"``);
* a ``.json`` file holding an array of such objects: one document per element;
* a ``.parquet`` file, or an ``.arrow`` file (Arrow IPC, as Hugging Face ``datasets`` writes
  with ``save_to_disk``): one document per row, its ``text_field`` column (pyarrow needed:
  ``pip install 'ringctl[parquet]'``);
* a directory (a "dataset folder", a ``save_to_disk`` folder included): every file of those
  kinds below it, recursively, sorted by relative path (hidden files and directories are
  skipped).

A record that is not a JSON object with a string ``text_field`` (or, with ``id_field``, without
that field) is a bad record, named by file and line (``.json``: element number). The
``on_bad_record`` policy decides: ``"stop"`` (the default of ``list_documents``) raises a
``DocumentError``; ``"skip"`` (the job's default) leaves it out and names it in
``Listing.skipped``. Either way this happens while listing, before any model runs.

Document ids are stable across runs given the same inputs: a file's path relative to the
directory it was found in (a file named directly: its file name), and ``<file id>#<line>``
(1-based line or element number) for records, or the record's ``id_field`` value when given.
Two documents with the same id are an error. ``Document.key`` is a file-system-safe form of the
id (used for output paths).

Bytes: documents are read as bytes. Invalid UTF-8 is never an error: the byte-level tokenizer
takes the raw bytes as they are (lossless); a text tokenizer gets the text decoded with U+FFFD
for each invalid byte. ``Document.invalid_utf8`` counts the bytes that were not valid UTF-8.

Missing inputs: a path that does not exist is reported, by name, in ``Listing.missing``. What
happens then is the job's ``on_missing`` policy: ``"report"`` (default) logs it, records it
in the output's documents.json and goes on with the others; ``"stop"`` raises
``MissingInputError`` before any document runs.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".txt", ".md", ".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
TABLE_SUFFIXES = (".parquet", ".arrow")
PYARROW_INSTALL = "pip install pyarrow (or pip install 'ringctl[parquet]')"
TEXT_SUFFIXES = (".txt", ".md")
ON_MISSING = ("report", "stop")
ON_BAD_RECORD = ("skip", "stop")


class DocumentError(ValueError):
    """An input that cannot be read as documents (says which file and why)."""


class MissingInputError(DocumentError):
    """Input paths that do not exist (with on_missing="stop")."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        super().__init__(
            f"{len(self.missing)} input path(s) do not exist: {', '.join(self.missing)} "
            "(on_missing=stop; use on_missing=report to go on with the others)"
        )


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def doc_key(doc_id: str) -> str:
    """A file-system-safe, unique, stable name for a document id."""
    slug = _UNSAFE.sub("_", doc_id).strip("._")[:80] or "doc"
    return f"{slug}-{hashlib.sha1(doc_id.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"


def _to_bytes(text: str) -> bytes:
    """The bytes behind a str from JSON: lone surrogates from undecodable bytes go back."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # e.g. an escaped lone surrogate "\ud800" in the JSON itself
        return text.encode("utf-8", "replace")


def invalid_utf8_count(raw: bytes) -> int:
    """How many bytes of ``raw`` are not part of valid UTF-8."""
    text = raw.decode("utf-8", "surrogateescape")  # each invalid byte -> one U+DC80..U+DCFF
    return sum(1 for ch in text if "\udc80" <= ch <= "\udcff")


@dataclass(frozen=True)
class Document:
    """One document: where it comes from, and how to read its bytes."""

    id: str
    source: str  # the file path (as given / found)
    line: int | None = None  # 1-based line (JSONL) or element number (a .json array)
    text_field: str = "text"
    packed: bool = False  # in a .jsonl.gz or .json file: read by record number, not offset
    _offset: int = field(default=0, repr=False)
    _length: int = field(default=-1, repr=False)

    @property
    def key(self) -> str:
        return doc_key(self.id)

    def read_bytes(self) -> bytes:
        """The document's raw bytes. A file gone since listing raises FileNotFoundError."""
        if self.line is None:
            return Path(self.source).read_bytes()
        if self.packed:
            path = Path(self.source)
            records = _packed_records(str(path), path.stat().st_mtime_ns)
            return _record_text(records[self.line - 1], self.source, self.line, self.text_field)
        with open(self.source, "rb") as f:
            f.seek(self._offset)
            line = f.read(self._length)
        return _jsonl_text(line, self.source, self.line, self.text_field)

    def read_text(self) -> str:
        """The text, with U+FFFD in place of each byte that is not valid UTF-8."""
        return self.read_bytes().decode("utf-8", "replace")

    def describe(self) -> dict:
        return {"id": self.id, "key": self.key, "source": self.source, "line": self.line}


def _jsonl_text(line: bytes, source: str, lineno: int, text_field: str) -> bytes:
    return _record_text(_parse_line(line, source, lineno), source, lineno, text_field)


def _parse_line(line: bytes, source: str, lineno: int):
    try:
        return json.loads(line.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as err:
        raise DocumentError(f"{source}:{lineno}: not valid JSON ({err.msg})") from None


def _record_text(record, source: str, lineno: int, text_field: str) -> bytes:
    if not isinstance(record, dict):
        raise DocumentError(f"{source}:{lineno}: a JSON object is expected, not {type(record)}")
    if text_field not in record:
        raise DocumentError(
            f"{source}:{lineno}: no field {text_field!r} (fields: {', '.join(sorted(record))}); "
            "set text_field"
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise DocumentError(f"{source}:{lineno}: field {text_field!r} is not a string")
    return _to_bytes(value)


@dataclass
class Records:
    """How to read the records of one file: the text field, the id field, the bad-record
    policy, and the bad records found (``file:line: why``)."""

    text_field: str = "text"
    id_field: str | None = None
    on_bad_record: str = "stop"
    skipped: list[str] = field(default_factory=list)

    def check(self, record, source: str, lineno: int, file_id: str) -> str | None:
        """The record's document id, or None if it is bad and skipped (raises on stop)."""
        try:
            if isinstance(record, DocumentError):
                raise record
            _record_text(record, source, lineno, self.text_field)
            if self.id_field is None:
                return f"{file_id}#{lineno}"
            if self.id_field not in record:
                raise DocumentError(f"{source}:{lineno}: no id field {self.id_field!r}")
            value = record[self.id_field]
            if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "":
                raise DocumentError(
                    f"{source}:{lineno}: id field {self.id_field!r} must be a non-empty string "
                    "or an integer"
                )
            return str(value)
        except DocumentError as err:
            if self.on_bad_record == "stop":
                raise
            self.skipped.append(str(err))
            return None


def _jsonl_documents(path: Path, file_id: str, records: Records) -> list[Document]:
    docs: list[Document] = []
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                # Parse now: a bad record is found before any compute, naming the line.
                try:
                    record = _parse_line(line, str(path), lineno)
                except DocumentError as err:
                    record = err
                doc_id = records.check(record, str(path), lineno, file_id)
                if doc_id is not None:
                    docs.append(
                        Document(
                            id=doc_id,
                            source=str(path),
                            line=lineno,
                            text_field=records.text_field,
                            _offset=offset,
                            _length=len(line),
                        )
                    )
            offset += len(line)
    return docs


@functools.lru_cache(maxsize=2)
def _packed_records(source: str, mtime_ns: int) -> list:
    """Every record of a .jsonl.gz, .json, .parquet or .arrow file (None for blank lines),
    parsed once."""
    path = Path(source)
    if source.endswith(TABLE_SUFFIXES):
        return _table_records(path)
    if source.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                lines = f.read().split(b"\n")
        except (OSError, EOFError) as err:
            raise DocumentError(f"{source}: not a readable gzip file ({err})") from None
        return [
            _parse_or_error(line, source, i) if line.strip() else None
            for i, line in enumerate(lines, start=1)
        ]
    try:
        data = json.loads(path.read_bytes().decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as err:
        raise DocumentError(f"{source}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, list):
        raise DocumentError(f"{source}: a .json input must hold an array of records")
    return data


def _table_records(path: Path) -> list:
    """The rows of a Parquet file or an Arrow IPC file/stream, as dicts."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        why = f"reading {path.suffix} needs pyarrow: {PYARROW_INSTALL}"
        raise DocumentError(f"{path}: {why}") from None
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all().to_pylist()
            except pa.ArrowInvalid:  # the file format rather than the stream one
                return pa.ipc.open_file(source).read_all().to_pylist()
    except (OSError, pa.ArrowException) as err:
        raise DocumentError(f"{path}: not a readable {path.suffix} table ({err})") from None


def _parse_or_error(line: bytes, source: str, lineno: int):
    try:
        return _parse_line(line, source, lineno)
    except DocumentError as err:
        return err


def _packed_documents(path: Path, file_id: str, records: Records) -> list[Document]:
    docs: list[Document] = []
    for number, record in enumerate(_packed_records(str(path), path.stat().st_mtime_ns), 1):
        if record is None:
            continue
        doc_id = records.check(record, str(path), number, file_id)
        if doc_id is not None:
            size = len(record[records.text_field].encode("utf-8", "surrogateescape"))
            docs.append(
                Document(
                    id=doc_id,
                    source=str(path),
                    line=number,
                    text_field=records.text_field,
                    packed=True,
                    _length=size,
                )
            )
    return docs


def _suffix(path: Path) -> str:
    return ".jsonl.gz" if path.name.endswith(".jsonl.gz") else path.suffix


def _file_documents(path: Path, file_id: str, records: Records) -> list[Document]:
    kind = _suffix(path)
    if kind == ".jsonl":
        return _jsonl_documents(path, file_id, records)
    if kind in (".jsonl.gz", ".json", *TABLE_SUFFIXES):
        return _packed_documents(path, file_id, records)
    return [Document(id=file_id, source=str(path))]


# What Hugging Face datasets' save_to_disk writes beside its .arrow files: metadata, not text.
SAVE_TO_DISK_METADATA = ("dataset_info.json", "state.json")


def _walk(root: Path) -> list[Path]:
    found = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.name in SAVE_TO_DISK_METADATA and any(p.parent.glob("*.arrow")):
            continue
        if p.is_file() and _suffix(p) in SUFFIXES:
            found.append(p)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class Listing:
    documents: list[Document]
    missing: list[str]
    skipped: list[str] = field(default_factory=list)  # bad records (on_bad_record=skip)


def list_documents(
    inputs: str | Path | Sequence[str | Path],
    *,
    text_field: str = "text",
    id_field: str | None = None,
    on_missing: str = "report",
    on_bad_record: str = "stop",
    max_docs: int | None = None,
) -> Listing:
    """Every document of the inputs, in order; missing paths per the on_missing policy."""
    if on_missing not in ON_MISSING:
        raise DocumentError(f"on_missing must be one of {ON_MISSING}, not {on_missing!r}")
    if on_bad_record not in ON_BAD_RECORD:
        raise DocumentError(f"on_bad_record must be one of {ON_BAD_RECORD}, not {on_bad_record!r}")
    records = Records(text_field, id_field, on_bad_record)
    paths = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    if not paths:
        raise DocumentError("no inputs given")
    docs: list[Document] = []
    missing: list[str] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            missing.append(str(raw))
            continue
        if path.is_dir():
            files = _walk(path)
            if not files:
                raise DocumentError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
            for f in files:
                docs += _file_documents(f, f.relative_to(path).as_posix(), records)
        elif _suffix(path) in SUFFIXES:
            docs += _file_documents(path, path.name, records)
        else:
            raise DocumentError(
                f"{path}: unsupported input (expected a directory or {', '.join(SUFFIXES)})"
            )
    if missing and on_missing == "stop":
        raise MissingInputError(missing)
    seen: dict[str, str] = {}
    for d in docs:
        if d.id in seen:
            raise DocumentError(
                f"two inputs give the same document id {d.id!r}: {seen[d.id]} and {d.source} "
                "(name the directory that holds them instead, or rename one)"
            )
        seen[d.id] = d.source
    if max_docs is not None:
        docs = docs[: max(0, int(max_docs))]
    return Listing(docs, missing, records.skipped)
