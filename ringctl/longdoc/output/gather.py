"""The long-document task's gather step: verify every shard, reassemble each document in order.

``gather(job_dir, out)`` reads ``longdoc/`` (see ``names.py``) under ``job_dir`` or
``job_dir/out``. Nothing there is trusted: ``manifest.py`` checks run.json and documents.json
(plain file-name keys, no duplicate ids), ``expected.py`` checks the document list against the
one fixed when the run started (when there is one), and ``completeness.py`` decides, the same way
as resume, whether each document is complete: every rank's shard present, inside the job
directory (symlinks resolved), matching its checksum, its entry and its layout, and together
covering ``0 .. N-1`` exactly once; and, given the job's config, computed from its input as
it is now (``InputsNow``: the inputs the config names are read again, and a document whose
input was edited since its outputs were written is not complete; never a path from the
outputs, and not for an ssh job, whose inputs live on the login node).

Then it undoes the layout (each tensor row goes to its global position), and writes, to a
temporary directory renamed to ``out`` only when everything verified:

* ``docs/<doc key>.safetensors``: ``input_ids`` (N,); task score/grad: ``token_logprob``
  (N-1,), ``token_logprob[i] = log p(input_ids[i+1] | input_ids[..i])``; task embed: ``hidden``
  (N, hidden) and ``pooled`` (hidden,); metadata: doc_id, source, task;
* ``grads/<doc key>.safetensors`` (task grad with write_grads), checksum verified;
* ``summary.json`` and ``summary.csv``: one row per document (tokens, log-likelihood,
  perplexity, bits per byte with every tokenizer, ``past_trained_context`` (whether the
  document is longer than the model's trained context; null where none is known), seconds,
  ...; ``JobModel``), plus the inputs that were missing when the job ran (CSV text cells
  that begin like a spreadsheet formula get a leading ``'``: ``export.csv_text``);
  summary.json also has the model's ``trained_context``;
* ``tokens.parquet|csv`` (``pooled.*`` for embed) with ``--format parquet|csv``, and, for
  score/grad, ``loss-by-position.json`` / ``.png`` (see ``export.py`` and ``curve.py``);
* ``.ringctl-gather``: the marker that makes it a gather output. ``--force`` replaces only a
  directory with this marker (or an empty one), never anything else.

``partial=True`` (``--partial``) writes the documents that are complete now, by the same
definition, and lists the others (``incomplete`` in summary.json, a ``status`` column in
summary.csv); such an output says ``partial: true`` in summary.json, in the marker and in the
curve's JSON, and a later gather replaces it without ``--force`` (it is ours, and never
complete). What is wrong rather than unfinished (a document list that disagrees with
expected.json, a complete document of the wrong length or with an output that is not finite: NaN
scores, hidden states, pooled vectors, gradient norms or gradients) is refused with or
without ``partial``.

The temporary directory is made, filled and swapped in while the lock of ``out``'s folder is
held (a second gather there waits), so what a killed gather left beside ``out``
(``.OUT.tmp-*``, and ``.OUT.replaced-*`` holding the earlier output) is its own: the next
gather removes it, or puts the earlier output back where ``out`` is missing
(``recover_killed``).

The folder and files get the permissions the user's umask gives (not a temp dir's 0700).
Anything missing or corrupt is named (file and reason) in a ``GatherError``: exit status 3,
and nothing is written under ``out`` (an existing ``out`` is left as it was). Missing *inputs*
(documents the job could not read, ``on_missing=report``) are not an error here: they are
listed in the summary and as a warning.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import UserError, with_filename
from ...jobdir import JobDir, task_output
from ...jsonsafe import finite_json
from ...output_dir import (
    beside,
    check_target,
    confined,
    is_partial_output,
    new_output_dir,
    put_in_place,
    recover_killed,
    write_marker,
)
from ...terminal import visible
from ..inputs.documents import Document
from . import export
from .completeness import CurrentInput, RankShard, document_shards
from .expected import absent_note, expected_problems, some_names
from .manifest import is_int, read_documents, read_run, skipped_notes
from .names import RUN_FILE, SUBDIR, OutputPaths

GATHER_FAILED_EXIT = 3


class GatherError(UserError):
    """Shards missing or corrupt, manifests malformed: exit status 3 (2 stays for usage
    errors). One problem is one line; several are listed below a head line."""

    exit_code = GATHER_FAILED_EXIT

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"{problems[0]}; nothing was written")
            return
        head = f"{len(problems)} problem(s) in the job's output; nothing was written:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in problems)]))


@dataclass
class GatheredDoc:
    doc_id: str
    key: str
    source: str | None
    tensors: dict[str, Any]
    row: dict[str, Any]
    grads_file: Path | None = None


@dataclass
class GatherResult:
    out: Path
    task: str
    rows: list[dict[str, Any]]
    missing_inputs: list[str] = field(default_factory=list)
    partial: bool = False  # some listed documents are not complete (only with --partial)
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # written beside docs/
    notes: list[str] = field(default_factory=list)  # e.g. the PNG skipped, and why
    asked_partial: bool = False


# --- where ----------------------------------------------------------------------------------------


def resolve_job_dir(spec: str | Path) -> Path:
    """The job directory (or its out/ directory) as an absolute path; it must exist."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UserError(f"{spec}: no such job directory")
    return path.absolute()


