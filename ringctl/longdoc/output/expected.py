"""The documents a long-document run must produce, fixed when it starts: ``longdoc/expected.json``.

``documents.json`` is rewritten by every attempt, so on its own it cannot say what a complete
result is: a ``documents.json`` cut down to one document would make one document look like the
whole job. ``write_expected`` records, once, the documents the run set out to compute (id, key,
source, line, and token count where known) and their count; it never rewrites the file.
``check_expected`` tells a later attempt that lists other documents (inputs changed) to use a new
output directory. ``expected_problems`` is gather's check of documents.json against the file
(when it exists: outputs from before it are gathered as they are).

Like the shard checksums, this protects against accidents (a truncated or regenerated list), not
against an editor of the job directory, who can rewrite this file too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...atomic import atomic_write_json
from .manifest import documents_problems, is_int, read_json_object
from .names import OutputPaths

EXPECTED_FORMAT = "ringctl.longdoc.output.expected/1"
_SHOWN = 8  # names listed in one message before "and N more"


def _described(doc: Any) -> dict:
    """A documents.Document or its describe() dict -> the fields expected.json keeps."""
    d = doc.describe() if hasattr(doc, "describe") else dict(doc)
    return {"id": d["id"], "key": d["key"], "source": d.get("source"), "line": d.get("line")}


def expected_record(documents, tokens: dict[str, int] | None = None) -> dict:
    """The expected.json object for these documents (tokens: id -> token count, optional)."""
    docs = [_described(d) for d in documents]
    for d in docs:
        if tokens and d["id"] in tokens:
            d["tokens"] = int(tokens[d["id"]])
    return {"format": EXPECTED_FORMAT, "count": len(docs), "documents": docs}


def some_names(ids: list[str]) -> str:
    """The first few ids, quoted, and how many more: for one line that names documents."""
    shown = ", ".join(repr(i) for i in ids[:_SHOWN])
    return shown + (f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else "")


def _differences(expected: list[dict], listed: list[dict]) -> list[str]:
    """What differs between two document lists, by id (one line per kind of difference)."""
    want = {d["id"]: d for d in expected}
    have = {d["id"]: d for d in listed}
    problems = []
    missing = [i for i in want if i not in have]
    extra = [i for i in have if i not in want]
    if missing:
        problems.append(
            f"{len(missing)} expected document(s) are not listed: {some_names(missing)}"
        )
    if extra:
        problems.append(f"{len(extra)} listed document(s) were not expected: {some_names(extra)}")
    moved = [
        i
        for i in want
        if i in have
        and (want[i]["key"], want[i].get("source")) != (have[i]["key"], have[i].get("source"))
    ]
    if moved:
        problems.append(
            f"document(s) with another key or source than expected: {some_names(moved)}"
        )
    return problems


def read_expected(root: str | Path) -> tuple[dict | None, list[str]]:
    """(expected.json under root, []), (None, []) when there is none, or (None, problems)."""
    path = OutputPaths(root).expected_file
    if not os.path.lexists(path):
        return None, []
    data, problem = read_json_object(path)
    if data is None:
        return None, [problem]
    problems = documents_problems(data, str(path))
    if not problems and (data.get("count") != len(data["documents"]) or not is_int(data["count"])):
        problems = [f"{path}: count={data.get('count')!r} but {len(data['documents'])} documents"]
    if not problems and data.get("format") != EXPECTED_FORMAT:
        problems = [f"{path}: format={data.get('format')!r} (expected {EXPECTED_FORMAT!r})"]
    return (None if problems else data), problems


def check_expected(root: str | Path, documents) -> str:
    """An empty string when documents are what the run set out to compute (or nothing was
    recorded yet), else one line saying what changed (every rank agrees on it before work)."""
    data, problems = read_expected(root)
    if problems:
        return problems[0]
    if data is None:
        return ""
    diff = _differences(data["documents"], [_described(d) for d in documents])
    if not diff:
        return ""
    where = OutputPaths(root).expected_file
    return (
        f"{where}: this output directory was started for other documents "
        f"({'; '.join(diff)}); use a new output directory, or the same inputs to resume"
    )


def write_expected(root: str | Path, documents, tokens: dict[str, int] | None = None) -> Path:
    """Record the documents a run must produce, once (rank 0, at the start of the first
    attempt). An existing file is kept as it is; if it lists other documents, ValueError
    (``check_expected``'s line)."""
    path = OutputPaths(root).expected_file
    problem = check_expected(root, documents)
    if problem:
        raise ValueError(problem)
    if not path.exists():
        atomic_write_json(path, expected_record(documents, tokens), indent=1)
    return path


def absent_note(root: str | Path) -> list[str]:
    """Gather's note when there is no expected.json (outputs of a release before it, or a
    file removed since): documents.json's list, which nothing can check then, is taken as
    the whole job (a list cut down to one document gathered as a whole job, unsaid)."""
    path = OutputPaths(root).expected_file
    if os.path.lexists(path):
        return []
    return [
        f"{path} is absent (outputs older than it, or removed): the documents "
        f"{OutputPaths(root).documents_file.name} lists are taken as the whole job"
    ]


def expected_problems(root: Path, listed: list[dict]) -> tuple[dict[str, int], list[str]]:
    """Gather's check: ({id: expected token count} where recorded, problems of documents.json
    against expected.json). No expected.json: ({}, [])."""
    data, problems = read_expected(root)
    if data is None:
        return {}, problems
    paths = OutputPaths(root)
    problems = [
        f"{paths.documents_file} disagrees with {paths.expected_file}: {p}"
        for p in _differences(data["documents"], listed)
    ]
    tokens = {d["id"]: d["tokens"] for d in data["documents"] if is_int(d.get("tokens"))}
    return tokens, problems
