"""Mean loss against token position across a corpus: the long-context curve.

A document's ``token_logprob[i]`` is ``log p(ids[i+1] | ids[..i])``: the loss of predicting the
token at position ``p = i + 1`` from the ``p`` tokens before it. Positions 1 .. N-1 of every
document are put in log-spaced buckets (powers of two: 1, 2-3, 4-7, 8-15, ...) and each bucket
keeps the sum of the negative log-likelihoods (float64) and the count, so the mean of a bucket is
exactly ``sum(-token_logprob) / count`` over the tokens whose position falls in it, whatever the
number or lengths of the documents. Long documents dominate the far buckets; the count and the
number of documents reaching a bucket are kept with it so that a reader can tell how much a
point rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

CURVE_FORMAT = "ringctl.longdoc.loss-by-position/1"


def bucket_of(positions: torch.Tensor) -> torch.Tensor:
    """Bucket index of each position >= 1: k for 2**k <= p < 2**(k+1) (integer arithmetic, so a
    power of two is never put one bucket low by rounding)."""
    limit = int(positions.max()) if positions.numel() else 1
    edges = torch.tensor([1 << k for k in range(1, limit.bit_length() + 1)], dtype=torch.int64)
    return torch.bucketize(positions, edges, right=True)


@dataclass
class LossCurve:
    """Accumulates per-bucket sums over documents (``add``), then reports them (``record``)."""

    nll_sum: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)
    documents: int = 0

    def add(self, token_logprob: torch.Tensor) -> None:
        """One document's ``token_logprob`` (N-1 values; an empty one adds no token)."""
        self.documents += 1
        n = token_logprob.numel()
        if n == 0:
            return
        positions = torch.arange(1, n + 1, dtype=torch.int64)
        buckets = bucket_of(positions)
        size = int(buckets[-1]) + 1
        sums = torch.bincount(buckets, weights=-token_logprob.double(), minlength=size)
        counts = torch.bincount(buckets, minlength=size)
        grow = size - len(self.count)
        if grow > 0:
            self.nll_sum += [0.0] * grow
            self.count += [0] * grow
            self.docs += [0] * grow
        for k in range(size):
            self.nll_sum[k] += float(sums[k])
            self.count[k] += int(counts[k])
            self.docs[k] += 1

    @property
    def tokens(self) -> int:
        return sum(self.count)

    def buckets(self) -> list[dict]:
        """One dict per bucket: first/last position (inclusive), tokens, documents, mean_nll
        (None where not finite: a log-probability of -inf)."""
        rows = []
        for k, (s, c) in enumerate(zip(self.nll_sum, self.count, strict=True)):
            mean = s / c if c else None
            rows.append(
                {
                    "first": 1 << k,
                    "last": (1 << (k + 1)) - 1,
                    "tokens": c,
                    "documents": self.docs[k],
                    "mean_nll": mean if mean is not None and math.isfinite(mean) else None,
                }
            )
        return rows

    def record(self, *, partial: bool, trained_context: int | None = None) -> dict:
        """What loss-by-position.json holds; ``trained_context``: the model's
        max_position_embeddings, when known (positions from it on were never trained)."""
        record = {
            "format": CURVE_FORMAT,
            "position": "p = i + 1 for token_logprob[i]: the predicted token's index in its "
            "document (= tokens of context before it)",
            "buckets_are": "powers of two: positions first..last inclusive",
            "partial": partial,
            "documents": self.documents,
            "tokens": self.tokens,
            "buckets": self.buckets(),
        }
        if trained_context is not None:
            record["trained_context"] = trained_context
        return record
