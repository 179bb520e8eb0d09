"""Every name in a long-document job's output, in one place (as ``ringctl.jobdir`` is for the
job directory): the store writes by these names, and resume, gather and ``ringctl status``
read by them. Torch-free, so the manifest readers and the status verb import it cheaply.

Under the job's output directory::

    longdoc/run.json                            the run's settings (a rerun must match them)
    longdoc/documents.json                      the document list (ids, sources; missing inputs)
    longdoc/expected.json                       the documents the run set out to compute
    longdoc/shards/<doc key>/rank-00003.safetensors   rank 3's tensors for the document
    longdoc/shards/<doc key>/rank-00003.json          its manifest entry
    longdoc/grads/<doc key>.safetensors         (mode grad, write_grads) summed gradients, rank 0

A rank's entry and data file are found by these fixed names, never by the name an entry gives.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT = "ringctl.longdoc/1"  # run.json, documents.json and every manifest entry say it
SUBDIR = "longdoc"
RUN_FILE = "run.json"  # under SUBDIR: what makes a directory a long-document output
DOCUMENTS_FILE = "documents.json"
EXPECTED_FILE = "expected.json"
SHARDS = "shards"
GRADS = "grads"


def entry_name(rank: int) -> str:
    """rank-NNNNN.json: a rank's manifest entry for one document."""
    return f"rank-{rank:05d}.json"


ENTRY_NAME = re.compile(r"rank-[0-9]{5}\.json")  # what entry_name gives: rank = name[5:10]


def data_name(rank: int) -> str:
    """rank-NNNNN.safetensors: a rank's tensors for one document."""
    return f"rank-{rank:05d}.safetensors"


class OutputPaths:
    """Where each file of a long-document output is, under its ``longdoc/`` folder (``root``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def documents_file(self) -> Path:
        return self.root / DOCUMENTS_FILE

    @property
    def expected_file(self) -> Path:
        return self.root / EXPECTED_FILE

    def doc_dir(self, key: str) -> Path:
        return self.root / SHARDS / key

    def entry_path(self, key: str, rank: int) -> Path:
        return self.doc_dir(key) / entry_name(rank)

    def data_path(self, key: str, rank: int) -> Path:
        return self.doc_dir(key) / data_name(rank)

    def grads_path(self, key: str) -> Path:
        return self.root / GRADS / f"{key}.safetensors"