def find_longdoc_root(job_dir: Path) -> Path:
    """job_dir/longdoc or job_dir/out/longdoc (the one holding run.json), inside job_dir."""
    root = task_output(job_dir, SUBDIR, RUN_FILE)
    if root is None:
        raise UserError(
            f"{job_dir}: no long-document output here (looked for longdoc/run.json and "
            "out/longdoc/run.json)"
        )
    if not confined(root, job_dir):
        raise GatherError([f"{root} leads outside {job_dir} (a symlink); refused"])
    return root


def recognises(path: str | Path) -> bool:
    """Whether path holds long-document output (for a directory that is not a job directory)."""
    return task_output(Path(path), SUBDIR, RUN_FILE) is not None


# --- verify and reassemble ------------------------------------------------------------------------


def _assemble(shards: list[RankShard], n: int, name: str):
    import torch

    first = shards[0].tensors[name]
    full = torch.empty((n, *first.shape[1:]), dtype=first.dtype)
    for s in shards:  # rows per position and dtype checked per shard (completeness.PER_TOKEN)
        part = s.tensors[name]
        if part.dtype != first.dtype or part.shape[1:] != first.shape[1:]:
            raise ShardsDisagree(
                f"{name}: ranks wrote {first.dtype} {list(first.shape[1:])} "
                f"and {part.dtype} {list(part.shape[1:])} rows"
            )
        full[s.tensors["positions"]] = part
    return full


class ShardsDisagree(ValueError):
    """The ranks' shards of one document hold rows of different dtypes or widths."""


