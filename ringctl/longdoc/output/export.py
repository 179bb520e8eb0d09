"""`ringctl gather --format`: tables of the gathered values, and the loss-by-position picture.

``docs/<key>.safetensors`` is always written (the verified, reassembled tensors). ``--format
parquet`` or ``csv`` adds one table for the whole corpus:

* task score/grad: ``tokens.parquet|csv``, one row per token: ``doc_id`` (string), ``position``
  (int64, 0 .. N-1), ``token_id`` (int64, ``input_ids[position]``) and ``token_logprob``
  (float32): the log-probability of *this row's* token given the tokens before it, i.e.
  ``docs`` file's ``token_logprob[position - 1]``; empty (null) at position 0, which nothing
  predicts. Rows are in documents.json order, then by position.
* task embed: ``pooled.parquet|csv``, one row per document: ``doc_id``, ``tokens`` and the
  pooled vector (Parquet: ``pooled``, a fixed-size list of float32; CSV: ``pooled_0`` ..
  ``pooled_{H-1}``). Per-token hidden states are not tabled (N x hidden values per document:
  a table of them is no easier to use than the safetensors file); they stay in ``docs/``.

CSV is written a slice of rows at a time (a document of a million tokens never becomes one
string) and floats are written with Python's shortest round-trip repr, so reading a value back
as float32 gives exactly the stored one. A *text* cell (a document id, a status) that begins
with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return would be run as a formula by a
spreadsheet that opens the file (OWASP's "CSV injection"): such a cell, and one that begins with
``'``, is written with one ``'`` in front (``csv_text``). A spreadsheet shows the text as it
was; a program drops one leading ``'`` from a text cell that has one. Numbers are never changed
(``-3.25`` stays a number), and Parquet tables hold the ids unchanged. Lines end in CRLF (RFC
4180), so that a cell holding a carriage return is quoted and stays one cell.

Parquet needs pyarrow, imported only when asked for; without it the request is refused before
anything is verified or written. The picture needs matplotlib (Agg backend, imported only
here); without it the PNG is skipped with a note and the numbers are still in
loss-by-position.json.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ...errors import UserError
from .curve import LossCurve

FORMATS = ("safetensors", "parquet", "csv")
CURVE_JSON = "loss-by-position.json"
CURVE_PNG = "loss-by-position.png"
PARQUET_INSTALL = "pip install pyarrow (or pip install 'ringctl[parquet]')"
MATPLOTLIB_INSTALL = "pip install matplotlib (or pip install 'ringctl[bench]')"
_SLICE = 65536  # rows formatted at a time for CSV


# RFC 4180's line end (also Excel's and the csv module's default): with it the writer quotes a
# cell holding a carriage return, which with "\n" alone it writes bare, and every reader then
# splits the row there (and a spreadsheet runs a formula that follows it).
CSV_OPTIONS = {"lineterminator": "\r\n"}
# What makes a spreadsheet read a cell as a formula (OWASP), and the quote that marks text.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_TEXT_MARK = "'"


def csv_text(value: str) -> str:
    """A text cell for a CSV file: with a ``'`` in front when it begins like a formula (or with
    ``'`` itself, so that dropping one leading ``'`` always gives the value back)."""
    return _TEXT_MARK + value if value.startswith((*_FORMULA_START, _TEXT_MARK)) else value


def check_format(fmt: str) -> None:
    """Refuse, before any work, a format this Python cannot write."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise UserError(
                f"--format parquet needs pyarrow, which this Python lacks: {PARQUET_INSTALL} "
                "(or use --format csv); nothing was written"
            ) from None


def table_name(fmt: str, task: str) -> str | None:
    """The table file --format adds for this task (None for safetensors)."""
    if fmt == "safetensors":
        return None
    return f"{'pooled' if task == 'embed' else 'tokens'}.{fmt}"


def write_table(out_dir: Path, fmt: str, task: str, docs: Sequence[Any]) -> str | None:
    """Write the table for ``docs`` (gather.GatheredDoc: doc_id, tensors) into out_dir; its
    file name, or None when fmt adds none."""
    name = table_name(fmt, task)
    if name is None:
        return None
    path = out_dir / name
    writers = {
        ("csv", False): _tokens_csv,
        ("csv", True): _pooled_csv,
        ("parquet", False): _tokens_parquet,
        ("parquet", True): _pooled_parquet,
    }
    writers[(fmt, task == "embed")](path, docs)
    return name


# --- per-token rows (score, grad) -----------------------------------------------------------------


def _token_slices(doc: Any) -> Iterable[tuple[int, list[int], list[float | None]]]:
    """(first position, token ids, log-probabilities of those tokens) a slice at a time."""
    ids = doc.tensors["input_ids"]
    lp = doc.tensors["token_logprob"].float()
    for start in range(0, ids.numel(), _SLICE):
        stop = min(start + _SLICE, ids.numel())
        values: list[float | None] = lp[max(start - 1, 0) : stop - 1].tolist()
        if start == 0:
            values.insert(0, None)
        yield start, ids[start:stop].tolist(), values


