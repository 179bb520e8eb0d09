"""Long documents in batch: score / embed / grad with a causal LM whose attention is ringattn.

The job at the top, four wings below it (an arrow points down or across a wing, never up:
tests/test_import_graph.py holds it):

    params.py       ``CorpusParams`` (what the training job shares) and ``LongDocParams``
    run.py          the loop over documents: ``run_longdoc`` (a ``LongDocRun``, driven by
                    ``LongDocOptions``)
    schedule.py     lengths before tokenising (the one estimator), rings, schedule.json
    agreement.py    every rank loads the same tokenizer and model and passes the probe
    probe.py        before scoring: the model on the ring vs its own forward pass
    consensus.py    decisions every rank takes alike
    inputs/         which documents, their ids and bytes: documents, records (JSON flavours),
                    tables + table_meta (Parquet, Arrow), inflate (gzip), saved (save_to_disk)
    model/          load (a local HF causal LM, the bundled models; gguf_file: a GGUF file),
                    compat (which run exactly), overrides, custom_code (never run), tokenize
    compute/        scoring (the three ``MODES`` on one sharded document, the model's own
                    output head in chunks), packing (short documents in one sequence), fsdp
                    (weights held as FSDP2 shards)
    output/         names (every file name of the output), store (what each rank writes),
                    manifest (run.json, documents.json: written, and read as hostile input),
                    expected (expected.json), completeness (one definition for gather and
                    resume), gather, export, curve

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
