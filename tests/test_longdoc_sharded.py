"""FSDP2-sharded weights (``model.shard``) give what the unsharded model gives.

Four real gloo processes (one spawn, tests/sharded_ranks.py) run the tiny seeded Llama, untied
and tied (its head is its token embedding), through ``run_task_sharded``: shard=ring over a ring
of 4 (P = 4), shard=ring over two rings of 2 running different documents (P = 2), shard=job
(P = 4) with rings of 2 running documents of different lengths and an empty one. Each is
compared with (a) the same ``run_task`` on an unsharded copy over the same ring and (b) the
stock one-process reference (tests/longdoc_reference.py).

Tolerances (float32). (a) FSDP changes where the weights live, not the arithmetic: each layer
runs on the same gathered tensors, so log-probs and hidden states come out bit-identical
(measured: 0.0); gradients are summed by a reduce-scatter instead of an all-reduce, a different
order of the same P terms (<= a few ulps): 1e-5 everywhere. (b) as
tests/test_longdoc_equivalence.py: 1e-5 on log-probs and hidden states, 1e-4 on gradients
(the ring's other summation order; see there). A lost shard, a wrong row offset or a gradient
averaged instead of summed moves these by 1e-2 or more (a mean over P halves a gradient).

Loading: a checkpoint saved with ``save_pretrained(max_shard_size=...)`` (several
``model-0000x-of-0000y.safetensors`` and an index), one saved as one file, and a tied model whose
MLP rows (130) do not divide by P = 4 (FSDP's uneven last shard) load sharded into exactly the
weights ``from_pretrained`` loads whole (torch.equal), each rank holding 1/P of the bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.longdoc_reference import document, reference, rel_err, unshard
from tests.sharded_ranks import KINDS, LENGTHS, build_model

TOL = 1e-5
GRAD_TOL = 1e-4
SAME_TOL = 1e-5


def _save_checkpoints(root) -> dict[str, str]:
    paths = {}
    model = build_model("llama", "eager")
    paths["multi"] = str(root / "multi")
    model.save_pretrained(paths["multi"], max_shard_size="100KB")
    paths["single"] = str(root / "single")
    model.save_pretrained(paths["single"])
    tied = build_model("llama-tied", "eager", intermediate_size=130)
    paths["tied-uneven"] = str(root / "tied-uneven")
    tied.save_pretrained(paths["tied-uneven"], max_shard_size="100KB")
    return paths


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return _save_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def results(checkpoints) -> list[dict]:
    from tests.sharded_ranks import all_cases

    return run_distributed(all_cases, 4, checkpoints)


@pytest.fixture(scope="module")
def references() -> dict:
    refs = {}
    for kind in KINDS:
        model = build_model(kind, "eager")
        for n in LENGTHS + (5,):
            if n:
                refs[kind, n] = reference(model, document(n))
    return refs


def _same(sharded: dict, unsharded: dict, where: str) -> None:
    """(a): one rank's sharded outputs against its unsharded run over the same ring."""
    for name, want in unsharded["tensors"].items():
        got = sharded["tensors"][name]
        assert got.shape == want.shape, f"{where} {name}"
        assert rel_err(got.nan_to_num(), want.nan_to_num()) <= SAME_TOL, f"{where} {name}"
    for key in ("n_scored", "log_likelihood", "loss", "grad_norm"):
        if key in unsharded["stats"]:
            want = unsharded["stats"][key]
            got = sharded["stats"][key]
            assert got == pytest.approx(want, rel=SAME_TOL, abs=1e-12), f"{where} {key}"
    if unsharded["grads"] is not None:
        assert set(sharded["grads"]) == set(unsharded["grads"]), where
        for name, want in unsharded["grads"].items():
            assert rel_err(sharded["grads"][name], want) <= SAME_TOL, f"{where} grad {name}"
        norms = sharded["stats"]["grad_norms"]
        for key, want in unsharded["stats"]["grad_norms"].items():
            assert norms[key] == pytest.approx(want, rel=SAME_TOL, abs=1e-12), f"{where} {key}"


def _against_reference(ring: list[dict], ref: dict, n: int, task: str, where: str) -> None:
    """(b): a ring's sharded outputs, put together, against the one-process stock model."""
    if task in ("score", "grad"):
        lp = unshard([r["tensors"] for r in ring], "token_logprob", n)
        assert lp[-1].isnan() and rel_err(lp[:-1], ref["token_logprob"]) < TOL, where
    if task == "embed":
        hidden = unshard([r["tensors"] for r in ring], "hidden", n)
        assert rel_err(hidden, ref["hidden"]) < TOL, where
        assert rel_err(ring[0]["tensors"]["pooled"], ref["hidden"].mean(0)) < TOL, where
    if task == "grad" and n >= 2:
        for r in ring:
            assert r["stats"]["loss"] == pytest.approx(ref["loss"].item(), rel=TOL), where
            for name, g in ref["grads"].items():
                assert rel_err(r["grads"][name], g) < GRAD_TOL, f"{where} grad {name}"


