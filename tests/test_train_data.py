"""The training stream (ringctl/train/data.py): packing rules checked against the documents.

Every sequence holds exactly seq_len tokens; each piece is a run of one document; a token's
label is the next token of its document (so a cut piece's last token predicts the
continuation's first) and only a document's last token has none; positions restart in every
piece; an epoch visits every document once in a seeded order; a stream resumed from any cursor
packs exactly what the uninterrupted one does.
"""

from __future__ import annotations

import random

import pytest
import torch

from ringctl.train.data import IGNORE, Cursor, SequenceStream, epoch_order, ring_share

DOCS = [torch.arange(n) + 1000 * i for i, n in enumerate([5, 1, 17, 3, 40, 2, 9])]


def _stream(seq_len=8, seed=0):
    return SequenceStream(lambda i: DOCS[i], len(DOCS), seq_len, seed)


def test_sequences_follow_the_documents():
    stream = _stream()
    seqs, cursor = stream.take(Cursor(), 30)
    for seq in seqs:
        assert len(seq.ids) == len(seq.labels) == len(seq.positions) == 8 == seq.cu_seqlens[-1]
        for (doc, start), a, b in zip(
            seq.docs, seq.cu_seqlens[:-1], seq.cu_seqlens[1:], strict=True
        ):
            tokens = DOCS[doc]
            assert torch.equal(seq.ids[a:b], tokens[start : start + b - a])
            assert torch.equal(seq.positions[a:b], torch.arange(b - a))
            nxt = tokens[start + 1 : start + b - a + 1]
            want = torch.cat([nxt, torch.full((b - a - len(nxt),), IGNORE)])
            assert torch.equal(seq.labels[a:b], want)
    assert cursor.epoch >= 1  # 30 x 8 tokens span more than one epoch of 75 usable tokens
    assert all(doc != 1 for seq in seqs for doc, _ in seq.docs)  # the 1-token document


def test_an_epoch_visits_every_document_once_in_a_seeded_order():
    assert sorted(epoch_order(7, 3, 0)) == list(range(7))
    assert epoch_order(7, 3, 0) == epoch_order(7, 3, 0) != epoch_order(7, 3, 1)
    assert epoch_order(7, 3, 0) != epoch_order(7, 4, 0)


@pytest.mark.parametrize("split", [1, 3, 7, 11])
def test_resuming_from_a_cursor_packs_what_the_whole_run_packs(split):
    whole, _ = _stream().take(Cursor(), 16)
    first, cursor = _stream().take(Cursor(), split)
    cursor = Cursor.from_dict(cursor.to_dict())
    rest, _ = _stream().take(cursor, 16 - split)
    for a, b in zip(whole, first + rest, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels)
        assert a.cu_seqlens == b.cu_seqlens


def test_nothing_to_train_on_is_one_line():
    stream = SequenceStream(lambda i: torch.tensor([7]), 3, 8, 0)
    with pytest.raises(ValueError, match="no input document has two tokens"):
        stream.take(Cursor(), 1)


def test_nothing_to_train_on_is_refused_exactly_when_no_document_has_two_tokens():
    """The count of skipped (one-token) documents in a row spanned an epoch's end, where the
    order is reshuffled: a corpus whose one useful document came first in one epoch and last
    in the next was refused mid-run. Truth: refused iff no document has two tokens (here
    over random corpora, seeds and cursors through several epochs)."""
    docs = [torch.tensor([7, 8, 9])] + [torch.tensor([5])] * 4
    seed = next(
        s for s in range(1000) if epoch_order(5, s, 0)[0] == 0 and epoch_order(5, s, 1)[4] == 0
    )
    stream = SequenceStream(lambda i: docs[i], 5, 2, seed)
    seqs, cursor = stream.take(Cursor(), 6)
    assert [s.ids.tolist() for s in seqs] == [[7, 8], [9, 7], [8, 9], [7, 8], [9, 7], [8, 9]]
    assert cursor.epoch >= 3

    rng = random.Random(7)
    for _ in range(400):
        lengths = [rng.choice([0, 1, 1, 1, 2, 3, 9]) for _ in range(rng.randint(1, 9))]
        corpus = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]
        usable = sum(n - 1 for n in lengths if n >= 2)  # labelled tokens per epoch
        stream = SequenceStream(
            lambda i, c=corpus: c[i], len(corpus), rng.randint(2, 6), rng.randint(0, 99)
        )
        if not usable:
            with pytest.raises(ValueError, match="no input document has two tokens"):
                stream.take(Cursor(), 1)
            continue
        seqs, cursor = stream.take(Cursor(), 12)
        assert sum(s.predicted for s in seqs) > 0, lengths
        assert all(len(corpus[d]) >= 2 for s in seqs for d, _ in s.docs), lengths


def test_a_bad_cursor_is_refused():
    for bad in (
        {"epoch": 0, "index": -1, "offset": 0},
        {"epoch": 0},
        [],
        {"epoch": True, "index": 0, "offset": 0, "held": ""},
        {"epoch": 0, "index": 0, "offset": 3, "held": ""},  # cut, but no digest of what
        {"epoch": 0, "index": 0, "offset": 0, "held": "0" * 32},
        {"epoch": 0, "index": 0, "offset": 3, "held": "Z" * 32},
    ):
        with pytest.raises(ValueError, match="cursor"):
            Cursor.from_dict(bad)


def test_a_cut_document_edited_before_the_resume_is_refused():
    """A checkpoint taken inside a document keeps the digest of its tokens: the same size
    with other tokens (which the listing's key-and-size signature cannot see) would continue
    the document from other text, silently. Refused, naming the token and the document."""
    _, cursor = _stream().take(Cursor(), 3)
    assert cursor.offset > 0 and Cursor.from_dict(cursor.to_dict()) == cursor
    assert _stream().check(cursor) is None
    edited = list(DOCS)
    doc = epoch_order(len(DOCS), 0, cursor.epoch)[cursor.index]
    edited[doc] = DOCS[doc].flip(0)
    stream = SequenceStream(lambda i: edited[i], len(edited), 8, 0)
    assert stream.check(cursor) == (
        f"token {cursor.offset} of document {doc} of the listing, whose tokens changed since "
        "its first part was trained on (the rest would come from other text)"
    )


def test_rings_share_a_step_in_order():
    assert [list(ring_share(6, 3, r)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot be shared"):
        ring_share(6, 4, 0)
