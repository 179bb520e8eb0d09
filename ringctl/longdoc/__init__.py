"""Long documents in batch: score / embed / grad with a causal LM whose attention is ringattn.

    params.py     ``LongDocParams``: the job's ``task:`` section and run_longdoc's input
    documents.py  which documents (text, JSONL, .jsonl.gz, JSON arrays, tables), ids, bad records
    records.py    each file's records, one at a time in bounded memory, read back by span
    inflate.py    a .gz file's inflated bytes by offset (checkpoints), bombs read in pieces
    saved.py      Hugging Face save_to_disk folders: state.json's files, a DatasetDict's split
    tokenize.py   the model directory's tokenizer, a local HF tokenizer, or bytes
    model.py      a local HF causal LM or the bundled tiny random Llama
    compat.py     which models the ring runs exactly; the others refused by name
    head.py       the model's own output head (logit scaling, soft-capping), in chunks
    scoring.py    the three modes on one sharded document (attention calls counted)
    probe.py      before scoring: the model on the ring vs its own forward pass
    consensus.py  decisions every rank takes alike
    shards.py     each rank's outputs + manifest entries, written atomically
    run.py        the loop over documents: ``run_longdoc`` (a ``LongDocRun``)
    manifest.py   run.json / documents.json checked as hostile input
    expected.py   the document list fixed at start (expected.json), checked by gather
    completeness.py  when a document is complete: one definition for gather and resume
    gather.py     verify + reassemble (`ringctl gather`)

Importing this package imports neither torch nor transformers; the modules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import LongDocParams, LongDocSummary, run_longdoc

__all__ = ["LongDocParams", "LongDocSummary", "run_longdoc"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
