"""The scoring job's inputs (a read-only review's findings, each reproduced): ranks that
listed different documents (a file arriving while the job started) waited for each other
until the collective timeout, nothing said; files of an input folder with an upper-case
suffix (BOOK.TXT) or one no reader takes were dropped without a word; a file swapped for a
link out of its folder after the listing was read through the link.

Real processes on gloo for the ranks (tests/distributed.py), real files.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.distributed import run_distributed


def _score_with_rank1_listing_one_less(rank: int, world: int, base: str) -> str:
    """run_longdoc where rank 1's listing lacks the last document (it listed before the
    file arrived): what each rank raised, and after how long."""
    from ringctl.longdoc.params import CorpusParams
    from ringctl.longdoc.run import run_longdoc

    listed = CorpusParams.list_inputs

    def list_inputs(self, *args, **kwargs):
        listing = listed(self, *args, **kwargs)
        if rank == 1:
            listing.documents = listing.documents[:-1]
        return listing

    CorpusParams.list_inputs = list_inputs
    params = {"mode": "score", "inputs": [str(Path(base) / "in")]}
    started = time.monotonic()
    try:
        run_longdoc(params, rank, world, None, Path(base) / "out", lambda m: None)
    except RuntimeError as err:
        return f"{time.monotonic() - started:.0f}s {err}"
    return "no error"


def _score_with_rank1_listing_a_vanished_file(rank: int, world: int, base: str) -> str:
    """run_longdoc where rank 1's listing meets a file removed while it walked the folder
    (FileNotFoundError): what each rank raised."""
    from ringctl.longdoc.params import CorpusParams
    from ringctl.longdoc.run import run_longdoc

    listed = CorpusParams.list_inputs

    def list_inputs(self, *args, **kwargs):
        if rank == 1:
            raise FileNotFoundError(2, "No such file or directory", f"{base}/in/doc1.txt")
        return listed(self, *args, **kwargs)

    CorpusParams.list_inputs = list_inputs
    params = {"mode": "score", "inputs": [str(Path(base) / "in")]}
    try:
        run_longdoc(params, rank, world, None, Path(base) / "out", lambda m: None)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_ranks_that_listed_different_documents_refuse_at_once(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"doc{i}.txt").write_text(f"document number {i} " * 5)
    said = run_distributed(_score_with_rank1_listing_one_less, 2, str(tmp_path))
    for line in said:
        assert "the ranks listed different input documents (task.inputs): rank 0 3 " in line
        assert int(line.split("s ", 1)[0]) < 30, line  # not the collective timeout
    assert not (tmp_path / "out" / "expected.json").exists()
    said = run_distributed(_score_with_rank1_listing_a_vanished_file, 2, str(tmp_path))
    assert all(line.startswith("rank 1: [Errno 2] No such file") for line in said), said


def test_an_input_folder_s_files_are_read_or_named(tmp_path: Path) -> None:
    """BOOK.TXT and data.JSONL were dropped from a folder (suffixes matched by case; named
    alone, BOOK.TXT was refused as "unsupported"), notes.txt.gz too, without a word: the
    first two are read, the third is named in the job's log and in documents.json."""
    from ringctl.longdoc.inputs.documents import list_documents
    from ringctl.longdoc.output.manifest import documents_record

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("plain")
    (folder / "BOOK.TXT").write_text("upper case")
    (folder / "data.JSONL").write_text('{"text": "one"}\n{"text": "two"}\n')
    (folder / "notes.txt.gz").write_bytes(b"\x1f\x8b")
    (folder / ".hidden").write_text("editor state")
    listing = list_documents(folder)
    assert [d.id for d in listing.documents] == [
        "BOOK.TXT",
        "a.txt",
        "data.JSONL#1",
        "data.JSONL#2",
    ]
    assert listing.passed_over == [str(folder / "notes.txt.gz")]
    assert any("not an input" in n and n.endswith("notes.txt.gz") for n in listing.notes())
    assert documents_record([str(folder)], listing)["passed_over"] == listing.passed_over
    assert [d.id for d in list_documents(folder / "BOOK.TXT").documents] == ["BOOK.TXT"]
    texts = [d.read_bytes() for d in listing.documents]
    assert texts == [b"upper case", b"plain", b"one", b"two"]


def test_a_snapshot_s_and_an_upper_case_record_files_are_read(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot's files are links to blobs without a suffix: reading
    through the resolved path (the link check at read) chose the reader by the blob's name,
    a parquet opened as Arrow IPC, a .jsonl.gz as plain lines ("vanished or changed since
    it was listed", 0 documents, exit 0); B.JSONL.GZ and D.PARQUET, listed since suffixes
    are matched in lower case, were read by case-sensitive readers."""
    import gzip
    import json

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from ringctl.longdoc.inputs.documents import list_documents

    repo = tmp_path / "datasets--org--name"
    (repo / "blobs").mkdir(parents=True)
    data = repo / "snapshots" / "rev1" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["row one", "row two"]}), repo / "blobs" / "aaa")
    with gzip.open(repo / "blobs" / "bbb", "wt") as f:
        f.write(json.dumps({"text": "gz"}) + "\n")
    (data / "train.parquet").symlink_to("../../../blobs/aaa")
    (data / "x.jsonl.gz").symlink_to("../../../blobs/bbb")
    upper = tmp_path / "upper"
    upper.mkdir()
    with gzip.open(upper / "B.JSONL.GZ", "wt") as f:
        f.write(json.dumps({"text": "upper gz"}) + "\n")
    pq.write_table(pa.table({"text": ["upper row"]}), upper / "D.PARQUET")
    for folder, want in (
        (data.parent, [b"row one", b"row two", b"gz"]),
        (upper, [b"upper gz", b"upper row"]),
    ):
        assert [d.read_bytes() for d in list_documents(folder).documents] == want


def test_a_folder_s_file_swapped_for_a_link_out_of_it_is_not_read(tmp_path: Path) -> None:
    """Listing refuses links out of an input folder; a file replaced by such a link after
    the listing was read through it (the outside file's bytes became the document)."""
    from ringctl.longdoc.inputs.documents import DocumentError, list_documents

    folder, secret = tmp_path / "in", tmp_path / "secret.txt"
    folder.mkdir()
    secret.write_text("outside the input folder")
    (folder / "doc.txt").write_text("inside")
    (folder / "rows.jsonl").write_text('{"text": "a record"}\n')
    docs = list_documents(folder).documents
    for name in ("doc.txt", "rows.jsonl"):
        (folder / name).unlink()
        (folder / name).symlink_to(secret)
    for doc in docs:
        with pytest.raises(DocumentError, match="now a link to .*outside the input folder"):
            doc.read_bytes()
        assert doc.identity() is None
