"""Which documents a long-document job reads, in a stable order, with stable ids.

Inputs (``LongDocParams.inputs``: one path or a list of paths):

* a ``.txt`` or ``.md`` file: one document, its whole content;
* a ``.jsonl`` or ``.jsonl.gz`` file: one document per non-empty line, the JSON object's
  ``text_field`` (default ``"text"``);
* a ``.json`` file holding an array of such objects: one document per element;
* a ``.parquet`` file, or an ``.arrow`` file (Arrow IPC, as Hugging Face ``datasets`` writes
  with ``save_to_disk``): one document per row, its ``text_field`` column (pyarrow needed:
  ``pip install 'ringctl[parquet]'``);
* a Hugging Face ``save_to_disk`` folder: the Arrow files its ``state.json`` lists, in its
  order (not the ``cache-*.arrow`` files ``datasets`` leaves beside them); a ``DatasetDict``
  folder: the split named by ``split`` (``task.split``), refused without one (``saved.py``);
* a directory: every file of those kinds below it, recursively, sorted by relative path
  (hidden files and directories, and symbolic links to directories, are skipped; a
  ``save_to_disk`` folder below it is read as above).

Every file is read one record at a time, in bounded memory (``records.py``): a JSON record
longer than ``max_record_bytes`` (``records.MAX_RECORD_BYTES``, 256 MiB) is a bad record (a
``.json`` element that long refuses its file), and a ``.jsonl.gz`` file is inflated a piece at
a time. A file that cannot be read (corrupt or truncated gzip data, a ``.json`` file that is
not an array, an element that cannot be parsed) is refused by name, whatever the policy.

A record that is not valid JSON (nested too deeply included), not a JSON object with a string
``text_field``, or (with ``id_field``) without that field is a bad record, named by file and
line (``.json``: element number; tables: row number). The same rules hold for every JSON
flavour (``.jsonl``, ``.jsonl.gz``, ``.json``). The ``on_bad_record`` policy decides:
``"stop"`` (the default of ``list_documents``) raises a ``DocumentError``; ``"skip"`` (the
job's default) leaves it out and names it in ``Listing.skipped``. Either way this happens
while listing, before any model runs.

Document ids are stable across runs given the same inputs: a file's path relative to the
directory it was found in (a file named directly: its file name), and ``<file id>#<line>``
(1-based line or element number) for records, or the record's ``id_field`` value when given.
Two documents with the same id are an error. ``Document.key`` is a file-system-safe form of the
id (used for output paths).

Bytes: documents are read as bytes. Invalid UTF-8 is never an error: the byte-level tokenizer
takes the raw bytes as they are (lossless); a text tokenizer gets the text decoded with U+FFFD
for each invalid byte. ``invalid_utf8_count`` counts the bytes that were not valid UTF-8. A
lone surrogate escaped in JSON (``"\\ud800"``: no character at all) becomes U+FFFD.

Identity: a document's outputs record the input they were computed from (``input_identity``:
its size in bytes and sha256, taken from the bytes the job reads anyway); ``Document.identity``
gives it as the input is now, so a resume redoes, and gather refuses, a document whose input
was edited since.

Missing inputs: a path that does not exist is reported, by name, in ``Listing.missing``. What
happens then is the job's ``on_missing`` policy: ``"report"`` (default) logs it, records it
in the output's documents.json and goes on with the others; ``"stop"`` raises
``MissingInputError`` before any document runs. Inputs that leave no document at all (every
one missing, every record bad) are refused either way: a job with nothing to read is not done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...bounded_read import open_regular
from .records import (
    MAX_RECORD_BYTES,
    PYARROW_INSTALL,
    DocumentError,
    Raw,
    file_chunks,
    gzip_lines,
    json_elements,
    parse_record,
    plain_lines,
    read_span,
    record_text,
    table_cell,
    table_rows,
    too_long,
)
from .saved import DATASET_DICT, DATASET_INFO, is_dataset_dict, saved_files

SUFFIXES = (".txt", ".md", ".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
TABLE_SUFFIXES = (".parquet", ".arrow")
TEXT_SUFFIXES = (".txt", ".md")
ON_MISSING = ("report", "stop")
ON_BAD_RECORD = ("skip", "stop")
__all__ = ["PYARROW_INSTALL", "DocumentError", "Document", "Listing", "list_documents"]


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


def invalid_utf8_count(raw: bytes) -> int:
    """How many bytes of ``raw`` are not part of valid UTF-8."""
    text = raw.decode("utf-8", "surrogateescape")  # each invalid byte -> one U+DC80..U+DCFF
    return sum(1 for ch in text if "\udc80" <= ch <= "\udcff")


def input_identity(pieces: Iterable[bytes]) -> dict:
    """What a document's outputs record of the input they were computed from: the size and
    sha256 of its bytes (given in pieces: ``{"bytes": N, "sha256": hex}``). A resume redoes a
    document whose input no longer has it, and gather refuses one
    (``completeness.input_problem``)."""
    digest, size = hashlib.sha256(), 0
    for piece in pieces:
        digest.update(piece)
        size += len(piece)
    return {"bytes": size, "sha256": digest.hexdigest()}


@dataclass(frozen=True)
class Document:
    """One document: where it comes from, and how to read its bytes."""

    id: str
    source: str  # the file path (as given / found)
    line: int | None = None  # 1-based line (JSONL), element number (.json) or row (a table)
    text_field: str = "text"
    size: int = -1  # a record's text in bytes, measured when listed (-1: a whole file)
    _offset: int = field(default=0, repr=False)  # the record's span (a table: its row index)
    _length: int = field(default=-1, repr=False)
    # a folder's file: where its path must still lead when read (``input_root`` of the folder)
    within: str | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return doc_key(self.id)

    @property
    def nbytes(self) -> int:
        """The text's size in bytes: a record's as listed, a file's as it is now."""
        return self.size if self.line is not None else Path(self.source).stat().st_size

    def read_bytes(self) -> bytes:
        """The document's raw bytes. A file gone since listing raises FileNotFoundError; a
        record changed since, a DocumentError."""
        path = self._path()
        if self.line is None:  # a regular file (a link given is followed to one)
            try:
                f = open_regular(path)
            except ValueError as err:
                raise DocumentError(str(err)) from None
            with f:
                return f.read()
        # a record's reader goes by the listed name's suffix (a Hugging Face cache snapshot's
        # files are links to suffix-less blobs: the resolved path says nothing of the format)
        where = f"{self.source}:{self.line}"
        if suffix_of(Path(self.source)) in TABLE_SUFFIXES:
            record = {self.text_field: table_cell(self.source, self._offset, self.text_field)}
        else:
            record = parse_record(read_span(self.source, self._offset, self._length), where)
        text = record_text(record, where, self.text_field)
        if len(text) != self.size:
            raise DocumentError(
                f"{where}: changed since it was listed "
                f"({self.size:,} bytes then, {len(text):,} now)"
            )
        return text

    def _path(self) -> Path:
        """The file to read now, resolved (a link given is followed); a folder's file must
        still lead inside the folder: listing refused links out of it, and a file swapped
        for such a link after the listing was read through it."""
        path = Path(self.source).resolve()
        if self.within is not None and not path.is_relative_to(self.within):
            raise DocumentError(
                f"{self.source}: now a link to {path}, outside the input folder (changed "
                "since it was listed)"
            )
        return path

    def identity(self) -> dict | None:
        """The document's input identity as it is now (``input_identity`` of its bytes), or
        None when it cannot be read now (gone, or a record changed since it was listed). A
        whole file is hashed a block at a time; a record is read as ``read_bytes`` reads it."""
        try:
            if self.line is not None:
                return input_identity([self.read_bytes()])
            return input_identity(file_chunks(self._path()))
        except (OSError, DocumentError):
            return None

    def read_text(self) -> str:
        """The text, with U+FFFD in place of each byte that is not valid UTF-8."""
        return self.read_bytes().decode("utf-8", "replace")

    def describe(self) -> dict:
        return {"id": self.id, "key": self.key, "source": self.source, "line": self.line}