def _first_not_finite(t) -> int | None:
    """The first row of t (a token, for per-token tensors) holding a value that is not finite."""
    import torch

    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(-1)
    return int(bad.nonzero()[0, 0]) if bad.any() else None


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scores(shards: list[RankShard], n: int) -> tuple[dict, dict, str]:
    """score/grad: token_logprob (N-1,), the log-likelihood and perplexity. A log-probability
    of -inf is a token the model rules out (summary.json writes null); NaN or +inf is no
    probability at all."""
    lp = _assemble(shards, n, "token_logprob")[: max(n - 1, 0)].contiguous()
    bad = (lp.isnan() | (lp == math.inf)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        return {}, {}, f"log-probability {lp[i].item()} at scored position {i} (no probability)"
    ll = float(lp.double().sum())
    row = {"log_likelihood": ll, "perplexity": math.exp(-ll / lp.numel()) if lp.numel() else None}
    return {"token_logprob": lp}, row, ""


def _embeddings(shards: list[RankShard], n: int) -> tuple[dict, dict, str]:
    """embed: hidden (N, hidden) and pooled (hidden,), both finite (pooled is NaN, by
    definition, only for an empty document: the mean of nothing)."""
    hidden = _assemble(shards, n, "hidden")
    token = _first_not_finite(hidden) if n else None
    if token is not None:
        return {}, {}, f"non-finite hidden states at token {token} (NaN or inf)"
    if "pooled" not in shards[0].tensors:
        return {}, {}, "rank 0's shard has no pooled vector"
    pooled = shards[0].tensors["pooled"]
    if n and _first_not_finite(pooled.reshape(1, -1)) is not None:
        return {}, {}, "a non-finite pooled vector (NaN or inf)"
    return {"hidden": hidden, "pooled": pooled}, {}, ""


def _grad_row(shards: list[RankShard]) -> tuple[dict, str]:
    """grad: the loss and gradient norms of rank 0's entry; a norm that is not a finite number
    (an entry writes NaN and inf as null) is refused: its gradients are no gradients. The loss
    may be null: no token scored, or one of log-probability -inf."""
    stats = shards[0].entry.get("stats")
    stats = stats if isinstance(stats, dict) else {}
    norms = stats.get("grad_norms")
    named = {"grad_norm": stats.get("grad_norm")}
    if isinstance(norms, dict):
        named.update({f"grad_norms[{k!r}]": v for k, v in norms.items()})
    for key, value in named.items():
        if not _finite_number(value):
            return {}, f"{key}={value!r} in rank 0's entry is not a finite number"
    return {"loss": stats.get("loss"), "grad_norm": stats.get("grad_norm")}, ""


def _task_outputs(shards: list[RankShard], n: int, task: str) -> tuple[dict, dict, str]:
    """(tensors, summary fields, problem) of a verified document for its task: every value
    handed out is finite, or the document is refused saying why."""
    try:
        out: dict[str, Any] = {"input_ids": _assemble(shards, n, "input_ids")}
    except ShardsDisagree as err:
        return {}, {}, str(err)
    row: dict[str, Any] = {}
    parts = [_scores] if task in ("score", "grad") else [_embeddings] if task == "embed" else []
    for part in parts:
        try:
            tensors, fields, problem = part(shards, n)
        except ShardsDisagree as err:
            tensors, fields, problem = {}, {}, str(err)
        if problem:
            return {}, {}, problem
        out.update(tensors)
        row.update(fields)
    if task == "grad":
        fields, problem = _grad_row(shards)
        if problem:
            return {}, {}, problem
        row.update(fields)
    return out, row, ""


def grads_problem(path: Path) -> str:
    """Which tensor of a (checksum-verified) gradient file is not finite ("" when all are);
    read one tensor at a time (a gradient file is the size of the model)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                if _first_not_finite(f.get_tensor(name).reshape(1, -1)) is not None:
                    return f"gradient file {path.name}: {name} holds values that are NaN or inf"
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        return f"gradient file {path}: not a readable safetensors file ({err})"
    return ""


class InputsNow:
    """The job's inputs as its config lists them now, to tell whether a document's input was
    edited since its outputs were written (``completeness.input_problem``).

    Only what the job's own config.yaml names is read (the same files the job read), never a
    path from the outputs: a hostile ``documents.json`` cannot make gather read a file. Without
    a config (a bare output directory), for a job whose inputs live on a login node (ssh), or
    when the inputs cannot be listed, nothing is checked and ``notes`` says so; so it does for
    documents whose input is gone or unreadable now."""

    def __init__(self, documents: dict[str, Document] | None, why_not: str = "") -> None:
        self.documents, self.why_not = documents, why_not
        self.unchecked: list[str] = []

    @classmethod
    def of_job(cls, params, problem: str, remote: bool) -> InputsNow:
        """``params``: the job's parameters from its config (None with ``problem``: why they
        could not be read; None without: no config)."""
        if params is None and not problem:
            return cls(None, "the inputs were not checked (no job config: a bare output folder)")
        if remote:
            return cls(None, "the inputs live on the login node: not checked against the outputs")
        if problem:
            return cls(None, f"the inputs were not checked: {problem}")
        try:
            listing = params.list_inputs(
                params.input_paths(), on_missing="report", on_bad_record="skip"
            )
        except ValueError as err:
            return cls(None, f"the inputs were not checked: {err}")
        return cls({d.id: d for d in listing.documents})

    def of(self, doc_id: str) -> CurrentInput | None:
        """The identity of the document's input now, asked for once its shards verified."""
        if self.documents is None:
            return None

        def now() -> dict | None:
            doc = self.documents.get(doc_id)
            identity = doc.identity() if doc is not None else None
            if identity is None:
                self.unchecked.append(doc_id)
            return identity

        return now

    def notes(self) -> list[str]:
        if self.why_not:
            return [self.why_not]
        if not self.unchecked:
            return []
        return [
            f"{len(self.unchecked)} document(s) whose input is gone or unreadable now were not "
            f"checked against it: {some_names(self.unchecked)}"
        ]


