"""Findings of a read-only review of the engine's API as user scripts call it (session of
2026-12-05 11:22), each reproduced first: second derivatives, a LocalRing shared by threads,
autocast around the call, and the Hugging Face integration's padding masks (refused on one
rank, others waiting), inference mode and KV caches. The references are plain float64
attention (``tests.ring_harness``) or the engine's own result without the feature."""

from __future__ import annotations

import copy
import pickle
import re
import threading

import pytest
import torch

import ringattn
from ringattn import ring_attention, shard_sequence
from ringattn.local_ring import LocalRing
from tests.distributed import run_distributed
from tests.test_hf_packed import outcome, packed_tokens, tiny_model


def _qkv(n: int = 16, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, 2, 8, dtype=dtype, generator=g) for _ in range(3)]


def _ring(q, k, v, world: int = 2, **kw):
    kw = {"layout": "contiguous", **kw}
    return ringattn.ring_attention(q, k, v, causal=True, comm=LocalRing(world), **kw)


@pytest.mark.parametrize("kernel", ["torch", "chunked"])
def test_second_order_gradients_are_refused_by_name(kernel, monkeypatch):
    """once_differentiable cut the graph from dq back to q: hessian and hvp read the missing
    link as zeros (|H| 0.0 where float64 gives 0.267), exit 0. A backward asked to build a
    graph is refused by name; the first order stays exact (gradcheck)."""
    monkeypatch.setenv("RINGATTN_KERNEL", kernel)
    q, k, v = _qkv()

    def f(x):
        return _ring(x, k, v).square().sum()

    with pytest.raises(RuntimeError, match="second-order gradients are not implemented"):
        torch.autograd.functional.hessian(f, q)
    with pytest.raises(RuntimeError, match="second-order gradients are not implemented"):
        torch.autograd.functional.hvp(f, q, torch.ones_like(q))
    qg = q.clone().requires_grad_()
    torch.autograd.gradcheck(lambda x: _ring(x, k, v), (qg,), eps=1e-6, atol=1e-8)


def test_a_local_ring_shared_by_threads_gives_each_its_own_result():
    """Two threads driving one LocalRing (nn.DataParallel's replicas share it) mixed their
    blocks: 3 results of 50 wrong by up to 0.72, others "posted unequal exchanges". Calls
    take turns; bool world sizes are refused."""
    ring = LocalRing(4)
    cases = [_qkv(32, seed=s) for s in range(2)]
    wants = [_ring(*c, world=4) for c in cases]
    wrong: list[str] = []

    def work(i: int) -> None:
        for _ in range(25):
            try:
                got = ringattn.ring_attention(
                    *cases[i], causal=True, layout="contiguous", comm=ring
                )
                if not torch.equal(got, wants[i]):
                    wrong.append(f"thread {i}: wrong")
            except RuntimeError as err:
                wrong.append(f"thread {i}: {err}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got True"):
        LocalRing(True)
    copied = pickle.loads(pickle.dumps(copy.deepcopy(ring)))  # (the lock is not copied)
    assert torch.equal(
        ringattn.ring_attention(*cases[0], causal=True, layout="contiguous", comm=copied), wants[0]
    )
    shallow = copy.copy(ring)  # a whole copy: a shallow one shared the ranks, not the lock
    assert shallow.endpoints()[0] is not ring.endpoints()[0]


@pytest.mark.parametrize("kernel", ["torch", "chunked"])
def test_autocast_around_the_call_leaves_the_engine_at_its_inputs_precision(kernel, monkeypatch):
    """Under a bf16 autocast the matmul kernels (chunked; the banded kernel's matmul band)
    ran in bf16 what the fused kernel ran in float32: float32 inputs came back 9.9e-3 off,
    by which kernel a shape picked. Autocast stops at the engine: the same numbers as
    without it."""
    monkeypatch.setenv("RINGATTN_KERNEL", kernel)
    q, k, v = (t.float().requires_grad_() for t in _qkv(64))
    want = _ring(q, k, v, window=24)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _ring(q, k, v, window=24)
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=0, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.allclose(g, w, rtol=0, atol=1e-5)


def _hf_calls(rank: int, world: int) -> dict:
    """A right-padded sequence's mask sharded like its ids (zeros on rank 1 only), then a
    right call; and, as one rank of this ring, a KV cache and inference mode."""
    import ringattn
    from ringattn.hf import register, ring_settings

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    n = 32
    kw = dict(world_size=world, rank=rank, layout="contiguous")
    ids = ringattn.shard_sequence(packed_tokens()[:n], dim=0, **kw)[None]
    pos = ringattn.sequence_positions(n, **kw)[None]
    mask = torch.ones(1, n, dtype=torch.long)
    mask[:, -5:] = 0
    said = {}
    try:
        with torch.no_grad(), ring_settings(layout="contiguous"):
            shard = ringattn.shard_sequence(mask, dim=1, **kw)
            model(input_ids=ids, attention_mask=shard, position_ids=pos, use_cache=False)
        said["padded"] = "ran"
    except ValueError as err:
        said["padded"] = str(err)
    said["right"] = outcome(model, ids, pos, layout="contiguous")
    with torch.inference_mode(), ring_settings(layout="contiguous"):
        said["inference"] = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    with torch.no_grad(), ring_settings(layout="contiguous"):
        said["no_grad"] = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        past = model(input_ids=ids, position_ids=pos, use_cache=True).past_key_values
        try:  # the next token after this rank's share, its keys in the cache
            model(input_ids=ids[:, :1], position_ids=pos[:, -1:] + 1, past_key_values=past)
            said["cache"] = "ran"
        except ValueError as err:
            said["cache"] = str(err)
    return said


