"""A long-document job's own manifests, run.json and documents.json: their one owner.

Rank 0 writes them through ``write_run`` and ``write_documents`` (objects built by
``run_record`` and ``documents_record``). The job's processes, a remote copy of its directory,
or anyone who can edit it may have written what is there, so they are read back as hostile
input: ``ringctl gather`` (and the resume check in ``completeness``) only trusts what passes
``read_run`` and ``read_documents``. A document's ``key`` becomes a directory and a file
name, so it must be one plain name from a fixed character set (no separator, no ``.``/``..``)
and be the key of its id (``documents.doc_key``): a key like ``../x`` or ``/tmp/x`` can never
reach a path. Two documents with the same id or key are refused (their outputs would
overwrite each other).

Every reader returns ``(value, problems)``: problems are one line each, naming the file and
the key, and the caller decides how to report them (gather: exit status 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ringattn import LAYOUTS

from ...atomic import atomic_write_json
from ...bounded_read import read_regular
from ..compute import MODES
from ..inputs.documents import Listing, doc_key
from ..model.directory import IDENTITY_OF_PATH, moved_install
from .names import DOCUMENTS_FILE, FORMAT, RUN_FILE, OutputPaths

# One path component: what documents.doc_key produces (letters, digits, ".", "_", "-"; never
# starting with "."), at most 128 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
MAX_WORLD_SIZE = 1 << 16  # more ranks than any job has: a bound before looping over them
MAX_MANIFEST_BYTES = 1 << 30  # documents.json of millions of documents is hundreds of MB


def is_safe_name(value: Any) -> bool:
    """A single file name of the fixed character set (no separator, not "." or "..")."""
    return isinstance(value, str) and SAFE_NAME.fullmatch(value) is not None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_json_object(path: Path) -> tuple[dict | None, str]:
    """(the JSON object in path, "") or (None, a one-line reason). A regular file only, not
    through a link (one out of the job read another's manifest) nor a pipe (which hung
    gather), and at most MAX_MANIFEST_BYTES."""
    if not os.path.lexists(path):
        return None, f"{path} is missing"
    try:
        raw = read_regular(path, MAX_MANIFEST_BYTES)
    except ValueError as err:  # read_regular names the file
        return None, str(err)
    except OSError as err:
        return None, f"{path}: cannot be read ({err})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        return None, f"{path}: not valid JSON ({err})"
    except RecursionError:
        return None, f"{path}: not valid JSON (nested too deeply)"
    if not isinstance(data, dict):
        return None, f"{path}: expected a JSON object, found {type(data).__name__}"
    return data, ""


def run_record(world_size: int, signature: dict) -> dict:
    """run.json's object: the output format, the job's size, and what a rerun in the same
    output directory must keep (``LongDocParams.signature``)."""
    return {"format": FORMAT, "world_size": world_size, **signature}


def run_fingerprint(run: dict) -> str:
    """What decides a run's numbers, hashed: every key of its run.json but its size and the
    paths, whose files' identities (``model``, ``tokenizer``) stand for them (an installed
    model moves with the install), and where the tokenizer came from (UTF-8 bytes, the
    model's folder, its own). Each shard's entry records it; gather and resume take only the
    shards of this run (another job's copied in, a model of the same tokenizer, was gathered
    as this one's: wrong numbers, exit 0)."""
    tokenizer, model = run.get("tokenizer_path"), run.get("model_path")
    kept = {k: v for k, v in run.items() if k not in ("format", "world_size", *IDENTITY_OF_PATH)}
    kept["tokenizer_from"] = (
        "bytes" if tokenizer is None else ("model" if tokenizer == model else "own")
    )
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_run(root: Path, record: dict) -> None:
    """run.json under root (the ``longdoc/`` directory), rewritten by every attempt."""
    atomic_write_json(OutputPaths(root).run_file, record, indent=1)


IDENTITY_KEYS = tuple(IDENTITY_OF_PATH.values())  # the files' sha256 (model_identity)


def other_run(root: Path, signature: dict, *, installed: bool = False) -> str:
    """Why root does not hold this run's results ("" when it does, or holds none). The job's
    size may differ (a resume on more or fewer ranks, or other ring sizes): each document's
    entries record the ring that wrote it. Every key either side records is compared, a key
    one side lacks as None: a signature leaves out what a run did not set (model_overrides),
    and a resume without the overrides once mixed both models' results. A signature without
    the model's identity (only rank 0 computes it) leaves the identity keys, and the paths
    they vouch for, to rank 0 (whose refusal every rank hears); an ``installed`` model's
    paths moved with the install are excused where the identities are equal
    (``directory.moved_install``)."""
    path, want = OutputPaths(root).run_file, {"format": FORMAT, **signature}
    if not os.path.lexists(path):
        return ""
    have, problem = read_json_object(path)
    if have is None:
        return f"{path}: unreadable ({problem.removeprefix(f'{path}: ')})"
    # ranks but 0 have no identity: the files, and the paths it vouches for, are rank 0's
    identity = () if "model" in want else (*IDENTITY_KEYS, *IDENTITY_OF_PATH)
    unjudged = {"world_size", *identity, *moved_install(have, want, installed=installed)}
    keys = sorted((want.keys() | have.keys()) - unjudged)
    diff = {k: (have.get(k), want.get(k)) for k in keys if have.get(k) != want.get(k)}
    if not diff:
        return ""
    detail = ", ".join(
        f"{k}: not recorded there (written before ringctl recorded it)"
        if a is None and k in IDENTITY_KEYS
        else f"{k}: {a!r} there, {b!r} now"
        for k, (a, b) in diff.items()
    )
    return (
        f"{root} holds the results of a different run ({detail}); use a new output "
        "directory, or the same settings to resume"
    )


def run_problems(run: dict, where: str = RUN_FILE) -> list[str]:
    """What is wrong with a run.json object (the fields gather and resume rely on)."""
    problems = []
    world = run.get("world_size")
    if not is_int(world) or not 1 <= world <= MAX_WORLD_SIZE:
        problems.append(f"{where}: world_size={world!r} is not a rank count (1..{MAX_WORLD_SIZE})")
    if run.get("task") not in MODES:
        problems.append(f"{where}: task={run.get('task')!r} is not one of {', '.join(MODES)}")
    if run.get("layout") not in LAYOUTS:
        problems.append(f"{where}: layout={run.get('layout')!r} is not one of {', '.join(LAYOUTS)}")
    return problems


def read_checked(path: Path, problems_of) -> tuple[dict | None, list[str]]:
    """(the JSON object in path, []) when ``problems_of(object, where)`` finds nothing, else
    (None, its problems, or why the file cannot be read)."""
    data, problem = read_json_object(path)
    if data is None:
        return None, [problem]
    problems = problems_of(data, str(path))
    return (None if problems else data), problems


def read_run(root: Path) -> tuple[dict | None, list[str]]:
    """run.json under root (the ``longdoc/`` directory), checked."""
    return read_checked(OutputPaths(root).run_file, run_problems)


def doc_problems(doc: Any, where: str = DOCUMENTS_FILE) -> list[str]:
    """What is wrong with one entry of documents.json's ``documents`` list."""
    if not isinstance(doc, dict):
        return [f"{where}: a document entry is {type(doc).__name__}, not an object"]
    doc_id, key = doc.get("id"), doc.get("key")
    if not isinstance(doc_id, str) or not doc_id:
        return [f"{where}: a document has id={doc_id!r} (a non-empty string is needed)"]
    if not is_safe_name(key):
        return [
            f"{where}: document {doc_id!r}: key={key!r} is not a plain file name "
            "(letters, digits, '.', '_', '-'; no separators); refused"
        ]
    if key != doc_key(doc_id):
        return [
            f"{where}: document {doc_id!r}: key={key!r} is not the key of its id "
            f"(expected {doc_key(doc_id)!r}); refused"
        ]
    source = doc.get("source")
    if source is not None and not isinstance(source, str):
        return [f"{where}: document {doc_id!r}: source={source!r} is not a path"]
    return []


def _duplicates(docs: list[dict], field: str) -> list[str]:
    seen: set[str] = set()
    twice = []
    for doc in docs:
        value = doc[field]
        if value in seen and value not in twice:
            twice.append(value)
        seen.add(value)
    return twice


# documents.json's lists of what the listing did not read, and how `gather` names each
LEFT_OUT = {
    "missing_inputs": "input(s) were missing",
    "skipped_records": "bad record(s) were skipped (on_bad_record=skip)",
    "passed_over": "file(s) in the input folders were not read (no reader takes them)",
}


def documents_problems(index: dict, where: str) -> list[str]:
    """What is wrong with a documents.json object: its list, each entry, duplicates."""
    docs = index.get("documents")
    if not isinstance(docs, list):
        return [f"{where}: 'documents' is {type(docs).__name__}, not a list"]
    for key in LEFT_OUT:
        items = index.get(key, [])
        if not isinstance(items, list) or not all(isinstance(m, str) for m in items):
            return [f"{where}: {key!r} is not a list of strings"]
    problems = [p for doc in docs for p in doc_problems(doc, where)]
    if problems:
        return problems
    for field in ("id", "key"):
        for value in _duplicates(docs, field):
            problems.append(f"{where}: document {field} {value!r} is listed more than once")
    return problems


def documents_record(inputs: list[str], listing: Listing) -> dict:
    """documents.json's object: the inputs, the documents listed from them (``describe()``),
    the inputs missing, and the records skipped and files passed over (when any)."""
    index = {
        "format": FORMAT,
        "inputs": inputs,
        "documents": [d.describe() for d in listing.documents],
        "missing_inputs": list(listing.missing),
    }
    if listing.skipped:
        index["skipped_records"] = list(listing.skipped)
    if listing.passed_over:
        index["passed_over"] = list(listing.passed_over)  # files of a folder no reader takes
    return index


def skipped_notes(index: dict, shown: int = 3) -> list[str]:
    """What a checked documents.json says the job did not read besides its missing inputs
    (which gather warns of): the bad records skipped and the files passed over, counted,
    the first ``shown`` named (the job's log said each when it ran)."""
    notes = []
    for key in ("skipped_records", "passed_over"):
        items = index.get(key, [])
        if items:
            named = "; ".join(items[:shown]) + (
                f"; ... ({len(items) - shown} more)" if len(items) > shown else ""
            )
            notes.append(
                f"when the job ran, {len(items)} {LEFT_OUT[key]}: {named} (documents.json {key})"
            )
    return notes


def write_documents(root: Path, record: dict) -> None:
    """documents.json under root, rewritten by every attempt (``expected.json`` is not)."""
    atomic_write_json(OutputPaths(root).documents_file, record, indent=1)


def read_documents(root: Path) -> tuple[dict | None, list[str]]:
    """documents.json under root, checked: ``{"documents": [...], "missing_inputs": [...]}``."""
    return read_checked(OutputPaths(root).documents_file, documents_problems)
