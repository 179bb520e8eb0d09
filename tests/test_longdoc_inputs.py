"""Reading a long-document job's inputs as hostile data (issue 19): save_to_disk folders are
read as `datasets` reads them (state.json's files, a DatasetDict by split), every JSON flavour
goes through one reader with one set of bad-record rules, no input is held whole in memory
(a gzip bomb included), damaged files are refused in one line, inputs that leave nothing to
read are refused at submit, and a long document the job cannot size is said at submit."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.longdoc.inputs.documents import DocumentError, list_documents

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "longdoc.yaml"


def _load(*overrides: str):
    return load_job(JOB, ["task.model_path=bundled:demo-byte-llama", *overrides])


# --- save_to_disk folders ------------------------------------------------------------------------


def _arrow(path: Path, texts: list[str]) -> None:
    """An Arrow IPC stream file, as datasets writes its data and cache files."""
    pa = pytest.importorskip("pyarrow")
    table = pa.Table.from_pylist([{"text": t} for t in texts])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _saved(folder: Path, files: dict[str, list[str]], listed: list[str]) -> Path:
    """A save_to_disk folder: the Arrow files, and state.json listing ``listed`` in order."""
    folder.mkdir(parents=True)
    for name, texts in files.items():
        _arrow(folder / name, texts)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {}}}))
    state = {"_data_files": [{"filename": n} for n in listed], "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def test_a_saved_dataset_reads_only_its_listed_files_in_their_order(tmp_path):
    """The cache-*.arrow that datasets writes beside the data after .map() holds rows of
    another computation: they must not be scored. state.json's order is the dataset's."""
    files = {
        "data-00000-of-00002.arrow": ["first", "second"],
        "data-00001-of-00002.arrow": ["third"],
        "cache-5f1e2a.arrow": ["MAPPED first", "MAPPED second"],
    }
    listed = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]
    saved = _saved(tmp_path / "saved", files, listed)
    docs = list_documents(saved).documents
    assert [d.read_bytes() for d in docs] == [b"third", b"first", b"second"]
    assert [d.id for d in docs] == [
        "data-00001-of-00002.arrow#1",
        "data-00000-of-00002.arrow#1",
        "data-00000-of-00002.arrow#2",
    ]
    # below another directory, the same folder is read the same way, beside plain files
    (tmp_path / "notes.txt").write_text("a note")
    ids = [d.id for d in list_documents(tmp_path).documents]
    assert ids == ["notes.txt", *(f"saved/{d.id}" for d in docs)]


@pytest.mark.parametrize(
    "listed, why",
    [
        (["../outside.arrow"], "is not inside"),
        (["/etc/passwd"], "is not inside"),
        (["data-00009-of-00010.arrow"], "is not an .arrow file"),
        ([{"name": "x"}], "needs a filename"),
    ],
)
def test_a_state_json_that_points_elsewhere_is_refused_by_name(tmp_path, listed, why):
    _arrow(tmp_path / "outside.arrow", ["not this dataset's"])
    saved = _saved(tmp_path / "saved", {"data-00000-of-00001.arrow": ["row"]}, [])
    state = {"_data_files": [e if isinstance(e, dict) else {"filename": e} for e in listed]}
    (saved / "state.json").write_text(json.dumps(state))
    with pytest.raises(DocumentError, match=why) as err:
        list_documents(saved)
    assert "state.json" in str(err.value)


def _dataset_dict(root: Path) -> Path:
    root.mkdir()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    _saved(
        root / "train", {"data-00000-of-00001.arrow": ["train row"]}, ["data-00000-of-00001.arrow"]
    )
    _saved(
        root / "test",
        {"data-00000-of-00001.arrow": ["test row 1", "test row 2"], "cache-0a.arrow": ["cached"]},
        ["data-00000-of-00001.arrow"],
    )
    return root


def test_a_dataset_dict_is_read_by_split_and_refused_without_one(tmp_path):
    dd = _dataset_dict(tmp_path / "dd")
    with pytest.raises(DocumentError, match=r"DatasetDict .* splits train, test: set task\.split"):
        list_documents(dd)
    test = list_documents(dd, split="test").documents
    assert [d.id for d in test] == [
        "test/data-00000-of-00001.arrow#1",
        "test/data-00000-of-00001.arrow#2",
    ]
    assert [d.read_bytes() for d in test] == [b"test row 1", b"test row 2"]
    with pytest.raises(DocumentError, match=r"no split 'dev' \(split: one of train, test\)"):
        list_documents(dd, split="dev")
    with pytest.raises(DocumentError, match="no input is a DatasetDict"):
        list_documents(tmp_path / "dd" / "train", split="train")
    # at submit: the job's task.split, refused by name without it
    with pytest.raises(UserError, match=r"task\.inputs: .*splits train, test: set task\.split"):
        _load(f"task.inputs=[{dd}]")
    assert _load(f"task.inputs=[{dd}]", "task.split=train").task.split == "train"


# --- one reader for every JSON flavour -----------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000
LINES = [
    '{"text": "good"}',
    '{"text": "lone \\ud800 surrogate"}',  # valid JSON, but not a character: U+FFFD
    "[1, 2]",
    '{"body": "no text field"}',
    '{"text": 7}',
    '{"text": "deep", "x": ' + DEEP + "}",
]


def _write(path: Path, lines: list[str]) -> Path:
    if path.name.endswith(".jsonl.gz"):
        with gzip.open(path, "wt") as f:
            f.write("\n".join(lines) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    return path


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz", "in.json"])
def test_every_json_flavour_reads_records_alike(tmp_path, name):
    """The same records give the same documents and the same bad records, whatever the file:
    before, a lone surrogate killed .json and .jsonl.gz listing with a UnicodeEncodeError that
    on_bad_record=skip did not catch, and a deep record a RecursionError."""
    deep_ok = name != "in.json"  # a .json element nested too deeply refuses its file below
    path = _write(tmp_path / name, LINES if deep_ok else LINES[:-1])
    listing = list_documents(path, on_bad_record="skip")
    assert [d.read_bytes() for d in listing.documents] == [
        b"good",
        "lone \ufffd surrogate".encode(),
    ]
    assert [d.id for d in listing.documents] == [f"{name}#1", f"{name}#2"]
    why = [s.split(": ", 1)[1] for s in listing.skipped]
    assert why[:3] == [
        "a JSON object is expected, not list",
        "no field 'text' (fields: body); set text_field",
        "field 'text' is not a string",
    ]
    assert [s.split(": ", 1)[0] for s in listing.skipped[:3]] == [f"{path}:{i}" for i in (3, 4, 5)]
    if deep_ok:
        assert listing.skipped[3] == f"{path}:6: nested too deeply to parse"
    with pytest.raises(DocumentError, match=rf"{name}:3: a JSON object is expected"):
        list_documents(path, on_bad_record="stop")


def test_a_json_element_too_deep_to_parse_refuses_its_file_at_submit(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('[{"text": "fine"}, {"text": "x", "deep": ' + DEEP + "}]")
    with pytest.raises(
        UserError, match=r"task\.inputs: .*deep\.json: element 2: nested too deeply"
    ):
        _load(f"task.inputs=[{path}]")


# --- damaged files -------------------------------------------------------------------------------


def _records_gz(path: Path, count: int) -> bytes:
    """A .jsonl.gz of ``count`` records of random-ish text (so deflate keeps most of it)."""
    import random

    rng = random.Random(7)
    lines = [json.dumps({"text": "".join(rng.choices("abcdefghij", k=400))}) for _ in range(count)]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path.read_bytes()


def test_corrupt_or_truncated_gzip_is_refused_in_one_line(tmp_path):
    """Before: corrupt deflate data was a zlib.error traceback at submit."""
    good = _records_gz(tmp_path / "good.jsonl.gz", 2000)
    assert len(list_documents(tmp_path / "good.jsonl.gz").documents) == 2000
    damaged = bytearray(good)
    damaged[10] |= 0x06  # the first deflate block's type: 11, reserved ("invalid block type")
    with pytest.raises(zlib.error):  # what the gzip module raised, uncaught
        gzip.decompress(bytes(damaged))
    (tmp_path / "corrupt.jsonl.gz").write_bytes(good + bytes(damaged))  # a good member first
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) * 3 // 4])
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "not compressed"}\n')
    for name, why in [
        ("corrupt", "after line 2000 (corrupt gzip data at inflated byte "),
        ("cut", "truncated"),
        ("plain", "incorrect header check"),
    ]:
        path = tmp_path / f"{name}.jsonl.gz"
        for policy in ("skip", "stop"):  # the file, not a record: refused under either policy
            with pytest.raises(UserError) as err:
                _load(f"task.inputs=[{path}]", f"task.on_bad_record={policy}")
            msg = str(err.value)
            assert f"{path}: not a readable gzip file after line" in msg and why in msg, msg
            assert "\n" not in msg and "Traceback" not in msg


def test_a_record_read_later_comes_from_its_own_span(tmp_path, monkeypatch):
    """Records of a .jsonl.gz read in another order than the file's (a schedule runs the
    longest first) are the records listed: inflated from the checkpoint before them, by the
    reader that listed them or by a fresh one (another process) that takes its own."""
    from ringctl.longdoc.inputs import inflate, records

    path = tmp_path / "many.jsonl.gz"
    _records_gz(path, 3000)
    want = [json.loads(line)["text"].encode() for line in gzip.open(path)]
    monkeypatch.setattr(inflate, "CHECKPOINT", 64 << 10)  # many checkpoints in a small file,
    monkeypatch.setattr(inflate, "WINDOW_CACHE", 128 << 10)  # and few windows kept
    records._gzip_reader.cache_clear()
    docs = list_documents(path).documents
    assert len(records.gzip_reader(path)._points) >= 5
    order = [2999, 0, 1500, 1499, 2998, 7, 2000]
    assert [docs[i].read_bytes() for i in order] == [want[i] for i in order]
    records._gzip_reader.cache_clear()
    assert [docs[i].read_bytes() for i in order] == [want[i] for i in order]
    records._gzip_reader.cache_clear()
    path.write_bytes(gzip.compress(b'{"text": "replaced"}\n'))
    with pytest.raises(DocumentError):  # changed since listed: the run says so, never misreads
        docs[0].read_bytes()


# --- memory --------------------------------------------------------------------------------------

# The reader's peak in a process of its own: VmHWM (this process's high-water mark; unlike
# getrusage's ru_maxrss it does not carry over the parent's peak across fork and exec) against
# VmRSS before reading (not the peak so far, which an import may have raised).
PEAK = """
import sys
from ringctl.longdoc.inputs.documents import DocumentError, list_documents


