"""Hostile inputs, round 4 (issue 26): decompression bombs in Parquet and Arrow files, a .json
array padded with whitespace, integers too long for Python to convert, a .jsonl.gz of empty
lines, a Parquet file of one row per row group, and a model config.json nested too deeply.

Each file is built here, small on disk and large once inflated; memory is measured in a
process of its own (``PEAK``), time as CPU time (the machine is shared: wall time is noise)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringctl.errors import UserError
from ringctl.longdoc.inputs.documents import DocumentError, list_documents
from tests.test_longdoc_inputs import PEAK, _load

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
LIMIT = 8 * MIB  # max_record_bytes for the bombs: every huge record is over it


# PEAK of test_longdoc_inputs.py (VmHWM against VmRSS before, in a process of its own), saying
# what the listing found whether or not it skipped anything.
# pyarrow, which a table needs, is imported first: its own import is not the listing's memory.
LISTING = "import pyarrow.compute, pyarrow.parquet\n" + PEAK.replace(
    "skipped {listing.skipped[0]}", "skipped {(listing.skipped or [None])[0]}"
)
assert LISTING.count("or [None]") == 1


def _peak(path: Path, limit: int) -> tuple[int, str]:
    """(how much the listing grew peak RSS by, in bytes; what it said), in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", LISTING, str(path), str(limit)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    grown, said = proc.stdout.split(" ", 1)
    return int(grown), said.strip()


# --- integers too long to convert ---------------------------------------------------------------

HUGE = "9" * 5000  # Python converts at most 4,300 digits (sys.set_int_max_str_digits)


@pytest.mark.parametrize("name", ["in.jsonl", "in.json", "ids.jsonl"])
def test_an_integer_too_long_to_convert_is_a_bad_record(tmp_path, name):
    """Before: a ValueError traceback at submit ("Exceeds the limit (4300 digits) ..."), which
    on_bad_record=skip did not catch, in any field of any JSON flavour and in id_field."""
    path = tmp_path / name
    field = "id" if name == "ids.jsonl" else "n"
    records = [{"text": "first", "id": "a"}, None, {"text": "last", "id": "c"}]
    texts = [json.dumps(r) for r in records]
    texts[1] = f'{{"text": "middle", "{field}": {HUGE}}}'
    if name == "in.json":
        path.write_text("[" + ", ".join(texts) + "]")
    else:
        path.write_text("\n".join(texts) + "\n")
    id_field = "id" if name == "ids.jsonl" else None
    listing = list_documents(path, on_bad_record="skip", id_field=id_field)
    assert [d.read_bytes() for d in listing.documents] == [b"first", b"last"]
    where = f"{path}: element 2" if name == "in.json" else f"{path}:2"
    assert listing.skipped == [
        f"{where}: an integer of more than 4,300 digits (the most Python converts)"
    ]
    with pytest.raises(DocumentError, match="an integer of more than 4,300 digits"):
        list_documents(path, on_bad_record="stop", id_field=id_field)


# --- whitespace between .json elements ----------------------------------------------------------