def suffix_of(path: Path) -> str:
    """The suffix that picks a file's reader, in lower case (BOOK.TXT is a .txt: an input
    folder's upper-case files were dropped without a word)."""
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else Path(name).suffix


@dataclass
class Records:
    """How to read the records of a file: the text field, the id field, the bad-record
    policy, the longest record, and the bad records found (``file:line: why``)."""

    text_field: str = "text"
    id_field: str | None = None
    on_bad_record: str = "stop"
    limit: int = MAX_RECORD_BYTES
    skipped: list[str] = field(default_factory=list)

    def documents(self, path: Path, file_id: str) -> list[Document]:
        """The documents of one record file, bad records skipped or refused per the policy."""
        docs: list[Document] = []
        for raw in self._raw(path):
            found = self.check(raw, str(path), file_id)
            if found is not None:
                doc_id, size = found
                docs.append(
                    Document(
                        doc_id, str(path), raw.number, self.text_field, size, raw.offset, raw.length
                    )
                )
        return docs

    def _raw(self, path: Path) -> Iterator[Raw]:
        kind = suffix_of(path)
        if kind == ".jsonl":
            return plain_lines(path, self.limit)
        if kind == ".jsonl.gz":
            return gzip_lines(path, self.limit)
        if kind == ".json":
            return json_elements(str(path), file_chunks(path), self.limit)
        return table_rows(path, self.text_field, self.id_field, self.limit)

    def check(self, raw: Raw, source: str, file_id: str) -> tuple[str, int] | None:
        """(the record's document id, its text's size), or None if it is bad and skipped
        (raises on stop)."""
        where = f"{source}:{raw.number}"
        try:
            if isinstance(raw.record, DocumentError):
                raise raw.record
            size = len(record_text(raw.record, where, self.text_field))
            if size > self.limit:
                raise DocumentError(too_long(where, self.limit))
            return self._id(raw.record, where, f"{file_id}#{raw.number}"), size
        except DocumentError as err:
            if self.on_bad_record == "stop":
                raise
            self.skipped.append(str(err))
            return None

    def _id(self, record: dict, where: str, default: str) -> str:
        if self.id_field is None:
            return default
        if self.id_field not in record:
            raise DocumentError(f"{where}: no id field {self.id_field!r}")
        value = record[self.id_field]
        if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "":
            raise DocumentError(
                f"{where}: id field {self.id_field!r} must be a non-empty string or an integer"
            )
        return check_id(str(value), where)