def kib(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])


before = kib("VmRSS")
try:
    listing = list_documents(sys.argv[1], on_bad_record="skip", max_record_bytes=int(sys.argv[2]))
    said = f"{len(listing.documents)} document(s); skipped {listing.skipped[0]}"
except DocumentError as err:
    said = f"refused: {err}"
print((kib("VmHWM") - before) * 1024, said)
"""
LIMIT = 8 << 20  # max_record_bytes for these files: the huge record is 16x to 48x over it
BOUND = 8 * LIMIT  # peak growth allowed: the limit, the copies of what is held, and chunks


def _gzip_bomb(path: Path, inflated: int) -> None:
    """One line of ``inflated`` bytes, then a good record, compressed as it is produced."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"a" * (1 << 20)
    with open(path, "wb") as f:
        f.write(z.compress(b'{"text": "'))
        for _ in range(inflated >> 20):
            f.write(z.compress(block))
        f.write(z.compress(b'"}\n{"text": "after"}\n') + z.flush())


def _huge_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b'[{"text": "' if path.suffix == ".json" else b'{"text": "')
        for _ in range(size >> 20):
            f.write(b"a" * (1 << 20))
        f.write(b'"}, {"text": "after"}]' if path.suffix == ".json" else b'"}\n{"text": "after"}\n')


