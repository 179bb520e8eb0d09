"""Long documents in batch: score / embed / grad with a causal LM whose attention is ringattn.

    documents.py  which documents, stable ids, missing-input policy
    tokenize.py   byte-level (default) or a local HF tokenizer
    model.py      a local HF causal LM or the bundled tiny random Llama
    scoring.py    the three tasks on one sharded document
    shards.py     each rank's outputs + manifest entries, written atomically
    run.py        the loop over documents: ``run_longdoc`` and ``LongDocParams``

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