def test_hf_refusals_reach_every_rank_and_inference_mode_runs():
    """A padding mask whose zeros fall on rank 1 alone: rank 1 refused while building the
    mask, rank 0 waited in the ring for it until the group's timeout (30 min by default).
    Both refuse now, and the next call runs on both. Under torch.inference_mode the
    position check read an inference tensor's version counter (a traceback); it runs, as
    under no_grad. A KV cache was "q and k/v must agree on batch, seq_local"; said."""
    said = run_distributed(_hf_calls, 2)
    assert "a padding attention_mask (with zeros) was given" in said[1]["padded"]
    assert said[0]["padded"].startswith("ringattn: rank 1 of the ring refused its input")
    assert [r["right"] for r in said] == ["ran", "ran"]
    for r in said:
        assert torch.equal(r["inference"], r["no_grad"])
        assert "a KV cache: past_key_values, or generate() with use_cache=True" in r["cache"]


def test_hf_output_attentions_is_refused_by_name():
    """output_attentions=True gave attentions=[] without a word (transformers warns for sdpa,
    and a caller's attentions[0] then failed far from the cause)."""
    said = run_distributed(_attentions_asked, 1)
    assert "ringattn: output_attentions=True: ring attention never forms" in said[0]


def _attentions_asked(rank: int, world: int) -> str:
    from ringattn.hf import register

    register()
    model = tiny_model(dict(model_type="llama"), "ringattn")
    ids = packed_tokens()[:16][None]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, output_attentions=True)
    except ValueError as err:
        return str(err)
    return "ran"


def test_layout_arguments_that_are_not_whole_numbers_or_dimensions_are_named():
    """(engine API review, packed sequences) A float rank raised "tuple indices must be
    integers" from inside the layout; world_size=2.0 failed in a fresh process and passed after
    a call with 2 (the packed layout's cache); world_size=True was a ring of one; N <= 0 gave
    an empty shard (-4 % 4 == 0); dim past the tensor's an IndexError from its shape."""
    from ringattn import document_positions, pack_sequence, sequence_positions, unshard_sequence

    x = torch.zeros(1, 8, 2, 4)
    refused = {
        "rank must be an int, got 1.0": lambda: document_positions(
            [0, 3, 10], world_size=2, rank=1.0, layout="zigzag"
        ),
        "world_size must be an int, got 2.0": lambda: shard_sequence(
            x, world_size=2.0, rank=0, layout="zigzag"
        ),
        "world_size must be an int, got True": lambda: pack_sequence(
            [0, 3, 10], world_size=True, layout="zigzag"
        ),
        "N must be an int >= 1, got -4": lambda: sequence_positions(
            -4, world_size=2, rank=0, layout="zigzag"
        ),
        "N must be an int >= 1, got 0": lambda: sequence_positions(
            0, world_size=2, rank=0, layout="zigzag"
        ),
        "dim 4 is not a dimension of a 4-D tensor": lambda: shard_sequence(
            x, world_size=2, rank=0, layout="zigzag", dim=4
        ),
        "dim -5 is not a dimension of a 4-D tensor": lambda: unshard_sequence(
            [x, x], layout="zigzag", dim=-5
        ),
    }
    shard_sequence(x, world_size=2, rank=0, layout="zigzag", cu_seqlens=[0, 3, 8])  # cached
    for said, call in refused.items():
        with pytest.raises(ValueError, match=re.escape(said)):
            call()
    assert torch.equal(  # a negative dim counts from the end, as torch's
        shard_sequence(x, world_size=2, rank=1, layout="zigzag", dim=-3),
        shard_sequence(x, world_size=2, rank=1, layout="zigzag", dim=1),
    )