@pytest.mark.parametrize(
    "name, size", [("bomb.jsonl.gz", 384 << 20), ("big.jsonl", 128 << 20), ("big.json", 128 << 20)]
)
def test_reading_inputs_holds_one_bounded_record(tmp_path, name, size):
    """Before: a 400 KB .jsonl.gz that inflates to 384 MiB was read whole (gzip.read()), then
    split: the peak grew by 1151 MiB; a .jsonl line by 386 MiB, a .json file by 255 MiB. Now
    the peak grows by at most BOUND whatever the file's size: a record is held only up to the
    limit (8 MiB here), in 1 MiB pieces (measured: 20 MiB); a .json array's text at most
    doubles past it, and is copied when it grows (measured: 34 MiB)."""
    path = tmp_path / name
    (_gzip_bomb if name.endswith(".gz") else _huge_file)(path, size)
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), str(LIMIT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    grown, said = proc.stdout.split(" ", 1)
    assert int(grown) < BOUND, f"{name}: peak RSS grew by {int(grown) >> 20} MiB"
    if name.endswith(".json"):  # an element that long refuses the file: no point to go on from
        assert said.startswith(f"refused: {path}: element 1: a record longer than 8,388,608")
    else:
        assert said.startswith(f"1 document(s); skipped {path}:1: a record longer than 8,388,608")


# --- nothing to read; a document nothing sizes ---------------------------------------------------


def test_inputs_that_are_all_missing_are_refused_at_submit(tmp_path, capsys):
    """Before: with on_missing=report the job ran, read nothing, ended COMPLETED and gather
    exited 0."""
    from ringctl.cli import main

    gone = [tmp_path / "gone-1.jsonl", tmp_path / "gone-2.txt"]
    argv = ["submit", "longdoc", f"task.inputs=[{gone[0]},{gone[1]}]", f"output_dir={tmp_path}/o"]
    argv.append("task.model_path=bundled:demo-byte-llama")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"no document to read: 2 missing (on_missing=report): {gone[0]}, {gone[1]}" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"no document to read: 1 bad record\(s\) skipped"):
        _load(f"task.inputs=[{bad}]")


