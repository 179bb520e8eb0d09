"""The training job's data: documents packed into sequences of ``seq_len`` tokens, in a stable
order that every rank computes alike, resumable from a cursor.

Each epoch visits every document once, in an order shuffled by ``(seed, epoch)`` (Python's
``random.Random``: the same on every platform). Documents are laid end to end into sequences of
exactly ``seq_len`` tokens; each sequence's ``cu_seqlens`` (flash-attn's convention) marks its
pieces, and the ring gives each piece attention over itself only (``ringattn``'s packed
layouts). A document that does not fit in what is left of a sequence is cut: its rest opens
the next sequence as a piece of its own.

* Positions restart at 0 in every piece, a continuation's too. Attention never crosses a
  piece, so with rotary embeddings (relative) the scores are the same whatever a piece's
  positions start from, and restarting keeps every position inside the model's trained
  context (a 100k-token document cut into 4k sequences never shows position 96k to it).
* Context does not carry: a continuation's first tokens see only the continuation.
* Labels do carry: a token's label is the next token of its *document*, so the last token of a
  cut piece predicts the continuation's first token. Only each document's last token has no
  label; a document of one token is skipped (it predicts nothing).

Sequence g of the run is the g-th of this stream; optimizer step s trains on sequences
``[s x batch, (s + 1) x batch)``, however many rings share them. A ``Cursor`` (epoch, index in
the epoch's order, tokens of that document already used) is where the stream stands; the
checkpoint keeps it, so a resumed run packs exactly what the uninterrupted one would have,
provided the documents are the same ones: the checkpoint also keeps ``listing_signature`` of
them (a file added to an input folder reshuffles every epoch), and a resume checks it, and the
cursor keeps the digest of the document it stands inside (``Cursor.held``: its continuation
must come from the same tokens). Documents the cursor has not reached are read as they are
when reached, as an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

IGNORE = -100  # a row with no label (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Cursor:
    """Where the stream stands: document ``index`` of epoch ``epoch``'s order, ``offset``
    tokens into it. ``held``: when ``offset`` > 0, the digest of that document's token ids
    (``token_digest``), "" otherwise. A resume continues the document from ``offset``, which
    means the same text only if its tokens are the ones cut: an edit to the same size passes
    ``listing_signature``, and the continuation would come from other text (refused)."""

    epoch: int = 0
    index: int = 0
    offset: int = 0
    held: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Cursor:
        fields = {"epoch", "index", "offset", "held"}
        if not isinstance(data, dict) or set(data) != fields:
            raise ValueError(f"a data cursor has exactly the keys {sorted(fields)}: got {data!r}")
        values = {k: data[k] for k in fields}
        for key in ("epoch", "index", "offset"):
            value = values[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"a data cursor holds non-negative integers: got {data!r}")
        held = values["held"]
        digest = isinstance(held, str) and len(held) == DIGEST_CHARS and _is_hex(held)
        if not (held == "" if values["offset"] == 0 else digest):
            raise ValueError(
                'a data cursor\'s held is a token digest when offset > 0 and "" when it is 0: '
                f"got {data!r}"
            )
        return cls(**values)


DIGEST_CHARS = 32


def token_digest(tokens: torch.Tensor) -> str:
    """A document's token ids, hashed (sha256, int64 little-endian, first 32 hex digits)."""
    raw = tokens.reshape(-1).to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(raw).hexdigest()[:DIGEST_CHARS]


def _is_hex(text: str) -> bool:
    return all(ch in "0123456789abcdef" for ch in text)


@dataclass
class PackedSequence:
    """One sequence of the stream: token ids, each row's label (``IGNORE``: none), each row's
    position in its piece, and the pieces' ``cu_seqlens``; ``docs`` names each piece's
    document (index into the listing) and where in it the piece starts."""

    ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: list[int]
    docs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def predicted(self) -> int:
        """Rows with a label: what this sequence adds to its step's loss denominator."""
        return int((self.labels != IGNORE).sum())


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The documents' order in ``epoch``: a permutation of range(count) fixed by the seed."""
    order = list(range(count))
    random.Random(f"ringctl-train:{seed}:{epoch}").shuffle(order)
    return order