def _spaced(path: Path, gap: int) -> Path:
    """A .json array of two records with ``gap`` bytes of whitespace between and after them."""
    with open(path, "wb") as f:
        f.write(b'[{"text": "before"},')
        for _ in range(gap // MIB):
            f.write(b" \n\t\r" * (MIB // 4))
        f.write(b'{"text": "after"}')
        for _ in range(gap // MIB):
            f.write(b"\n" * MIB)
        f.write(b"]")
    return path


def test_whitespace_between_json_elements_costs_linear_time_and_no_memory(tmp_path):
    """Before: 2 x 96 MiB of whitespace grew the listing's peak by 196 MiB (the whitespace was
    never released) and took 8.4 s (the buffer re-joined for every MiB read: quadratic; 400 MB:
    34-59 s). Now whitespace is dropped as it is passed (measured: 4 MiB, 0.4 s of CPU)."""
    path = _spaced(tmp_path / "spaced.json", 96 * MIB)
    grown, said = _peak(path, 256 * MIB)
    assert said.startswith("2 document(s)") and grown < 32 * MIB, grown >> 20
    t0 = time.process_time()
    docs = list_documents(path).documents
    assert time.process_time() - t0 < 4.0
    assert [d.read_bytes() for d in docs] == [b"before", b"after"]


def test_whitespace_counts_against_the_record_limit(tmp_path):
    path = _spaced(tmp_path / "spaced.json", 16 * MIB)
    with pytest.raises(DocumentError) as err:
        list_documents(path, max_record_bytes=LIMIT)
    assert str(err.value) == (
        f"{path}: more than 8,388,608 bytes of whitespace before element 2 (whitespace between "
        "records counts against the most one record may hold)"
    )
    small = tmp_path / "small.json"  # 2 MiB of whitespace, then a record of 1.5 MiB
    small.write_bytes(
        b'[{"text": "a"},' + b" " * (2 * MIB) + b'{"text": "' + b"b" * (3 * MIB // 2) + b'"}]'
    )
    with pytest.raises(DocumentError, match="element 2: a record longer than 3,145,728"):
        list_documents(small, max_record_bytes=3 * MIB)
    assert len(list_documents(small, max_record_bytes=4 * MIB).documents) == 2


# --- blank lines in bulk ------------------------------------------------------------------------


def test_a_gzip_of_empty_lines_is_read_past_in_bulk(tmp_path):
    """Before: a 255 KB .jsonl.gz inflating to 256 Mi empty lines took 48-52 s of CPU (one
    readline each); here 64 Mi of them took 12 s. Now blank runs are skipped a buffer at a time
    (measured: 0.2 s; 256 Mi: 0.7 s), and line numbers (the documents' ids) stay the same."""
    path = tmp_path / "blank.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b'{"text": "first"}\n')
        for _ in range(64):
            f.write(b"\n" * MIB)
        f.write(b' \t\r\n\n  {"text": "last"}\n\n')
    assert path.stat().st_size < 100_000
    t0 = time.process_time()
    docs = list_documents(path).documents
    assert time.process_time() - t0 < 3.0
    assert [d.id for d in docs] == ["blank.jsonl.gz#1", f"blank.jsonl.gz#{64 * MIB + 4}"]
    assert [d.read_bytes() for d in docs] == [b"first", b"last"]


def test_blank_lines_keep_their_numbers_in_plain_jsonl(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_bytes(b'\n\n{"text": "a"}\r\n  \n\t\n{"text": "b"}\n   {"text": "c"}')
    docs = list_documents(path).documents
    assert [(d.id, d.read_bytes()) for d in docs] == [
        ("gaps.jsonl#3", b"a"),
        ("gaps.jsonl#6", b"b"),
        ("gaps.jsonl#7", b"c"),
    ]


# --- Parquet and Arrow bombs --------------------------------------------------------------------

pa = pytest.importorskip("pyarrow")  # the test extra has it (and .[parquet])
pq = pytest.importorskip("pyarrow.parquet")


def _parquet(path: Path, texts: list[str], **options) -> Path:
    table = pa.table({"text": texts, "id": [f"r{i}" for i in range(len(texts))]})
    pq.write_table(table, path, compression="zstd", **options)
    return path


def _distinct(count: int, size: int) -> list[str]:
    base = "a" * size
    return [f"{i:08d}{base[8:]}" for i in range(count)]


def test_a_parquet_dictionary_bomb_is_listed_without_expanding_it(tmp_path):
    """One 24 MiB value in 64 rows: 2 KB on disk, 1.5 GiB once expanded. Before: the batch of
    64 rows was expanded and converted to Python (peak 1.7 GiB, 7.4 s; the issue's 4 x 200 MiB
    gave a MemoryError). Now the column is read as a dictionary (its pages hold indices only)
    and measured, never converted: the peak is a few copies of the one value (106 MiB). (With
    a limit under 20 MiB the 24 MiB dictionary page itself refuses the file, before anything
    is inflated: test_a_parquet_page_too_large_to_inflate_refuses_its_file.)"""
    value = pa.array(["b" * (24 * MIB)])  # written as a dictionary, as a writer would
    texts = pa.DictionaryArray.from_arrays(pa.array([0] * 64, pa.int32()), value)
    path = _parquet(tmp_path / "dict.parquet", texts)
    assert path.stat().st_size < 64_000
    t0 = time.monotonic()
    limit = 22 * MIB  # under the value (each record too long), its page within limit + 4 MiB
    grown, said = _peak(path, limit)
    assert grown < 8 * 24 * MIB, grown >> 20
    assert time.monotonic() - t0 < 30
    assert said == (
        f"refused: no document to read: 64 bad record(s) skipped (on_bad_record="
        f"skip), the first: {path}:1: a record longer than 23,068,672 bytes (the "
        "most one record may hold); put a longer document in a .txt file of its "
        "own"
    )


def test_parquet_pages_of_long_values_are_decoded_a_row_at_a_time(tmp_path):
    """24 distinct 9 MiB values, a page each. Before: one batch of all 24 rows, then as many
    Python strings (peak 740 MiB). Now the pages' headers size the batches: one row at a time,
    measured, not converted (peak 47 MiB); a good row after them is read back."""
    texts = [*_distinct(24, 9 * MIB), "a good row"]
    options = {"use_dictionary": False, "write_batch_size": 1}
    path = _parquet(tmp_path / "long.parquet", texts, **options)
    grown, said = _peak(path, LIMIT)
    assert grown < 96 * MIB, grown >> 20
    assert said.startswith(f"1 document(s); skipped {path}:1: a record longer than 8,388,608")
    listing = list_documents(path, on_bad_record="skip", max_record_bytes=LIMIT)
    assert [d.read_bytes() for d in listing.documents] == [b"a good row"]
    assert [d.line for d in listing.documents] == [25] and len(listing.skipped) == 24


def test_a_parquet_page_too_large_to_inflate_refuses_its_file(tmp_path):
    """pyarrow's writer put 24 distinct 8 MiB values in one 192 MiB dictionary page, which a
    reader inflates whole (several copies) before any value can be measured: over one record's
    limit and 4 MiB, the file is refused, naming the page, before anything is inflated."""
    from ringctl.longdoc.inputs.records import table_rows

    path = _parquet(tmp_path / "one-page.parquet", _distinct(24, 8 * MIB))
    with pytest.raises(DocumentError) as err:
        list(table_rows(path, "text", None, limit=LIMIT))
    assert str(err.value).startswith(
        f"{path}: row group 1, column 'text': a dictionary page inflates to 201,326,"
    )
    assert "more than 12,582,912 (one record's limit and 4 MiB), and is read whole" in str(
        err.value
    )


def _arrow(path: Path, texts: list[str], compression: str | None) -> Path:
    table = pa.table({"text": texts})
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
    return path


def test_a_compressed_arrow_bomb_is_refused_before_it_is_inflated(tmp_path):
    """4 x 100 MiB in one zstd record batch: 13 KB on disk. Before: the batch was inflated and
    its rows became Python strings (peak 906 MiB; the issue's 4 x 200 MiB: 1.87 GB). Now the
    batch's metadata (each buffer's inflated length) refuses the file before anything is
    inflated (peak 1 MiB)."""
    path = _arrow(tmp_path / "bomb.arrow", ["c" * (100 * MIB)] * 4, "zstd")
    assert path.stat().st_size < 64_000
    grown, said = _peak(path, LIMIT)
    assert grown < 32 * MIB, grown >> 20
    assert said.startswith(
        f"refused: {path}: record batch 1 (rows 1-4), compressed, inflates to 419,430,4"
    )
    assert said.endswith(
        f"more than {LIMIT + 4 * MIB:,} (one record's limit and 4 MiB), and is read whole: write the "
        "table uncompressed (as datasets' save_to_disk does) or in smaller record batches, or "
        "put documents this long in .txt files"
    )


def test_an_uncompressed_arrow_file_is_measured_not_converted(tmp_path):
    """save_to_disk's files are uncompressed: memory-mapped, their long rows are measured from
    the offsets and skipped by name, never copied (peak 4 MiB; before: converted to Python,
    274 MiB for 128 MiB of rows)."""
    path = _arrow(tmp_path / "long.arrow", [*_distinct(8, 16 * MIB), "short"], None)
    grown, said = _peak(path, LIMIT)
    assert grown < 48 * MIB, grown >> 20
    assert said.startswith(f"1 document(s); skipped {path}:1: a record longer than 8,388,608")
    docs = list_documents(path, on_bad_record="skip", max_record_bytes=LIMIT).documents
    assert [d.read_bytes() for d in docs] == [b"short"]


def test_table_cells_keep_invalid_utf8_as_json_strings_do(tmp_path):
    """A string cell that is not valid UTF-8 (pyarrow does not check on write): before, a
    UnicodeDecodeError traceback at submit. Now its bytes are the document, as in JSON."""
    data = pa.py_buffer(b"ok\xff\xfebad")
    offsets = pa.py_buffer(pa.array([0, 2, 7], pa.int32()).buffers()[1])
    column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, data])
    path = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"text": column, "id": column}), path)
    docs = list_documents(path).documents
    assert [d.read_bytes() for d in docs] == [b"ok", b"\xff\xfebad"]
    # as an id it cannot be written (safetensors metadata, JSON: UTF-8): every rank failed at
    # its first write, after the model had loaded; refused at listing, naming the record
    with pytest.raises(DocumentError, match=r"bytes.parquet:2: the document id .* not valid Uni"):
        list_documents(path, id_field="id")


TEXTS = ["alpha", None, "gamma \u00e9", "delta" * 1000, "", "zeta"] * 20


def _ipc(path: Path, table, writer, compression: str | None) -> Path:
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink, writer(sink, table.schema, options=options) as w:
        w.write_table(table, max_chunksize=17)
    return path


@pytest.mark.parametrize(
    "name",
    [
        "groups.parquet",
        "plain.parquet",
        "stream.arrow",
        "file-lz4.arrow",
        "dictionary-zstd.arrow",
        "large.arrow",
        "view.arrow",
    ],
)
def test_every_table_layout_lists_and_reads_back_alike(tmp_path, name):
    """Row groups, pages, record batches (compressed or not, stream or file format), dictionary
    columns and string types: listed by their sizes, each row read back from its own batch, in
    reverse order (a job reads longest first), equal to the values written."""
    kind = {"large": pa.large_string(), "view": pa.string_view()}.get(name.split(".")[0])
    text = pa.array(TEXTS, kind or pa.string())
    text = text.dictionary_encode() if name.startswith("dictionary") else text
    table = pa.table({"text": text, "id": list(range(len(TEXTS)))})
    path = tmp_path / name
    if name == "groups.parquet":
        pq.write_table(table, path, row_group_size=7)
    elif name == "plain.parquet":
        pq.write_table(table, path, use_dictionary=False, data_page_size=64, write_batch_size=3)
    else:
        writer = pa.ipc.new_file if "file" in name or "dictionary" in name else pa.ipc.new_stream
        compression = {"file-lz4.arrow": "lz4", "dictionary-zstd.arrow": "zstd"}.get(name)
        _ipc(path, table, writer, compression)
    listing = list_documents(path, id_field="id", on_bad_record="skip")
    docs = listing.documents[::-1]
    want = [(str(i), t.encode()) for i, t in enumerate(TEXTS) if t is not None][::-1]
    assert [(d.id, d.read_bytes()) for d in docs] == want
    assert len(listing.skipped) == TEXTS.count(None)


def test_documents_of_a_parquet_file_of_many_row_groups_parse_its_footer_once(
    tmp_path, monkeypatch
):
    """One row per row group: before, every document read parsed the footer again (33 ms with
    20,000 groups: 11 minutes per rank; measured here: 23.6 ms). Now the file stays open, its
    footer parsed once (0.10 ms a document)."""
    path = _parquet(tmp_path / "groups.parquet", [f"doc {i}" for i in range(300)], row_group_size=1)
    docs = list_documents(path).documents
    opened = []

    class Counted(pq.ParquetFile):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Counted)
    assert [d.read_bytes() for d in docs[::-1]] == [f"doc {i}".encode() for i in range(300)][::-1]
    assert len(opened) <= 2, len(opened)  # the plain reader, and one reading dictionaries