def test_a_long_document_nothing_sizes_is_said_at_submit(tmp_path, capsys):
    """No device and no ring.max_tokens_per_rank: before, submit said nothing and the job
    found out in the queue. Now the warning names the longest document and the planner's
    memory for it per rank; with a budget (and no device) a document over it is refused."""
    from dataclasses import replace

    from ringctl.planner.cost import GIB, memory_per_rank
    from ringctl.sizing import Sizing, job_workload
    from ringctl.submission import check_documents

    (tmp_path / "short.txt").write_text("short")
    (tmp_path / "long.txt").write_bytes(b"x" * 3_000_000)
    cfg = _load(f"task.inputs=[{tmp_path}]", "nodes=1", "tasks_per_node=2")
    check_documents(Sizing(cfg))
    err = capsys.readouterr().err
    work = replace(job_workload(cfg, 2), seq_len=3_000_000)  # zigzag on 2: a multiple of 4
    need = sum(memory_per_rank(work, 2).values()) / GIB
    assert err.startswith("warning: the longest document, 'long.txt' (3,000,000 tokens")
    assert f"needs about {need:,.1f} GiB per rank on a ring of 2" in err and need > 1
    assert err.count("\n") == 1
    budget = _load(
        f"task.inputs=[{tmp_path}]",
        "nodes=1",
        "tasks_per_node=2",
        "ring.max_tokens_per_rank=1000000",
    )
    with pytest.raises(UserError, match=r"'long.txt' has 3,000,000 tokens: .* at least 3 ranks"):
        check_documents(Sizing(budget))
    check_documents(Sizing(budget), force=True)
    assert "warning: ring.max_tokens_per_rank: document 'long.txt'" in capsys.readouterr().err