def _check_case(case: list[dict], ring_size: int, kind: str, refs: dict, label: str) -> None:
    rings = [case[i : i + ring_size] for i in range(0, len(case), ring_size)]
    for ring in rings:
        for key in ring[0]["sharded"]:
            n, task = key
            where = f"{label} {kind} N={n} {task}"
            for r in ring:
                _same(r["sharded"][key], r["unsharded"][key], where)
            if n:
                _against_reference([r["sharded"][key] for r in ring], refs[kind, n], n, task, where)
            else:
                assert all(r["sharded"][key]["tensors"]["positions"].numel() == 0 for r in ring)


def _check_memory(case: list[dict], label: str) -> None:
    """Each rank holds 1/P of the weights at rest, one layer gathered at a time, none after."""
    p = case[0]["shard_size"]
    full = case[0]["full_bytes"]
    group = case[:p]
    assert sum(r["local_bytes"] for r in group) == full, label
    assert max(r["local_bytes"] for r in case) <= full / p * 1.01, label
    assert all(r["gathered_during_forward"] == [1] for r in case), label
    # beside the shards only the running layer (and a tied head-embedding, the norm) is gathered
    got = [(r["gathered_bytes_during_forward"], r["one_layer_bytes"]) for r in case]
    assert all(g == [want] for g, want in got), f"{label}: {got}"
    assert all(r["gathered_after"] == 0 for r in case), label
    assert all(r["gathered_bytes_after"] == 0 for r in case), label  # head and root freed too
    assert all(r["grads_left"] == [] for r in case), label  # no autograd state kept
    for r in case:
        sharded, plain = r["fingerprints"]
        assert sharded == pytest.approx(plain, rel=1e-12), label


@pytest.mark.parametrize("kind", KINDS)
def test_shard_ring_of_4(results, references, kind) -> None:
    case = [r["ring4"][kind] for r in results]
    assert case[0]["shard_size"] == 4
    _check_case(case, 4, kind, references, "shard=ring P=4")
    _check_memory(case, f"shard=ring P=4 {kind}")


def test_shard_rings_of_2(results, references) -> None:
    case = [r["ring2"] for r in results]
    assert case[0]["shard_size"] == 2
    _check_case(case, 2, "llama", references, "shard=ring P=2")
    _check_memory(case, "shard=ring P=2")
    assert case[0]["local_bytes"] == 2 * results[0]["ring4"]["llama"]["local_bytes"]


def test_shard_job_with_rings_of_2(results, references) -> None:
    case = [r["job"] for r in results]
    assert case[0]["shard_size"] == 4
    assert set(case[0]["sharded"]) == {(37, "score"), (37, "embed"), (0, "score"), (0, "embed")}
    assert set(case[2]["sharded"]) == {(150, "score"), (150, "embed"), (5, "score"), (5, "embed")}
    _check_case(case, 2, "llama", references, "shard=job P=4")
    _check_memory(case, "shard=job P=4")


def test_shard_job_refuses_grad(results) -> None:
    for r in results:
        assert "model.shard=job cannot run mode=grad" in r["job_grad"]


def test_probe_reference_forward_on_sharded_model(results) -> None:
    """probe.stock_logprobs (the whole model's forward) works sharded when every rank runs it."""
    for r in results:
        assert r["probe_stock"]["err"] <= 1e-6 and r["probe_stock"]["after"] == 0


def test_sharded_loading_equals_whole_loading(results, checkpoints) -> None:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    multi = sorted(p.name for p in Path(checkpoints["multi"]).glob("*.safetensors"))
    assert len(multi) >= 3 and multi[0].startswith("model-00001-of-"), multi
    for name, path in checkpoints.items():
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        want = dict(whole.named_parameters())
        full_bytes = sum(p.numel() * p.element_size() for p in want.values())
        for r in results:
            got = r["loading"][name]
            assert set(got["whole"]) == set(want), name
            for pname, p in want.items():
                assert torch.equal(got["whole"][pname], p.detach()), f"{name} {pname}"
            for bname, b in whole.named_buffers():
                assert torch.allclose(got["buffers"][bname], b), f"{name} buffer {bname}"
            assert got["local_bytes"] <= full_bytes / 4 * 1.05, name
        assert sum(r["loading"][name]["local_bytes"] for r in results) == full_bytes, name
    for rank, r in enumerate(results):  # the loaded model scores as the built one
        for name in ("multi", "single"):
            got = r["loading"][name]["score"]
            want = r["ring4"]["llama"]["unsharded"][37, "score"]
            _same(got, want, f"loaded {name} rank {rank}")


def test_refusals_name_the_key_and_file(checkpoints, tmp_path) -> None:
    import json
    import shutil

    from ringctl.longdoc.compute import fsdp as sharding

    with pytest.raises(ValueError, match="model.shard must be one of none, ring, job"):
        sharding.check_mode("weights")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json"):
        sharding.checkpoint_files(tmp_path)
    bad = tmp_path / "escape"
    shutil.copytree(checkpoints["multi"], bad)
    index = json.loads((bad / sharding.INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (bad / sharding.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map\['lm_head.weight'\].*is not a file here"):
        sharding.checkpoint_files(bad)
    del index["weight_map"]["lm_head.weight"]
    (bad / sharding.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="the checkpoint has no tensor 'lm_head.weight'"):
        sharding.load_local_shards(build_model("llama", "eager"), bad)