# --- a model config nested too deeply -----------------------------------------------------------


def test_a_model_config_nested_too_deeply_is_one_line_at_submit(tmp_path):
    """Before: a RecursionError traceback at submit."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(UserError) as err:
        _load(f"task.model_path={model}", f"task.inputs=[{tmp_path / 'doc.txt'}]")
    assert str(err.value).endswith(
        f"task.model_path: {model}/config.json: unreadable model config (nested too deeply "
        "to parse)"
    )
    assert "\n" not in str(err.value)


def test_inputs_that_read_elsewhere_or_block_are_refused_by_name(tmp_path):
    """From a review: a file of an input folder linked to /etc/passwd or /proc/self/environ
    was read (and its bytes handed out by gather as token ids); a FIFO named as an input hung
    listing on every rank; ids that are not valid Unicode (a JSON escape, a file name that is
    not UTF-8) failed every rank at its first write; two ids sharing an output key (slug and
    40 bits of hash) overwrote each other's shards, refused only by gather afterwards."""
    import json as json_

    from ringctl.longdoc.inputs import documents

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("fine\n")
    (folder / "passwd.txt").symlink_to("/etc/passwd")
    with pytest.raises(DocumentError, match=r"passwd.txt: a link to /etc/passwd, outside the"):
        list_documents(folder)
    (folder / "passwd.txt").unlink()
    (folder / "inside.txt").symlink_to(folder / "a.txt")  # inside: read as any file
    assert [d.id for d in list_documents(folder).documents] == ["a.txt", "inside.txt"]

    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(DocumentError, match=r"pipe.jsonl: not a regular file"):
        list_documents(tmp_path / "pipe.jsonl")

    escaped = tmp_path / "escaped.jsonl"
    records = [{"id": "\ud800", "text": "x"}, {"id": "fine", "text": "y"}]
    escaped.write_text("".join(json_.dumps(r) + "\n" for r in records))
    with pytest.raises(DocumentError, match=r"escaped.jsonl:1: the document id .* not valid"):
        list_documents(escaped, id_field="id")
    skipping = list_documents(escaped, id_field="id", on_bad_record="skip")
    assert [d.id for d in skipping.documents] == ["fine"] and len(skipping.skipped) == 1

    monkey = pytest.MonkeyPatch()
    try:  # two ids whose keys collide (a hash collision, found by search in the review)
        monkey.setattr(documents.Document, "key", property(lambda d: "same-key"))
        both = tmp_path / "both.jsonl"
        both.write_text("".join(json_.dumps({"id": i, "text": "t"}) + "\n" for i in "ab"))
        with pytest.raises(DocumentError, match="'a' and 'b' share the output name 'same-key'"):
            list_documents(both, id_field="id")
    finally:
        monkey.undo()


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    """Some editors start UTF-8 files with a byte-order mark: a .jsonl's first record was a
    bad record (skipped under on_bad_record=skip, the rest kept) and a .json was "not an
    array". The mark is read past, in plain and gzip files alike."""
    records = [{"text": "first record"}, {"text": "second"}]
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + lines)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + lines))
    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(records).encode())
    for name in ("a.jsonl", "a.jsonl.gz", "a.json"):
        docs = list_documents(tmp_path / name).documents
        assert [d.read_bytes() for d in docs] == [b"first record", b"second"], name


# --- a pipe swapped in after the listing ---------------------------------------------------------


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz", "in.json", "in.parquet"])
def test_a_pipe_swapped_in_after_the_listing_is_refused_not_waited_on(tmp_path, name):
    """A record file replaced by a FIFO between the listing and a rank's read blocked that
    rank forever (a plain open of a pipe waits for a writer); now the read refuses it by
    name. SIGALRM turns a hang into a failure here."""
    import signal

    path = tmp_path / name
    records = [{"text": "first"}, {"text": "second"}]
    if name.endswith(".parquet"):
        _parquet(path, pa.array([r["text"] for r in records]))
    elif name.endswith(".json"):
        path.write_text(json.dumps(records))
    else:
        lines = "".join(json.dumps(r) + "\n" for r in records).encode()
        path.write_bytes(gzip.compress(lines) if name.endswith(".gz") else lines)
    docs = list_documents(path).documents
    assert len(docs) == 2
    path.unlink()
    os.mkfifo(path)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the read waited on a pipe"))
    signal.alarm(10)
    try:
        with pytest.raises(ValueError, match=f"{path}.*not a regular file"):
            docs[1].read_bytes()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
