"""Packed documents through a Hugging Face causal LM whose attention is ringattn.

Two gloo ranks run one packed sequence (documents of 1 to 90 tokens, one cut by a chunk edge)
through tiny random models with ``ring_settings(cu_seqlens=...)``, each row's position within
its own document; the reference is each document alone through the model's own attention in
one process (sdpa; eager for gpt-oss's sinks). Per-token log-probabilities within 2e-5, the
compatibility suite's bound (tests/test_longdoc_compat.py): no document's last token predicts
the next document's first, and no document sees another. A model whose RoPE depends on the
sequence's length is refused for packing by name.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_longdoc_compat import BASE, TOL

DOCS = (1, 37, 5, 90, 20, 2, 61)
MODELS = {
    "llama": dict(model_type="llama"),
    "mistral, window 16": dict(model_type="mistral", sliding_window=16),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "gpt_oss, sinks, window 24": dict(model_type="gpt_oss", sliding_window=24),
}


def tiny_model(spec: dict, attn: str):
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    fields = {k: v for k, v in spec.items() if k != "model_type"}
    config = AutoConfig.for_model(spec["model_type"], **{**BASE, **fields})
    return build_random(config, seed=7, dtype=torch.float32, attn_implementation=attn).eval()


def packed_tokens() -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], (sum(DOCS),), generator=torch.Generator().manual_seed(3)
    )


def _cu() -> list[int]:
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    return cu


def outcome(model, ids: torch.Tensor, positions, **settings) -> str:
    """What one rank says of one forward under ``ring_settings(**settings)``: "ran", or the
    ValueError it raised."""
    from ringattn.hf import ring_settings

    try:
        with torch.no_grad(), ring_settings(**settings):
            model(input_ids=ids, position_ids=positions, use_cache=False)
    except ValueError as err:
        return str(err)
    return "ran"


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[i + 1]) at each row but the last (float32)."""
    return logits.float().log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def _ranks(rank: int, world: int) -> dict:
    import ringattn
    from ringattn.hf import register, ring_settings

    register()
    ids, cu = packed_tokens(), _cu()
    out = {}
    for name, spec in MODELS.items():
        model = tiny_model(spec, "ringattn")
        window = spec.get("sliding_window")
        packing = ringattn.pack_sequence(
            cu, world_size=world, layout="zigzag", balance_window=window
        )
        kw = dict(world_size=world, rank=rank, layout="zigzag", cu_seqlens=packing)
        shard_ids = ringattn.shard_sequence(ids, dim=0, **kw)
        positions = ringattn.document_positions(
            packing, world_size=world, rank=rank, layout="zigzag"
        )
        with torch.no_grad(), ring_settings(layout="zigzag", cu_seqlens=packing, model=model):
            logits = model(
                input_ids=shard_ids[None],
                position_ids=positions.clamp(min=0)[None],
                use_cache=False,
            ).logits[0]
        out[name] = (
            logits,
            ringattn.sequence_positions(
                sum(DOCS), cu_seqlens=packing, **{k: v for k, v in kw.items() if k != "cu_seqlens"}
            ),
        )
    return out


def test_packed_documents_equal_each_document_alone():
    per_rank = run_distributed(_ranks, 2)
    for name, spec in MODELS.items():
        _assert_each_document_alone(name, spec, [r[name] for r in per_rank])


def _assert_each_document_alone(name: str, spec: dict, shards: list) -> None:
    """Every document's log-probabilities from the ranks' (logits, global rows) shards equal
    that document alone through the model's own attention, within TOL."""
    ids, cu = packed_tokens(), _cu()
    full = torch.full((sum(DOCS), BASE["vocab_size"]), float("nan"))
    for logits, positions in shards:
        keep = positions >= 0
        full[positions[keep]] = logits[keep]
    attn = "eager" if spec["model_type"] == "gpt_oss" else "sdpa"
    model = tiny_model(spec, attn)
    worst = 0.0
    for a, b in zip(cu, cu[1:], strict=False):
        if b - a < 2:  # a one-token document predicts nothing
            continue
        with torch.no_grad():
            alone = model(input_ids=ids[None, a:b], use_cache=False).logits[0]
        err = (_logprobs(full[a:b], ids[a:b]) - _logprobs(alone, ids[a:b])).abs().max()
        worst = max(worst, float(err))
    assert worst <= TOL, f"{name}: {worst:.2e} > {TOL}"