class JobModel:
    """The job's model and tokenizer as its own config names them (never a path from the
    outputs), for two facts the summary states:

    * each document's scored bytes, for bits per byte with every tokenizer
      (``tokenize.py``'s one rule): N - 1 for the byte tokenizer (no input read); for a
      model's tokenizer, counted on the document's input as it is now with the job's
      tokenizer, used only when that gives exactly the ids that were scored;
    * the model's trained context (``compat.trained_context``): documents longer are marked in
      summary.json (``past_trained_context``) and the curve draws it.

    Without a config (a bare output folder) or for an ssh job (its model lives on the login
    node) neither is known, except that run.json's null ``tokenizer_path`` means bytes."""

    def __init__(self, params: Any = None, why_not: str = "") -> None:
        self.params, self.why_not = params, why_not
        self.trained_context: int | None = None
        self.tokenizer: Any = None
        self.unscored: list[str] = []
        if params is not None:
            self.trained_context, self.why_not = self._read_context()

    @classmethod
    def of_job(cls, params, problem: str, remote: bool) -> JobModel:
        """``params`` and ``problem``: as ``InputsNow.of_job``'s."""
        if remote or (params is None and not problem):
            return cls(None)
        if problem:
            return cls(None, f"the job's model is unknown here ({problem})")
        return cls(params)

    def _read_context(self) -> tuple[int | None, str]:
        from ..model.compat import read_model_config, trained_context

        try:
            config = read_model_config(self.params.model_path, self.params.model_overrides)
        except (ValueError, OSError) as err:
            return None, f"the job's model config could not be read ({err})"
        return trained_context(config), ""

    @staticmethod
    def byte_level(run: dict) -> bool:
        """Whether the scored tokens are bytes (run.json's tokenizer_path is null: the ranks'
        own resolution), when a document's scored bytes are N - 1 and no file is read."""
        return "tokenizer_path" in run and run["tokenizer_path"] is None

    def scored_bytes(
        self, doc_id: str, ids, run: dict, document: Document | None, recorded=None
    ) -> int | None:
        """The document's scored bytes (see the class docstring), or None: not known here.
        ``recorded``: what the ring's lead counted as it read the document (its entry's
        stats), taken where the input or tokenizer is not here (an ssh job's inputs are the
        login node's: its bits per byte read null); a count made here wins."""
        n = int(ids.numel())
        if self.byte_level(run):
            return n - 1 if n >= 2 else None
        counted = self._count(document, ids) if n >= 2 else None
        if counted is None and n >= 2 and is_int(recorded) and 0 < recorded:
            return int(recorded)
        if counted is None and n >= 2:
            self.unscored.append(doc_id)
        return counted

    def _count(self, document: Document | None, ids) -> int | None:
        import torch

        tokenizer = self._tokenizer()
        if tokenizer is None or document is None:
            return None
        try:
            again, scored = tokenizer.scored(document.read_bytes())
        except (OSError, ValueError):
            return None
        return scored if torch.equal(again, ids) else None

    def _tokenizer(self):
        """The job's tokenizer, loaded once (None: no config, or it cannot be loaded)."""
        if self.tokenizer is None and self.params is not None and not self.why_not:
            from ..model.tokenize import load_tokenizer

            try:
                self.tokenizer = load_tokenizer(self.params.tokenizer_dir())
            except (ValueError, OSError) as err:
                self.why_not = f"the job's tokenizer could not be loaded ({err})"
        return self.tokenizer

    def mark(self, n_tokens: int) -> dict[str, Any]:
        """A summary row's mark: whether the document is longer than the trained context
        (None: no limit known). Every row has it, so summary.csv's columns do not change
        from one run to the next (the key was there only when true)."""
        limit = self.trained_context
        return {"past_trained_context": n_tokens > limit if limit else None}

    def notes(self) -> list[str]:
        if not self.unscored:
            return []
        why = self.why_not or "their inputs are gone, unreadable or not local, or the "
        why += "" if self.why_not else "job's tokenizer no longer gives the ids scored"
        return [
            f"bits per byte not reported for {len(self.unscored)} document(s) "
            f"({some_names(self.unscored)}): {why}"
        ]


