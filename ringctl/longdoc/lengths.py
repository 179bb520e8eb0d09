"""How many tokens a document has, before anyone tokenises it: the one length estimator.

`ringctl submit` (is there a ring that holds each document?), `ringctl plan JOB` (the
schedule's makespan) and the job itself (which ring runs which document) all size documents
with ``estimated_tokens``: a document's UTF-8 bytes divided by ``bytes_per_token``.

* ``bytes_per_token=1`` (submit and plan): a document's size in bytes. Exact for the byte-level
  tokenizer; for a model's tokenizer (BPE or SentencePiece, each token at least one byte of
  text) an upper bound on its text's tokens, so a document that passes the check fits, and a
  predicted makespan errs long. Nothing is loaded: no tokenizer, no torch.
* ``bytes_per_token=sampled_bytes_per_token(docs, tokenizer)`` (the job, once its tokenizer
  is loaded): every rank tokenises the same small sample (the first documents, up to
  ``SAMPLE_BYTES``) and divides by its bytes per token, a closer estimate. The ring that runs
  a document tokenises it for real, and one whose real length no longer fits its ring's
  budget fails the job by name rather than running out of memory.

Torch-free: the tokenizer is only called (``encode(raw)`` returns a sequence of ids).
"""

from __future__ import annotations

from collections.abc import Sequence

from .documents import Document

__all__ = ["SAMPLE_BYTES", "document_bytes", "estimated_tokens", "sampled_bytes_per_token"]

SAMPLE_BYTES = 256 * 1024


def document_bytes(doc: Document) -> int:
    """The document's size in bytes (0 for a file gone since it was listed)."""
    try:
        return doc.nbytes
    except OSError:
        return 0


def estimated_tokens(docs: Sequence[Document], bytes_per_token: float = 1.0) -> list[int]:
    """Tokens per document, in order: ceil(bytes / ``bytes_per_token``); see the module
    docstring for which ratio each caller passes and why."""
    return [int(-(-document_bytes(doc) // bytes_per_token)) for doc in docs]


def sampled_bytes_per_token(docs: Sequence[Document], tokenizer) -> float:
    """1 for the byte tokenizer; else bytes per token measured on the same sample on every
    rank (4 when nothing could be read)."""
    if getattr(tokenizer, "name", None) == "bytes":
        return 1.0
    raw_bytes = tokens = 0
    for doc in docs:
        if raw_bytes >= SAMPLE_BYTES:
            break
        try:
            raw = doc.read_bytes()[:SAMPLE_BYTES]
        except (OSError, ValueError):
            continue
        raw_bytes += len(raw)
        tokens += len(tokenizer.encode(raw))
    return raw_bytes / tokens if tokens else 4.0