def test_hybrid_packing_is_exact_and_position_jumps_are_refused():
    """A 2-rank Ulysses grid (U = 2): packed documents through the Hugging Face path equal each
    document alone, and position_ids from another packing (restarting inside a document the
    ring's cu_seqlens says is one, on each member's share of its rows) are refused by name.
    Before, a hybrid grid's position_ids were not checked against cu_seqlens (plain rings'
    were): the wrong positions ran, RoPE off, exit 0. Where one rank's positions jump, every
    rank of the grid refuses (the other once went on into the grid's collectives alone), and
    the right call after it runs on both."""
    per_rank = run_distributed(_hybrid_ranks, 2)
    assert all(refused for _, refused in per_rank)
    _assert_each_document_alone("llama, hybrid U=2", MODELS["llama"], [s for s, _ in per_rank])


def _hybrid_ranks(rank: int, world: int):
    import ringattn
    from ringattn.hf import register, ring_settings
    from ringattn.hybrid import hybrid_groups

    register()
    groups = hybrid_groups(2)
    ids, cu, layout = packed_tokens(), _cu(), "hybrid-zigzag"
    kw = dict(world_size=world, rank=groups.rank, layout=layout, ulysses_degree=2)
    packing = ringattn.pack_sequence(cu, world_size=world, layout=layout, ulysses_degree=2)
    shard_ids = ringattn.shard_sequence(ids, dim=0, cu_seqlens=packing, **kw)
    positions = ringattn.document_positions(packing, **kw).clamp(min=0)
    wrong = torch.arange(positions.numel()) % 3  # restarts every third row
    model = tiny_model(MODELS["llama"], "ringattn")
    settings = dict(group=groups.ring, ulysses_group=groups.ulysses, layout=layout)
    with torch.no_grad(), ring_settings(cu_seqlens=packing, **settings):
        with pytest.raises(ValueError, match=r"position_ids jump inside document \d+ of cu_"):
            model(input_ids=shard_ids[None], position_ids=wrong[None], use_cache=False)
        one_wrong = wrong if groups.rank == 0 else positions  # only rank 0's positions jump
        with pytest.raises(ValueError) as said:
            model(input_ids=shard_ids[None], position_ids=one_wrong[None], use_cache=False)
        if groups.rank == 0:
            assert re.match(r"ringattn: position_ids jump inside document \d+", str(said.value))
        else:
            assert "rank 0 found bad input in the hybrid grid" in str(said.value)
        logits = model(
            input_ids=shard_ids[None], position_ids=positions[None], use_cache=False
        ).logits[0]
    rows = ringattn.sequence_positions(sum(DOCS), cu_seqlens=packing, **kw)
    return (logits, rows), True


def test_a_grid_members_whole_share_shifted_is_refused():
    """A 2 x 2 grid (U = 2 Ulysses members, R = 2 ring ranks, hybrid-contiguous: one piece
    each) given transformers' default 0..S-1 positions: each member's share looks right to
    itself (on a U = 2 grid of one ring
    it ran 4.6e-3 off, exit 0). The grid compares each shared document's shift across every
    member now (over the Ulysses groups, then the rings), and all four ranks refuse with one
    message; the right positions run."""
    said = run_distributed(_grid_positions, 4)
    for scenario, between in (
        ("plain", "0 (+0) and rank 1 (-12)"),
        ("packed", "0 (+3) and rank 1 (-9)"),
        ("second ring", "0 (+0) and rank 2 (+5)"),
    ):
        assert len({r[scenario] for r in said}) == 1, [r[scenario] for r in said]
        assert f"are shifted differently on rank {between}" in said[0][scenario]
    for scenario in ("plain, right", "packed, right"):
        assert [r[scenario] for r in said] == ["ran"] * 4


def _grid_positions(rank: int, world: int) -> dict:
    import ringattn
    from ringattn.hf import register
    from ringattn.hybrid import hybrid_groups

    register()
    groups = hybrid_groups(2)
    layout, n, cu = "hybrid-contiguous", 48, [0, 3, 43, 48]
    kw = dict(world_size=world, rank=groups.rank, layout=layout, ulysses_degree=2)
    packing = ringattn.pack_sequence(cu, world_size=world, layout=layout, ulysses_degree=2)
    ids = packed_tokens()[:n]
    plain = ringattn.shard_sequence(ids, dim=0, **kw)[None]
    packed = ringattn.shard_sequence(ids, dim=0, cu_seqlens=packing, **kw)[None]
    in_sequence = ringattn.sequence_positions(n, **kw)[None]
    ring_rank = torch.distributed.get_rank(groups.ring)
    calls = {  # (cu_seqlens, ids, positions; None: transformers' own 0..S-1)
        "plain": (None, plain, None),
        "packed": (packing, packed, None),
        # the Ulysses groups agree within, the rings across them do not
        "second ring": (None, plain, in_sequence + 5 * ring_rank),
        "plain, right": (None, plain, in_sequence),
        "packed, right": (
            packing,
            packed,
            ringattn.document_positions(packing, **kw).clamp(min=0)[None],
        ),
    }
    model = tiny_model(MODELS["llama"], "ringattn")
    settings = dict(group=groups.ring, ulysses_group=groups.ulysses, layout=layout)
    return {
        scenario: outcome(model, ids, positions, cu_seqlens=cu_seqlens, **settings)
        for scenario, (cu_seqlens, ids, positions) in calls.items()
    }