def _tokens_csv(path: Path, docs: Sequence[Any]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, **CSV_OPTIONS)
        writer.writerow(["doc_id", "position", "token_id", "token_logprob"])
        for doc in docs:
            doc_id = csv_text(doc.doc_id)
            for start, ids, values in _token_slices(doc):
                writer.writerows(
                    (doc_id, start + j, t, "" if v is None else repr(v))
                    for j, (t, v) in enumerate(zip(ids, values, strict=True))
                )


def _tokens_parquet(path: Path, docs: Sequence[Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("doc_id", pa.string()),
            ("position", pa.int64()),
            ("token_id", pa.int64()),
            ("token_logprob", pa.float32()),
        ]
    )
    with pq.ParquetWriter(path, schema) as writer:
        for doc in docs:
            for start, ids, values in _token_slices(doc):
                n = len(ids)
                batch = {
                    "doc_id": pa.array([doc.doc_id] * n, pa.string()),
                    "position": pa.array(range(start, start + n), pa.int64()),
                    "token_id": pa.array(ids, pa.int64()),
                    "token_logprob": pa.array(values, pa.float32()),
                }
                writer.write_table(pa.table(batch, schema=schema))


# --- pooled vectors (embed) -----------------------------------------------------------------------


def _pooled(doc: Any) -> list[float]:
    return doc.tensors["pooled"].float().tolist()


def _pooled_csv(path: Path, docs: Sequence[Any]) -> None:
    width = docs[0].tensors["pooled"].numel() if docs else 0
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, **CSV_OPTIONS)
        writer.writerow(["doc_id", "tokens", *(f"pooled_{j}" for j in range(width))])
        for doc in docs:
            row = [repr(v) for v in _pooled(doc)]
            writer.writerow([csv_text(doc.doc_id), doc.tensors["input_ids"].numel(), *row])


def _pooled_parquet(path: Path, docs: Sequence[Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    width = docs[0].tensors["pooled"].numel() if docs else 0
    table = pa.table(
        {
            "doc_id": pa.array([d.doc_id for d in docs], pa.string()),
            "tokens": pa.array([d.tensors["input_ids"].numel() for d in docs], pa.int64()),
            "pooled": pa.array([_pooled(d) for d in docs], pa.list_(pa.float32(), width)),
        }
    )
    pq.write_table(table, path)


# --- the loss curve -------------------------------------------------------------------------------


def write_curve(
    out_dir: Path, docs: Sequence[Any], *, partial: bool, trained_context: int | None = None
) -> tuple[list[str], str]:
    """loss-by-position.json, and the PNG where matplotlib is installed: (files written, a note
    when the PNG was skipped). ``trained_context``: the model's, drawn as a line."""
    curve = LossCurve()
    for doc in docs:
        curve.add(doc.tensors["token_logprob"])
    record = curve.record(partial=partial, trained_context=trained_context)
    (out_dir / CURVE_JSON).write_text(json.dumps(record, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        note = f"{CURVE_PNG} not drawn: matplotlib is missing ({MATPLOTLIB_INSTALL})"
        return [CURVE_JSON], note
    if not curve.tokens:
        return [CURVE_JSON], f"{CURVE_PNG} not drawn: no scored tokens"
    _draw(out_dir / CURVE_PNG, record)
    return [CURVE_JSON, CURVE_PNG], ""


def _trained_context_line(axes: tuple, limit: int | None) -> None:
    """A dashed vertical line at the model's trained context on both panels, labelled on the
    top one: points right of it are positions the model was never trained on."""
    if limit is None:
        return
    for ax in axes:
        ax.axvline(limit, color="tab:red", linestyle="--", linewidth=1)
    axes[0].text(
        limit,
        0.98,
        f"trained context: {limit} tokens ",
        transform=axes[0].get_xaxis_transform(),  # x in data, y in axes units
        color="tab:red",
        fontsize=8,
        va="top",
        ha="right",
    )


def _draw(path: Path, record: dict) -> None:
    import matplotlib.pyplot as plt

    rows = [b for b in record["buckets"] if b["mean_nll"] is not None]
    mid = [(b["first"] * (b["last"] + 1)) ** 0.5 for b in rows]  # geometric middle
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.plot(mid, [b["mean_nll"] for b in rows], marker="o")
    top.set_ylabel("mean loss (nats/token)")
    what = "partial: complete documents only, " if record["partial"] else ""
    top.set_title(
        f"Mean loss by token position ({what}{record['documents']} documents, "
        f"{record['tokens']} tokens)",
        fontsize=10,
    )
    top.grid(True, alpha=0.3)
    _trained_context_line((top, bottom), record.get("trained_context"))
    bottom.bar(  # each bar spans its bucket's positions exactly
        [b["first"] for b in rows],
        [b["tokens"] for b in rows],
        width=[b["last"] - b["first"] + 1 for b in rows],
        align="edge",
        alpha=0.6,
    )
    bottom.set_xscale("log", base=2)
    bottom.set_yscale("log")
    bottom.set_ylabel("tokens")
    bottom.set_xlabel("token position (log-spaced buckets: 1, 2-3, 4-7, ...)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
