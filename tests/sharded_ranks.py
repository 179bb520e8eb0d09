"""What each rank runs in tests/test_longdoc_sharded.py (spawned processes import this; no tests).

One spawn of 4 gloo ranks runs every case, to pay the start-up (torch + transformers) once:

* ``ring4``: ``model.shard=ring`` over a ring of all 4 ranks (P = 4);
* ``ring2``: two rings of 2 (``ringctl.rings.RingGroups``), each sharding over its own ring
  (P = 2), the rings running *different* documents at the same time;
* ``job``: ``model.shard=job`` (P = 4) with rings of 2 inside, the rings running documents of
  different lengths (another number of head chunks) and an empty one (``idle_step``);
* loading a saved checkpoint (several safetensors shards, and one file) sharded, P = 4.

Every case returns the per-rank outputs; the unsharded side runs the same ``run_task`` on an
unsharded copy over the same ring, and the test also compares with the one-process stock
reference (tests/longdoc_reference.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.longdoc_reference import MODEL_CONFIGS, SEED, document

LENGTHS = (0, 1, 37, 150)
CHUNK = 16
KINDS = ("llama", "llama-tied")


def model_config(kind: str, **extra):
    from transformers import AutoConfig

    fields = dict(MODEL_CONFIGS["llama"])
    if kind == "llama-tied":
        fields["tie_word_embeddings"] = True
    fields.update(extra)
    return AutoConfig.for_model(**fields)


def build_model(kind: str, attn_implementation: str = "ringattn", **extra):
    """The tiny seeded Llama (``llama-tied``: its head is its token embedding)."""
    from ringctl.longdoc.model.load import build_random

    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    config = model_config(kind, **extra)
    model = build_random(
        config, seed=SEED, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _outputs(result) -> dict:
    return {"tensors": result.tensors, "stats": result.stats, "grads": result.grads}


def _gathered_watch(model) -> tuple[list[int], list[int]]:
    """At each decoder layer's forward: how many layers, and how many bytes, are gathered."""
    from ringctl.longdoc.compute.fsdp import gathered_layers, gathered_parameter_bytes

    layers: list[int] = []
    nbytes: list[int] = []

    def watch(*_):
        layers.append(gathered_layers(model))
        nbytes.append(gathered_parameter_bytes(model))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(watch)
    return layers, nbytes


def _run_docs(model, docs, tasks, *, group, sharded: bool) -> dict:
    from ringctl.longdoc.compute.fsdp import run_task_sharded
    from ringctl.longdoc.compute.scoring import run_task

    out = {}
    for n in docs:
        for task in tasks:
            kw = dict(group=group, layout="zigzag", chunk_size=CHUNK)
            if sharded:
                r = run_task_sharded(task, model, document(n), gather_grads=True, **kw)
            else:
                r = run_task(task, model, document(n), keep_grads=True, **kw)
            out[n, task] = _outputs(r)
    return out


def _ring_case(kind: str, mode: str, ring_size: int, docs, tasks, rank: int, world: int):
    from ringctl.longdoc.compute import fsdp as sharding
    from ringctl.rings import RingGroups

    group = RingGroups.create(world, rank, [ring_size]).group(ring_size)
    plain = build_model(kind)
    unsharded = _run_docs(plain, docs, tasks, group=group, sharded=False)
    full_bytes = sharding.local_parameter_bytes(plain)
    model = build_model(kind)
    sharding.shard_model(model, mode=mode, mesh_or_group=group if mode == "ring" else None)
    seen, seen_bytes = _gathered_watch(model)
    layer_bytes = sum(p.numel() * p.element_size() for p in plain.model.layers[0].parameters())
    # tied: the head-embedding group and the root (the final norm) stay gathered all along
    tied = (plain.model.embed_tokens.weight.numel() + plain.model.norm.weight.numel()) * 4
    tied_bytes = tied if kind == "llama-tied" else 0
    sharded = _run_docs(model, docs, tasks, group=group, sharded=True)
    return {
        "unsharded": unsharded,
        "sharded": sharded,
        "full_bytes": full_bytes,
        "local_bytes": sharding.local_parameter_bytes(model),
        "gathered_during_forward": sorted(set(seen)),
        "gathered_bytes_during_forward": sorted(set(seen_bytes)),
        "one_layer_bytes": layer_bytes + tied_bytes,
        "gathered_after": sharding.gathered_layers(model),
        "gathered_bytes_after": sharding.gathered_parameter_bytes(model),
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
        "shard_size": sharding.shard_info(model).size,
        "fingerprints": (
            sharding.weights_fingerprint(model).tolist(),
            sharding.weights_fingerprint(plain).tolist(),
        ),
    }