def _gathered(
    root: Path,
    doc: dict,
    run: dict,
    context: tuple[dict[str, int], InputsNow, JobModel],
    problems: list,
):
    """(the document reassembled, []), or (None, why it is not complete). Problems of a
    complete document (its length, NaN) are added to problems: those are never partial.
    context: expected.json's token counts, the inputs as they are now, the job's model."""
    tokens, inputs, model = context
    where = f"document {doc['id']!r}"
    shards, n, found = document_shards(root, doc, run, inputs.of(doc["id"]))
    if found:
        return None, found
    if doc["id"] in tokens and tokens[doc["id"]] != n:
        problems.append(f"{where}: {n} tokens, expected.json says {tokens[doc['id']]}")
        return None, []
    tensors, fields, problem = _task_outputs(shards, n, run["task"])
    if problem:
        problems.append(f"{where}: {problem}")
        return None, []
    if "log_likelihood" in fields:
        document = (inputs.documents or {}).get(doc["id"])
        stats = shards[0].entry.get("stats")
        recorded = stats.get("scored_bytes") if isinstance(stats, dict) else None
        scored = model.scored_bytes(doc["id"], tensors["input_ids"], run, document, recorded)
        fields["bits_per_byte"] = bits_per_byte(fields["log_likelihood"], scored)
    seconds = max(_seconds(s.entry.get("seconds")) for s in shards)
    row = {"document": doc["id"], "tokens": n, **model.mark(n), **fields}
    row["seconds"] = round(seconds, 4)
    grads = shards[0].entry.get("grads_file") if run["task"] == "grad" else None
    grads_file = OutputPaths(root).grads_path(doc["key"]) if grads else None  # checked
    problem = grads_problem(grads_file) if grads_file is not None else ""
    if problem:
        problems.append(f"{where}: {problem}")
        return None, []
    got = GatheredDoc(doc["id"], doc["key"], doc.get("source"), tensors, row, grads_file)
    return got, []


def bits_per_byte(log_likelihood: float, scored_bytes: int | None) -> float | None:
    """The document's negative log-likelihood in bits over the bytes its scored tokens cover
    (``tokenize.py``: its UTF-8 length less its first token's bytes; N - 1 for the byte
    tokenizer, where this is the mean loss in bits); None when nothing was scored or the
    scored bytes are not known here (``JobModel``)."""
    if not scored_bytes or scored_bytes < 1:
        return None
    return -log_likelihood / scored_bytes / math.log(2)