class SequenceStream:
    """Packs documents into sequences (module docstring). ``tokens(i)`` gives document i's ids
    (a 1-D int tensor); the stream asks for each document once per visit and keeps only the
    one it is cutting."""

    def __init__(
        self, tokens: Callable[[int], torch.Tensor], count: int, seq_len: int, seed: int
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 tokens, got {seq_len}")
        if count < 1:
            raise ValueError("the training stream has no documents")
        self._tokens, self.count, self.seq_len, self.seed = tokens, count, seq_len, seed
        self._held: tuple[int, torch.Tensor] | None = None  # (document, its ids)
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.count, self.seed, epoch)}
        return self._orders[epoch]

    def _document(self, doc: int) -> torch.Tensor:
        if self._held is None or self._held[0] != doc:
            self._held = (doc, self._tokens(doc).reshape(-1).long())
        return self._held[1]

    def check(self, cursor: Cursor) -> str | None:
        """What is wrong with ``cursor`` for these documents (None: it points into them): a
        cursor read back from a checkpoint must name a document and a token of it."""
        if cursor.index >= self.count:
            return f"document {cursor.index} of an epoch of {self.count}"
        doc = self._order(cursor.epoch)[cursor.index]
        tokens = self._document(doc)
        if cursor.offset and cursor.offset >= len(tokens):
            return f"token {cursor.offset} of a document of {len(tokens)}"
        if cursor.offset and cursor.held != token_digest(tokens):
            return (
                f"token {cursor.offset} of document {doc} of the listing, whose tokens changed "
                "since its first part was trained on (the rest would come from other text)"
            )
        return None

    def take(self, cursor: Cursor, count: int) -> tuple[list[PackedSequence], Cursor]:
        """The next ``count`` sequences from ``cursor``, and the cursor after them."""
        out = []
        for _ in range(count):
            sequence, cursor = self._one(cursor)
            out.append(sequence)
        return out, cursor

    def _one(self, cursor: Cursor) -> tuple[PackedSequence, Cursor]:
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, labels)
        docs, room = [], self.seq_len
        skipped: set[int] = set()  # documents skipped since the last one that trained
        while room:
            doc = self._order(cursor.epoch)[cursor.index]
            tokens = self._document(doc)
            if len(tokens) < 2:  # predicts nothing: skipped
                cursor = self._next(cursor)
                skipped.add(doc)
                self._no_document_predicts(skipped)
                continue
            skipped.clear()
            take = min(room, len(tokens) - cursor.offset)
            pieces.append(_piece(tokens, cursor.offset, take))
            docs.append((doc, cursor.offset))
            room -= take
            if cursor.offset + take == len(tokens):
                cursor = self._next(cursor)
            else:
                held = cursor.held or token_digest(tokens)
                cursor = Cursor(cursor.epoch, cursor.index, cursor.offset + take, held)
        return _sequence(pieces, docs), cursor

    def _next(self, cursor: Cursor) -> Cursor:
        if cursor.index + 1 < self.count:
            return Cursor(cursor.epoch, cursor.index + 1, 0)
        return Cursor(cursor.epoch + 1, 0, 0)

    def _no_document_predicts(self, useless: set[int]) -> None:
        """Refused once every document of the listing, each as it was read, was skipped with
        none trained on between: exactly when none has two tokens. Counting skips in a row
        instead refused a corpus with one that has: an epoch's end reshuffles the order, so
        up to 2 x (count - 1) skips can lie between two visits of the one useful document."""
        if len(useless) == self.count:
            raise ValueError(
                "no input document has two tokens or more: nothing to train on (each document's "
                "tokens predict the next one)"
            )


def _piece(tokens: torch.Tensor, offset: int, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of ``take`` tokens of a document from ``offset``: each label the
    document's next token, none after its last."""
    after = tokens[offset + 1 : offset + take + 1]
    labels = torch.full((take,), IGNORE, dtype=torch.long)
    labels[: len(after)] = after
    return tokens[offset : offset + take], labels


def _sequence(pieces, docs) -> PackedSequence:
    cu = [0]
    for ids, _ in pieces:
        cu.append(cu[-1] + len(ids))
    return PackedSequence(
        ids=torch.cat([ids for ids, _ in pieces]),
        labels=torch.cat([labels for _, labels in pieces]),
        positions=torch.cat([torch.arange(len(ids)) for ids, _ in pieces]),
        cu_seqlens=cu,
        docs=docs,
    )


def step_sequences(step: int, batch: int) -> range:
    """The indices in the stream of the sequences optimizer step ``step`` trains on."""
    return range(step * batch, (step + 1) * batch)


def ring_share(batch: int, rings: int, ring: int) -> range:
    """Which of a step's ``batch`` sequences ring ``ring`` of ``rings`` trains on (the rings
    share them in order; ``batch`` divisible by ``rings`` is checked at submit)."""
    if batch % rings:
        raise ValueError(f"{batch} sequences per step cannot be shared by {rings} rings")
    per = batch // rings
    return range(ring * per, (ring + 1) * per)