def _job_grad_refusal(rank: int, world: int) -> str:
    from ringctl.longdoc.compute import fsdp as sharding
    from ringctl.rings import RingGroups

    group = RingGroups.create(world, rank, [2]).group(2)
    model = sharding.shard_model(build_model("llama"), mode="job")
    try:
        sharding.run_task_sharded("grad", model, document(5), group=group, layout="zigzag")
    except ValueError as err:
        return str(err)
    return "accepted"


def _probe_stock_forward(rank: int, world: int) -> dict:
    """The probe's reference (the model's own forward, stock attention) on a sharded model.

    Every rank of the shard group must run it (each forward gathers the layers from all of
    them); the result must be the unsharded model's.
    """
    from ringctl.longdoc.compute import fsdp as sharding
    from ringctl.longdoc.probe import stock_logprobs

    ids = document(40)
    plain = build_model("llama")
    want = stock_logprobs(plain, ids, "sdpa")
    model = sharding.shard_model(build_model("llama"), mode="ring")
    got = stock_logprobs(model, ids, "sdpa")
    sharding.release(model)
    return {
        "err": float((got - want).abs().max()),
        "after": sharding.gathered_parameter_bytes(model),
    }


def _loading_case(ckpt: dict[str, str], rank: int, world: int) -> dict:
    """Each checkpoint loaded sharded (P = world): local rows, bytes read, whole weights."""
    import resource

    from ringctl.longdoc.compute import fsdp as sharding

    out = {}
    for name, path in ckpt.items():
        model = sharding.load_sharded_model(path, mode="ring", mesh_or_group=None)
        whole = {}
        for pname, p in model.named_parameters():
            whole[pname] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        buffers = {bname: b.clone() for bname, b in model.named_buffers()}
        out[name] = {
            "whole": whole,
            "buffers": buffers,
            "local_bytes": sharding.local_parameter_bytes(model),
            "score": _outputs(
                sharding.run_task_sharded(
                    "score", model, document(37), group=None, layout="zigzag", chunk_size=CHUNK
                )
            ),
        }
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def all_cases(rank: int, world: int, ckpt: dict[str, str]) -> dict:
    """Every case of tests/test_longdoc_sharded.py, on this rank of ``world`` = 4."""
    assert world == 4 and dist.get_world_size() == 4
    tasks = ("score", "embed", "grad")
    ring_index = rank // 2
    mine = LENGTHS if ring_index == 0 else tuple(reversed(LENGTHS))  # rings run other docs
    job_docs = (37, 0) if ring_index == 0 else (150, 5)
    return {
        "ring4": {kind: _ring_case(kind, "ring", 4, LENGTHS, tasks, rank, world) for kind in KINDS},
        "ring2": _ring_case("llama", "ring", 2, mine, tasks, rank, world),
        "job": _ring_case("llama", "job", 2, job_docs, ("score", "embed"), rank, world),
        "job_grad": _job_grad_refusal(rank, world),
        "probe_stock": _probe_stock_forward(rank, world),
        "loading": _loading_case(ckpt, rank, world),
    }