def _seconds(value: Any) -> float:
    try:
        seconds = float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return seconds if math.isfinite(seconds) else 0.0


@dataclass
class Verified:
    """What verification found: the complete documents and, for --partial, the others."""

    run: dict
    docs: list[GatheredDoc]
    missing_inputs: list[str]
    incomplete: list[dict]  # {"document": id, "reason": its first problem, "problems": count}
    notes: list[str] = field(default_factory=list)  # e.g. inputs that could not be checked
    trained_context: int | None = None  # the model's (JobModel); None: unknown or no limit


def verify_job(
    job_dir: str | Path,
    *,
    partial: bool = False,
    inputs: InputsNow | None = None,
    model: JobModel | None = None,
) -> Verified:
    """Verify every listed document. Manifest problems, and problems of a complete document,
    always raise GatherError; an incomplete document raises it too unless partial, which lists
    it instead (the same completeness definition decides both). ``inputs``: the job's inputs
    now (default: none to check against); ``model``: the job's model (default: unknown)."""
    root = find_longdoc_root(resolve_job_dir(job_dir))
    inputs = inputs or InputsNow(None)
    model = model or JobModel(None)
    run, problems = read_run(root)
    index, index_problems = read_documents(root)
    if run is None or index is None:
        raise GatherError(problems + index_problems)
    # A list that disagrees with expected.json is a problem even for --partial: nothing about
    # such a list can be vouched for, not even partly. So is what completeness.py refuses (a
    # path leading outside, a foreign gradient file): no running job writes that.
    tokens, problems = expected_problems(root, index["documents"])
    docs, incomplete = [], []
    for doc in index["documents"]:
        got, found = _gathered(root, doc, run, (tokens, inputs, model), problems)
        if got is not None:
            docs.append(got)
        elif found and partial and not any(p.endswith("refused") for p in found):
            reason = found[0].removeprefix(f"document {doc['id']!r}: ")
            incomplete.append({"document": doc["id"], "reason": reason, "problems": len(found)})
        else:
            problems.extend(found)
    if problems:
        raise GatherError(problems)
    missing = list(index.get("missing_inputs", []))
    notes = absent_note(root) + skipped_notes(index) + inputs.notes() + model.notes()
    return Verified(run, docs, missing, incomplete, notes, model.trained_context)


def verify(job_dir: str | Path) -> tuple[dict, list[GatheredDoc], list[str]]:
    """(run.json, the verified documents, missing inputs); raises GatherError on problems."""
    got = verify_job(job_dir)
    return got.run, got.docs, got.missing_inputs


# --- write ----------------------------------------------------------------------------------------