def test_length_dependent_rope_is_refused_for_packing():
    from ringattn.hf import ring_settings

    model = tiny_model(
        dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "sdpa"
    )
    with pytest.raises(ValueError, match="scales RoPE by the sequence's length"):
        with ring_settings(layout="zigzag", cu_seqlens=[0, 5], model=model):
            pass


def test_packing_that_would_attend_across_documents_is_refused():
    """Each attended across documents with no error before (0.2 abs off each document alone,
    from a review): packed position_ids with no cu_seqlens (transformers infers the packing
    and ringattn dropped it), flash-attn's packing keywords (ignored), rows of a batch packed
    differently under one cu_seqlens, position_ids restarting inside a document cu_seqlens
    says is one, and length-scaled RoPE given cu_seqlens without the model (only
    ring_settings(model=...) refused it). One rank (a process group of one)."""
    assert run_distributed(_packing_refusals, 1) == [True]


def _packing_refusals(rank: int, world: int) -> bool:
    from ringattn.hf import register, ring_settings

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    docs, cu = (5, 7, 4), [0, 5, 12, 16]
    ids = packed_tokens()[:16][None]
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    flat = torch.tensor(cu, dtype=torch.int32)
    with torch.no_grad(), ring_settings(layout="contiguous"):
        with pytest.raises(ValueError, match="position_ids restart within a row"):
            model(input_ids=ids, position_ids=pos, use_cache=False)
        with pytest.raises(ValueError, match=r"packed-batch keywords \(cu_seq_lens_q"):
            model(input_ids=ids, position_ids=pos, cu_seq_lens_q=flat, cu_seq_lens_k=flat)
        model(input_ids=ids, use_cache=False)  # one document: positions never restart
    rows = torch.cat([pos, torch.cat([torch.arange(8), torch.arange(8)])[None]])
    with torch.no_grad(), ring_settings(layout="contiguous", cu_seqlens=cu):
        with pytest.raises(ValueError, match="rows of a packed batch have different"):
            model(input_ids=ids.expand(2, -1), position_ids=rows, use_cache=False)
        with pytest.raises(ValueError, match=r"position_ids jump inside document 1 of cu_seq"):
            model(input_ids=ids, position_ids=rows[1:], use_cache=False)  # restarts at 8
        model(input_ids=ids, position_ids=pos, use_cache=False)
        model(input_ids=ids, position_ids=torch.arange(16)[None], use_cache=False)  # relative
    dynamic = tiny_model(
        dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "ringattn",
    )
    with torch.no_grad(), ring_settings(layout="contiguous", cu_seqlens=cu):
        with pytest.raises(ValueError, match=r"scales RoPE by the sequence's length \(dynamic"):
            dynamic(input_ids=ids, position_ids=pos, use_cache=False)
    return True


def test_positions_that_do_not_follow_a_ranks_pieces_are_refused():
    """On 2 zigzag ranks rank 0 holds two pieces of a document (packed, or the one sequence)
    that are not next to each other in it; the check compared steps only within each piece,
    so transformers' default positions (each rank's own 0..S-1) ran with exit 0: 1.8e-3 off
    each document alone (2e-3 for one sequence). The pieces of one document on a rank must be
    shifted alike now. Rank 1's pieces are adjacent, so only rank 0 sees the problem; the
    ring's agreement raises it on both (rank 1 once failed on the lost peer instead), and no
    rank is left in the ring: a right call runs next on both. (A rank whose whole share is
    shifted: the next test.)"""
    said = run_distributed(_piece_positions, 2)
    for scenario, doc in (("packed", 1), ("plain", 0)):
        assert f"position_ids of document {doc} do not follow" in said[0][scenario]
        assert said[1][scenario].startswith("ringattn: rank 0 of the ring refused its input")
    assert [r["right"] for r in said] == ["ran", "ran"]


def _piece_positions(rank: int, world: int) -> dict:
    import ringattn
    from ringattn.hf import register

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    cu, n = [0, 3, 43, 48], 48
    ids = packed_tokens()[:n]
    kw = dict(world_size=world, rank=rank, layout="zigzag")
    packed = ringattn.shard_sequence(ids, dim=0, cu_seqlens=cu, **kw)[None]
    plain = ringattn.shard_sequence(ids, dim=0, **kw)[None]
    calls = {  # (ids, cu_seqlens, positions; None: transformers' own 0..S-1)
        "packed": (packed, cu, None),
        "plain": (plain, None, None),
        "right": (packed, cu, ringattn.document_positions(cu, **kw).clamp(min=0)[None]),
    }
    return {
        scenario: outcome(model, ids, positions, layout="zigzag", cu_seqlens=cu_seqlens)
        for scenario, (ids, cu_seqlens, positions) in calls.items()
    }