def test_a_packing_given_once_as_an_iterator_or_as_numpy_numbers_is_read_as_a_list():
    """(engine API review) cu_seqlens=iter([...]) was read by the packing's checksum, then
    again, empty: "cu_seqlens must be [0, l1, ...]: got []". softmax_scale=np.float32 was
    refused where np.float64 was taken, balance_window=np.int64 where window=np.int64 is;
    a window of 2**63 passed LocalRing and failed a process group's agreement with
    "Overflow when unpacking long long"."""
    import numpy as np

    from ringattn import pack_sequence

    cu = [0, 3, 10]
    x = torch.randn(1, 10, 2, 8, dtype=torch.float64)
    q = torch.cat(
        [shard_sequence(x, world_size=2, rank=r, layout="zigzag", cu_seqlens=cu) for r in (0, 1)],
        1,
    )

    def run(packing, **kw):
        kw = {"causal": True, "layout": "zigzag", "comm": LocalRing(2), **kw}
        return ring_attention(q, q, q, cu_seqlens=packing, **kw)

    want = run(cu)
    assert torch.equal(run(iter(cu)), want)
    assert torch.equal(run(cu, softmax_scale=np.float32(0.5)), run(cu, softmax_scale=0.5))
    balanced = pack_sequence(cu, world_size=2, layout="zigzag", balance_window=np.int64(3))
    assert balanced == pack_sequence(cu, world_size=2, layout="zigzag", balance_window=3)
    with pytest.raises(ValueError, match=r"window must be an int from 1 to 2\*\*63-1"):
        run(cu, window=1 << 63)


def test_the_twins_of_the_argument_fixes_read_arguments_the_same_way():
    """(second reading) The iterator fix missed unshard_sequence (and ringattn.hf's settings,
    read by every layer); balance_window=4.0 was refused in a fresh process and taken after a
    call with 4 (the cache); padded_length(15, world_size=4.0) returned 16.0."""
    from ringattn import pack_sequence, padded_length, unshard_sequence

    x = torch.randn(1, 16, 2, 4)
    cu = [0, 8, 16]
    chunks = [
        shard_sequence(x, world_size=2, rank=r, layout="zigzag", cu_seqlens=cu) for r in (0, 1)
    ]
    assert torch.equal(unshard_sequence(chunks, layout="zigzag", cu_seqlens=iter(cu)), x)
    pack_sequence(cu, world_size=4, layout="zigzag", balance_window=4)  # cached
    with pytest.raises(
        ValueError, match="balance_window must be a whole number >= 1 or None, got 4.0"
    ):
        pack_sequence(cu, world_size=4, layout="zigzag", balance_window=4.0)
    for bad in (4.0, True):
        with pytest.raises(ValueError, match=f"world_size must be an int, got {bad}"):
            padded_length(15, world_size=bad, layout="zigzag")


def _one_rank_refuses(rank: int, world: int) -> dict:
    """Rank 1 alone passes a bad input (a float64 k, then a 3-D q), then both a good one."""
    import time

    import torch.distributed as dist

    from ringattn import ring_attention

    q = torch.randn(1, 8, 2, 4)
    said = {}
    for case, (qq, kk) in {
        "dtype": (q, q.double() if rank == 1 else q),
        "shape": (q[0] if rank == 1 else q, q),
    }.items():
        started = time.monotonic()
        try:
            ring_attention(qq, kk, q, causal=True, layout="zigzag")
            said[case] = "ran"
        except ValueError as err:
            said[case] = str(err)
        said[f"{case} seconds"] = time.monotonic() - started
    said["after"] = ring_attention(q, q, q, causal=True, layout="zigzag").shape
    dist.barrier()
    return said


def test_a_bad_input_on_one_rank_is_raised_on_every_rank(monkeypatch):
    """ring_attention's own checks (shapes, dtypes) raised on the rank they failed on
    alone, before the ring's agreement: the other ranks waited in it until the process
    group's timeout (30 minutes by default), as the README said they would not. The
    refusal now travels through the agreement: rank 1 names the problem, rank 0 names
    rank 1, at once; the next call runs on both."""
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "20")
    said = run_distributed(_one_rank_refuses, 2)
    assert "dtype" in said[1]["dtype"] and "q" in said[1]["shape"]
    for case in ("dtype", "shape"):
        assert said[0][case].startswith("ringattn: rank 1 of the ring refused its input")
        assert said[0][f"{case} seconds"] < 10, said[0]
    assert said[0]["after"] == said[1]["after"] == (1, 8, 2, 4)


def _one_rank_names_no_layout(rank: int, world: int) -> str:
    from ringattn import ring_attention

    q = torch.randn(1, 8, 2, 4)
    kw = {"layout": "contiguous"} if rank == 0 else {}
    try:
        ring_attention(q, q, q, causal=True, **kw)
        return "ran"
    except ValueError as err:
        return str(err)


def test_a_layout_left_out_on_one_rank_is_a_disagreement_on_every_rank(monkeypatch):
    """(second reading) layout= required, checked after the agreement: rank 1 leaving it out
    beside rank 0 naming 'contiguous' agreed (both read as contiguous), then rank 1 alone
    raised and rank 0 waited in the ring. The layout as given travels in the agreement."""
    monkeypatch.setenv("RINGCTL_TEST_GROUP_TIMEOUT", "20")
    said = run_distributed(_one_rank_names_no_layout, 2)
    for text in said:
        assert text.startswith("ranks disagree on ring_attention inputs"), said
        assert "layout=(not given)" in text and "layout=contiguous" in text, said