def _csv(rows: list[dict[str, Any]]) -> str:
    """summary.csv's text; text cells that a spreadsheet would run as formulas get a leading
    ' (export.csv_text), numbers are written as they are."""
    buf = io.StringIO()
    cols = list(dict.fromkeys(k for row in rows for k in row)) or ["document", "tokens", "seconds"]
    writer = csv.DictWriter(buf, fieldnames=cols, restval="", **export.CSV_OPTIONS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return buf.getvalue()


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return export.csv_text(value) if isinstance(value, str) else value


def _write_docs(tmp: Path, task: str, docs: list[GatheredDoc]) -> list[dict[str, Any]]:
    """docs/ (and grads/): one safetensors file per document; the summary rows."""
    from safetensors.torch import save

    (tmp / "docs").mkdir()
    rows = []
    for d in docs:
        path = tmp / "docs" / f"{d.key}.safetensors"
        assert confined(path, tmp), path  # keys are checked plain names (manifest.py)
        meta = {"doc_id": d.doc_id, "source": str(d.source), "task": task}
        path.write_bytes(save(d.tensors, metadata=meta))
        if d.grads_file is not None:
            (tmp / "grads").mkdir(exist_ok=True)
            shutil.copyfile(d.grads_file, tmp / "grads" / f"{d.key}.safetensors")
        rows.append({**d.row, "file": f"docs/{d.key}.safetensors"})
    return rows


def _csv_rows(rows: list[dict], incomplete: list[dict]) -> list[dict]:
    """summary.csv's rows: a partial output gets a status column and a row per incomplete
    document, so that even this file alone cannot be taken for the whole result."""
    if not incomplete:
        return rows
    done = [{**row, "status": "complete"} for row in rows]
    return done + [
        {"document": i["document"], "status": f"incomplete: {i['reason']}"} for i in incomplete
    ]


def _write_outputs(tmp: Path, got: Verified, job: Path, fmt: str, job_state: str | None):
    """Everything under tmp: docs/, the table (--format), the curve, summary, marker."""
    task, partial = got.run["task"], bool(got.incomplete)
    rows = _write_docs(tmp, task, got.docs)
    files, notes = ["summary.json", "summary.csv"], []
    table = export.write_table(tmp, fmt, task, got.docs)
    if table is not None:
        files.append(table)
    if task == "embed" and fmt != "safetensors":
        notes.append(f"{table}: pooled vectors; per-token hidden states stay in docs/")
    if task in ("score", "grad"):
        context = got.trained_context
        written, note = export.write_curve(tmp, got.docs, partial=partial, trained_context=context)
        files += written
        notes += [note] if note else []
    summary = {
        "task": task,
        "layout": got.run["layout"],
        "world_size": got.run["world_size"],
        "partial": partial,
        "documents": rows,
        "incomplete": got.incomplete,
        "missing_inputs": got.missing_inputs,
        "files": files,
    }
    if got.trained_context is not None:  # rows past it say past_trained_context: true
        summary["trained_context"] = got.trained_context
    if job_state is not None:
        summary["job_state"] = job_state  # the backend's word when this gather ran
    summary, replaced = finite_json(summary)  # strict JSON: a -inf log-probability's sums
    if replaced:
        summary["notes"] = [f"{key}: not a finite number; written as null" for key in replaced]
        notes.append(f"summary.json: {len(replaced)} non-finite value(s) written as null")
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (tmp / "summary.csv").write_text(_csv(_csv_rows(rows, got.incomplete)), newline="")
    write_marker(tmp, job, task, partial)
    return rows, files, notes


def _write_in_place(target: Path, got: Verified, about: tuple, force: bool):
    """Write the outputs into a temporary directory beside target and swap it in (rows, files,
    notes); nothing is left behind if that fails. about: (job, fmt, job_state)."""
    job, fmt, job_state = about
    tmp = new_output_dir(target)
    try:
        written = _write_outputs(tmp, got, job, fmt, job_state)
        check_target(target, job, force=force)  # again: it may have changed while verifying
        put_in_place(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):  # disk full under out: name it (a write() names nothing)
            raise with_filename(err, target) from None
        raise
    return written


def target_of(job_dir: str | Path, out: str | Path | None) -> Path:
    """Where gather writes: ``out``, or JOB_DIR/gathered."""
    if out is not None:
        return Path(out).expanduser().absolute()
    return JobDir(resolve_job_dir(job_dir)).gathered


def replaces_partial(job_dir: str | Path, out: str | Path | None) -> bool:
    """Whether this gather would replace an earlier partial output (the verb then holds the
    job's lock, as for --force)."""
    return is_partial_output(target_of(job_dir, out))


def gather(
    job_dir: str | Path,
    out: str | Path | None = None,
    *,
    force: bool = False,
    partial: bool = False,
    fmt: str = "safetensors",
    job_state: str | None = None,
    job_params=None,
    job_params_problem: str = "",
    remote: bool = False,
):
    """Verify and reassemble; write ``out`` (default JOB_DIR/gathered) only if all is well.
    partial: write the complete documents even if others are not (the result says so);
    fmt: the table to add (export.FORMATS); job_state: recorded in summary.json; job_params:
    the job's ``LongDocParams`` as its resolved config gives them (the task's gatherer reads
    them; ``job_params_problem``: why it could not), whose inputs are checked against the
    outputs (``InputsNow``) unless they are ``remote``, and whose model the summary reads."""
    export.check_format(fmt)
    job = resolve_job_dir(job_dir)
    target = target_of(job, out)
    recovered = recover_killed(target)
    check_target(target, job, force=force)
    inputs = InputsNow.of_job(job_params, job_params_problem, remote)
    model = JobModel.of_job(job_params, job_params_problem, remote)
    got = verify_job(job, partial=partial, inputs=inputs, model=model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with beside(target):
        rows, files, notes = _write_in_place(target, got, (job, fmt, job_state), force)
    notes = recovered + got.notes + notes
    return GatherResult(
        target,
        got.run["task"],
        rows,
        got.missing_inputs,
        partial=bool(got.incomplete),
        incomplete=got.incomplete,
        files=files,
        notes=notes,
        asked_partial=partial,
    )


# --- show -----------------------------------------------------------------------------------------


def summary_table(result: GatherResult):
    """A rich Table of the gathered documents (ids and paths shown literally, never markup;
    a control character in an id, such as a newline from a file name, as an escape). The
    log-likelihood stays in summary.json/csv: with bits per byte beside perplexity, an
    80-column terminal would otherwise cut the document names."""
    from rich.table import Table
    from rich.text import Text

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    what = f"{len(result.rows)} documents ({result.task})"
    if result.partial:
        what = f"{len(result.rows)} of {len(result.rows) + len(result.incomplete)} documents "
        what += f"({result.task}, partial)"
    table = Table(title=Text(visible(f"{what} -> {result.out}")))
    table.add_column("document")
    table.add_column("tokens", justify="right")
    scored = result.task in ("score", "grad")
    if scored:
        table.add_column("perplexity", justify="right")
        table.add_column("bits/byte", justify="right")
    if result.task == "grad":
        table.add_column("loss", justify="right")
        table.add_column("grad norm", justify="right")
    table.add_column("time (s)", justify="right")
    for row in result.rows:
        cells = [str(row["tokens"])]
        if scored:
            cells += [num(row.get("perplexity"), ".3f"), num(row.get("bits_per_byte"), ".3f")]
        if result.task == "grad":
            cells += [num(row.get("loss"), ".4f"), num(row.get("grad_norm"), ".4g")]
        cells.append(num(row.get("seconds"), ".2f"))
        table.add_row(Text(visible(str(row["document"]))), *(Text(c) for c in cells))
    return table


def _incomplete_lines(result: GatherResult) -> list[str]:
    """What --partial says about the documents it left out (ids shown literally)."""
    if not result.asked_partial:
        return []
    total = len(result.rows) + len(result.incomplete)
    if not result.partial:
        return [f"all {total} documents are complete: this is a full gather, not a partial one"]
    lines = [
        f"partial: {len(result.rows)} of {total} documents complete; "
        f"{len(result.incomplete)} not (yet), left out:"
    ]
    lines += [visible(f"  {i['document']}: {i['reason']}") for i in result.incomplete]
    return lines


def show(result: GatherResult, console) -> None:
    """What `ringctl gather` prints: the table, missing inputs, the documents --partial left
    out, notes, where the files are."""
    from rich.text import Text

    console.print(summary_table(result))
    if result.missing_inputs:
        warning = Text("warning: ", style="yellow")
        warning.append(
            f"{len(result.missing_inputs)} input(s) were missing when the job ran and are not "
            f"in the results: {visible(', '.join(result.missing_inputs))}"
        )
        console.print(warning)
    for line in _incomplete_lines(result):
        console.print(Text(line, style="yellow" if result.partial else ""))
    for note in result.notes:
        console.print(Text(f"note: {note}"))
    files = ", ".join([*(result.files or ["summary.json", "summary.csv"]), "docs/"])
    console.print(Text(visible(f"wrote {result.out} ({files})")))