def test_a_ranks_whole_share_shifted_is_refused():
    """On 2 contiguous ranks each rank holds one piece, so each rank's positions look right to
    itself: transformers' default 0..S-1 on rank 1 (its rows are tokens 24-47) ran with exit
    0, RoPE placing rank 1's queries 24 tokens before rank 0's keys. The ring's agreement
    compares each shared document's shift now, and both ranks refuse with one message.
    Positions in the sequence (not the document) shift every document alike and run."""
    said = run_distributed(_share_positions, 2)
    for scenario, doc, shifts in (
        ("packed", 1, "(+3) and rank 1 (-21)"),
        ("plain", 0, "(+0) and rank 1 (-24)"),
    ):
        assert said[0][scenario] == said[1][scenario]
        assert (
            f"position_ids of document {doc} are shifted differently on rank 0 {shifts}"
            in (said[0][scenario])
        )
    for scenario in ("right", "in the sequence", "plain, right"):
        assert [r[scenario] for r in said] == ["ran", "ran"]


def test_a_restart_one_rank_sees_is_refused_on_every_rank():
    """Documents packed into position_ids but no cu_seqlens, the restart in rank 1's share
    only (and rows of a batch that differ on rank 1 only): rank 1 refused alone, rank 0 ran
    the bad call and then died on its lost peer (its first call paired with rank 1's
    second). Both refuse now, and the right call after it runs on both."""
    said = run_distributed(_one_rank_restarts, 2)
    for scenario, text in (("restart", "restart within a row"), ("rows", "different position")):
        assert text in said[1][scenario], said[1][scenario]
        assert said[0][scenario].startswith("ringattn: rank 1 of the ring refused its input")
    assert [r["right"] for r in said] == ["ran", "ran"]


def _one_rank_restarts(rank: int, world: int) -> dict:
    import ringattn
    from ringattn.hf import register

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    cu, n = [0, 30, 48], 48
    kw = dict(world_size=world, rank=rank, layout="contiguous")
    ids = ringattn.shard_sequence(packed_tokens()[:n], dim=0, **kw)[None]
    docs = ringattn.document_positions(cu, **kw)[None]  # rank 1's share restarts at row 6
    rows = torch.cat([docs, docs + (rank == 1)])  # rank 1's rows differ
    calls = {  # (ids, cu_seqlens, positions)
        "restart": (ids, None, docs),
        "rows": (ids.expand(2, -1), cu, rows),
        "right": (ids, cu, docs),
    }
    return {
        scenario: outcome(model, tokens, positions, layout="contiguous", cu_seqlens=cu_seqlens)
        for scenario, (tokens, cu_seqlens, positions) in calls.items()
    }


def _share_positions(rank: int, world: int) -> dict:
    import ringattn
    from ringattn.hf import register

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    cu, n = [0, 3, 43, 48], 48
    ids = packed_tokens()[:n]
    kw = dict(world_size=world, rank=rank, layout="contiguous")
    shard = ringattn.shard_sequence(ids, dim=0, **kw)[None]
    in_sequence = ringattn.shard_sequence(torch.arange(n), dim=0, **kw)[None]
    calls = {  # (cu_seqlens, positions; None: transformers' own 0..S-1)
        "packed": (cu, None),
        "plain": (None, None),
        "right": (cu, ringattn.document_positions(cu, **kw)[None]),
        "in the sequence": (cu, in_sequence),
        "plain, right": (None, in_sequence),
    }
    return {
        scenario: outcome(model, shard, positions, layout="contiguous", cu_seqlens=cu_seqlens)
        for scenario, (cu_seqlens, positions) in calls.items()
    }


def test_a_layer_that_attends_both_ways_is_refused():
    """ring attention applies the causal mask; a layer with is_causal=False (a BERT encoder,
    or the call's own is_causal=False) ran causal, exit 0 (BERT: 3.4e-2 off sdpa)."""
    assert run_distributed(_both_ways, 1) == [True]


def _both_ways(rank: int, world: int) -> bool:
    from ringattn.hf import ring_attention_forward

    q = torch.randn(1, 2, 6, 8)

    class Encoder(torch.nn.Module):
        is_causal = False

    for module, kwargs in ((Encoder(), {}), (torch.nn.Module(), {"is_causal": False})):
        with pytest.raises(ValueError, match=r"attends both ways \(is_causal=False\)"):
            ring_attention_forward(module, q, q, q, None, scaling=0.3, **kwargs)
    out, _ = ring_attention_forward(torch.nn.Module(), q, q, q, None, scaling=0.3)
    assert out.shape == (1, 6, 2, 8)
    return True