def _file_documents(path: Path, file_id: str, records: Records) -> list[Document]:
    if suffix_of(path) in TEXT_SUFFIXES:
        return [Document(id=file_id, source=str(path))]
    return records.documents(path, file_id)


def _walk(root: Path, split: str | None, dicts: list[Path], passed: list[str]) -> list[Path]:
    """Every input file below ``root``, sorted by relative path; of a ``save_to_disk``
    folder, its data files only, in its own order (``dicts`` collects DatasetDict folders,
    ``passed`` the files no reader takes: notes.txt.gz, a .csv; hidden files aside)."""
    found: list[tuple[tuple[str, int], Path]] = []
    folders = [root]
    while folders:
        folder = folders.pop()
        data = saved_files(folder, split)
        if data is not None:
            dicts += [folder] if is_dataset_dict(folder) else []
            prefix = "" if folder == root else folder.relative_to(root).as_posix() + "/"
            found += [((prefix, i), p) for i, p in enumerate(data)]
            continue
        arrow = any(folder.glob("*.arrow"))
        for p in folder.iterdir():
            if p.name.startswith(".") or (arrow and p.name == DATASET_INFO):  # metadata
                continue
            if p.is_dir() and not p.is_symlink():  # as Path.rglob: links to folders not followed
                folders.append(p)
            elif p.is_file() and suffix_of(p) in SUFFIXES:
                _check_link(p, root)
                found.append(((p.relative_to(root).as_posix(), 0), p))
            elif p.is_file():
                passed.append(str(p))
            elif not p.is_dir():  # (a link to a folder: not followed, as Path.rglob)
                # listed nowhere, it vanished from the job unsaid (missing: 0, exit 0)
                raise DocumentError(
                    f"{p}: not a regular file or folder (a link to nothing, a pipe, a device "
                    f"or a socket) in the input folder {root}: remove it, or name the inputs "
                    "to read"
                )
    return [p for _, p in sorted(found, key=lambda item: item[0])]


def input_root(folder: Path) -> Path:
    """Where a link in an input folder may lead: the folder itself, or, inside a Hugging Face
    cache snapshot (``datasets--ORG--NAME/snapshots/REV/...``), the repository's folder (its
    files are links to ``../../blobs/``)."""
    real = folder.resolve()
    for above in (real, *real.parents):
        if above.parent.name == "snapshots" and "--" in above.parent.parent.name:
            return above.parent.parent
    return real


def _check_link(path: Path, root: Path) -> None:
    """A file of an input folder that is a link must lead inside the folder (``input_root``):
    a dataset folder holding ``env.txt -> /proc/self/environ`` made the job read, and gather
    hand out as token ids, any file its user can read."""
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(input_root(root)):
            raise DocumentError(f"{path}: a link to {target}, outside the input folder {root}")


def check_id(value: str, where: str) -> str:
    """A document id as text that can be written (safetensors metadata and JSON are UTF-8):
    a lone surrogate (a JSON escape "\\ud800", a byte that is not UTF-8 in an id field or a
    file name) failed every rank at its first write, after the model had loaded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DocumentError(
            f"{where}: the document id {value!r} is not valid Unicode text (a lone "
            "surrogate: an escape or a file name that is not UTF-8)"
        ) from None
    return value


NOTES_SHOWN = 20  # lines of each kind in a job's log (documents.json lists them all)


@dataclass
class Listing:
    documents: list[Document]
    missing: list[str]
    skipped: list[str] = field(default_factory=list)  # bad records (on_bad_record=skip)
    passed_over: list[str] = field(default_factory=list)  # files of a folder no reader takes

    def notes(self, shown: int = NOTES_SHOWN) -> list[str]:
        """What a job's log says of the listing besides its documents: the inputs missing,
        the bad records skipped, the files passed over (the first ``shown`` of each)."""
        kinds = (
            (self.missing, "missing input: {} (on_missing=report: going on with the others)"),
            (self.skipped, "bad record skipped: {} (on_bad_record=skip)"),
            (self.passed_over, f"not an input (read are {', '.join(SUFFIXES)}): {{}}"),
        )
        out = []
        for items, line in kinds:
            out += [line.format(item) for item in items[:shown]]
            out += [f"... and {len(items) - shown} more"] if len(items) > shown else []
        return out


def listing_signature(documents) -> str:
    """The documents' identity as a listing gives them, cheaply: each one's key and size in
    listing order (the order a training run's ``epoch_order`` shuffles), hashed. What the
    ranks of a job compare (``consensus.agreed_inputs``) and a training checkpoint keeps.
    A document added, removed, renamed, reordered or resized changes it; one edited in place
    to the same size does not (reading every document again at each resume is what that
    would take): the one a training resume continues inside is checked by its tokens
    (``Cursor.held``), the others are read as they are when reached, as in a run never
    interrupted."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(f"{doc.key}\t{doc.nbytes}\n".encode())
    return f"{len(documents)}:{digest.hexdigest()[:32]}"


def list_documents(
    inputs: str | Path | Sequence[str | Path],
    *,
    text_field: str = "text",
    id_field: str | None = None,
    on_missing: str = "report",
    on_bad_record: str = "stop",
    max_docs: int | None = None,
    split: str | None = None,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> Listing:
    """Every document of the inputs, in order; missing paths per the on_missing policy."""
    if on_missing not in ON_MISSING:
        raise DocumentError(f"on_missing must be one of {ON_MISSING}, not {on_missing!r}")
    if on_bad_record not in ON_BAD_RECORD:
        raise DocumentError(f"on_bad_record must be one of {ON_BAD_RECORD}, not {on_bad_record!r}")
    records = Records(text_field, id_field, on_bad_record, max_record_bytes)
    paths = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    if not paths:
        raise DocumentError("no inputs given")
    docs: list[Document] = []
    missing: list[str] = []
    dicts: list[Path] = []
    passed: list[str] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            missing.append(str(raw))
        else:
            docs += _input_documents(path, records, split, dicts, passed)
    if missing and on_missing == "stop":
        raise MissingInputError(missing)
    if split is not None and not dicts:
        raise DocumentError(
            f"split {split!r} is set, but no input is a DatasetDict folder ({DATASET_DICT})"
        )
    if not docs:
        raise DocumentError(_nothing_to_read(missing, records.skipped))
    _check_unique(docs)
    if max_docs is not None:
        if int(max_docs) < 1:  # as inputs that leave no document: a job that reads nothing
            raise DocumentError(f"no document to read: max_docs={max_docs} (at least 1)")
        docs = docs[: int(max_docs)]
    return Listing(docs, missing, records.skipped, passed)


def _input_documents(
    path: Path, records: Records, split, dicts: list[Path], passed: list[str]
) -> list[Document]:
    """The documents of one input path that exists: a directory, or a file."""
    if path.is_dir():
        files = _walk(path, split, dicts, passed)
        if not files:
            raise DocumentError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
        docs: list[Document] = []
        within = str(input_root(path))
        for f in files:
            found = _file_documents(f, f.relative_to(path).as_posix(), records)
            docs += [dataclasses.replace(d, within=within) for d in found]
        return docs
    if suffix_of(path) in SUFFIXES:
        if not path.is_file():  # a FIFO named as an input hung listing, on every rank
            raise DocumentError(f"{path}: not a regular file (a pipe, a device or a socket)")
        return _file_documents(path, path.name, records)
    expected = f"a directory or {', '.join(SUFFIXES)}"
    raise DocumentError(f"{path}: unsupported input (expected {expected})")


def _nothing_to_read(missing: list[str], skipped: list[str]) -> str:
    """Why inputs that exist in the config leave no document (a job would read nothing)."""
    why = []
    if missing:
        why.append(f"{len(missing)} missing (on_missing=report): {', '.join(missing)}")
    if skipped:
        why.append(
            f"{len(skipped)} bad record(s) skipped (on_bad_record=skip), the first: {skipped[0]}"
        )
    return "no document to read: " + ("; ".join(why) if why else "the inputs hold none")


def _same_id(first: Document, second: Document) -> str:
    """Why two documents may not share an id, with the way out that fits: two records of one
    file (their id field: lines named), or two inputs (rename, or name their folder)."""
    if first.source == second.source and first.line is not None and second.line is not None:
        return (
            f"two records of {second.source} (records {first.line} and {second.line}) give the "
            f"same document id {second.id!r} (task.id_field): make the ids unique, or leave "
            "task.id_field null (ids are then FILE#N)"
        )
    return (
        f"two inputs give the same document id {second.id!r}: {first.source} and "
        f"{second.source} (name the directory that holds them instead, or rename one)"
    )


def _check_unique(docs: list[Document]) -> None:
    """Ids unique, writable, and their output keys unique too, case aside (a key is a slug
    and 40 bits of the id's hash: two ids of a large corpus can share one, and their shards
    overwrote each other; refused then only by gather, after the whole job had run)."""
    seen: dict[str, Document] = {}
    keys: dict[str, str] = {}
    for d in docs:
        check_id(d.id, d.source)
        if d.id in seen:
            raise DocumentError(_same_id(seen[d.id], d))
        seen[d.id] = d
        key = d.key.casefold()
        if key in keys:
            raise DocumentError(
                f"the document ids {keys[key]!r} and {d.id!r} share the output name {d.key!r}: "
                "rename one"
            )
        keys[key] = d.id
