"""Weights sharded with FSDP2 (``model.shard``): each rank holds 1/P of the long-document model.

``model.shard``:

``none``
    Every rank holds all weights (today's behaviour); nothing here is used.
``ring``
    The weights are sharded over the ranks of the rank's ring (a 1-D ``DeviceMesh`` of the ring's
    process group, dim ``"ring"``): P = ring size. Rings are independent; each ring gathers and
    reduces only among its own ranks, so the rings of a job may run different documents.
``job``
    The weights are sharded over all W ranks of the job (a 1-D mesh over the whole job, dim
    ``"job"``), while ring attention runs inside each ring of N consecutive ranks: P = W.
    Facts that decide the design (torch 2.13 ``fully_shard`` docstring): a 2-D mesh given to
    ``fully_shard`` means HSDP, parameters ``(Replicate(), Shard(0))`` - sharded over dim 1 only
    and gradients all-reduced over dim 0. A (W/N rings, N) mesh would therefore hold 1/N of the
    weights (no better than ``ring``) and sum the gradients of the different documents the rings
    run at once. "Over the whole job" needs the shard dim to span all W ranks: a 1-D mesh of W.
    Consequences, refused or required by name: every rank of the job must gather the same
    layers in the same order (one document per ring per round; a ring without one runs
    ``idle_step``: run.py's ``_Lockstep``); ``grad`` is refused (a reduce-scatter over the
    job would sum the gradients of W/N different documents).

How the model is cut (``shard_model``): ``fully_shard`` on every decoder layer (gathered before
the layer runs, freed after it: ``reshard_after_forward``), then one group for the output head
and the final norm (``fully_shard([norm, lm_head])``, the chunked-loss case the torch docs name:
the head runs once per ``chunk_size`` positions outside the decoder's forward; it stays gathered
for the document instead of being re-gathered per chunk), the token embedding on its own
(gathered for its one call, freed before the first layer), then the decoder itself as the root
(whatever is left: rotary buffers, extra norms). So at most one of: the embedding, one layer,
the norm and head is gathered at a time, beside the shards. A tied head (``lm_head.weight is
embed_tokens.weight``) is grouped with the token embedding instead (``fully_shard([embed_tokens,
lm_head])``, gathered for the whole document): FSDP keeps a shared parameter shared only among
the modules of one ``fully_shard`` call.

FSDP2's default gradient reduction is a mean over the shard ranks; the long-document loss is a
*sum* over ranks of each rank's part (``-ll_local / n_scored``), so the divide factor is set to
1: the reduce-scatter sums, as ``scoring._backward``'s all-reduce does. A divide factor is done
with NCCL's PREMUL_SUM, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so
``set_force_sum_reduction_for_comms(True)`` keeps the collective a plain SUM.

After a document, ``release`` frees what is still gathered (the head group and the root are kept
gathered after forward; in ``score``/``embed`` no backward comes to free them) through
``reset_iter_state`` on the root, the one public call that reshards every group of the model.

Loading (``load_sharded_model``) from a local Hugging Face directory: the model is built with its
parameters on the meta device (buffers such as RoPE frequencies are real: they are computed, not
loaded), sharded, given empty local shards, and each parameter's local rows are read with
``safetensors.safe_open(...).get_slice(name)[start:stop]`` from the file the index
(``model.safetensors.index.json``) names, or from ``model.safetensors``: no rank holds the whole
model at any time. FSDP2 cuts dim 0 as ``torch.chunk`` does: rank r of P holds rows
``[r * ceil(R / P), min(R, (r + 1) * ceil(R / P)))``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model.directory import INDEX_FILE, SINGLE_FILE, check_model_directory
from . import SHARD_MODES


@dataclass(frozen=True)
class ShardInfo:
    """What ``shard_model`` did: the mode, its mesh, and the FSDP root (the decoder)."""

    mode: str
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, 1-D
    root: nn.Module
    # (one module of each group, freed after its forward?) in the order a forward gathers them
    gather_order: tuple[tuple[nn.Module, bool], ...] = ()

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()


def shard_info(model) -> ShardInfo | None:
    """The model's sharding, or None when its weights are not sharded."""
    return getattr(model, "_ringctl_shard", None)


def is_sharded(model) -> bool:
    return shard_info(model) is not None


def check_mode(mode: str) -> str:
    if mode not in SHARD_MODES:
        raise ValueError(f"model.shard must be one of {', '.join(SHARD_MODES)}, not {mode!r}")
    return mode


def _device_type(group) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def shard_mesh(mode: str, mesh_or_group=None):
    """The 1-D DeviceMesh FSDP shards over (see the module docstring); None for ``none``.

    ``ring``: ``mesh_or_group`` is the ring's process group (None: the default group) or a 1-D
    mesh. ``job``: the whole job's ranks (``mesh_or_group`` None, the default group, or a 1-D
    mesh over it); a 2-D mesh is refused, because ``fully_shard`` would make it HSDP.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if check_mode(mode) == "none":
        return None
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(
                f"model.shard={mode}: a {mesh_or_group.ndim}-D mesh would make fully_shard "
                "replicate over dim 0 (HSDP); give the 1-D mesh of the ranks to shard over"
            )
        return mesh_or_group
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    if mode == "job" and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError("model.shard=job shards over the whole job: give the default group")
    return DeviceMesh.from_group(group, _device_type(group), mesh_dim_names=(mode,))


def _parts(model) -> tuple[nn.Module, list[nn.Module], nn.Module | None, nn.Module]:
    """(decoder, its layers, its final norm or None, the output head) of a causal LM."""
    from ..model.load import decoder

    base = decoder(model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"{model.config.model_type}: no decoder layers under {type(base).__name__}.layers: "
            "model.shard is not supported for this model"
        )
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{model.config.model_type}: no output embeddings: cannot shard")
    return base, list(layers), getattr(base, "norm", None), head


def _tied(base: nn.Module, head: nn.Module) -> bool:
    head_ids = {id(p) for p in head.parameters()}
    return any(id(p) in head_ids for p in base.parameters())


def shard_model(model, *, mode: str, mesh_or_group=None, reshard_after_forward: bool = True):
    """Shard ``model`` in place with FSDP2 (see the module docstring); returns it.

    ``reshard_after_forward`` applies to the decoder layers (True: one layer's weights gathered
    at a time; False keeps each gathered after its forward: faster backward, no memory saved).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = shard_mesh(mode, mesh_or_group)
    if mesh is None:
        return model
    if is_sharded(model):
        raise ValueError("shard_model: the model is sharded already")
    base, layers, norm, head = _parts(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    embed = model.get_input_embeddings()
    tied = _tied(base, head)
    if tied:
        fully_shard([embed, head], mesh=mesh, reshard_after_forward=False)
    else:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True)  # used once, at the start
        fully_shard(
            [m for m in (norm, head) if m is not None], mesh=mesh, reshard_after_forward=False
        )
    fully_shard(base, mesh=mesh, reshard_after_forward=False)
    order = [(base, False), (embed, not tied)]
    order += [(layer, reshard_after_forward) for layer in layers]
    if not tied:
        order.append((norm if norm is not None else head, False))
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # a sum over ranks, as scoring's all-reduce
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG
    model._ringctl_shard = ShardInfo(mode, mesh, base, tuple(order))
    return model


def _fsdp_modules(model) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def release(model) -> None:
    """Free every gathered weight of a sharded model (after each document; no-op unsharded)."""
    info = shard_info(model)
    if info is None:
        return
    state = info.root._get_fsdp_state()
    if state._is_root is None:  # no forward yet: nothing gathered
        return
    info.root.reset_iter_state()


def gathered_layers(model) -> int:
    """How many decoder layers hold their gathered (plain tensor) weights right now."""
    from torch.distributed.tensor import DTensor

    _, layers, _, _ = _parts(model)
    return sum(
        any(not isinstance(p, DTensor) for p in layer.parameters(recurse=True)) for layer in layers
    )


def gathered_parameter_bytes(model) -> int:
    """Bytes of gathered (unsharded) weights registered right now: 0 between documents."""
    from torch.distributed.tensor import DTensor

    return sum(
        p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor)
    )


def local_parameter_bytes(model) -> int:
    """Bytes of the weights this rank holds at rest (its shards; everything when unsharded)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def shard_summary(model) -> str:
    """One line for the log: what this rank holds of a sharded model ("" unsharded)."""
    info = shard_info(model)
    if info is None:
        return ""
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes
    mine = local_parameter_bytes(model)
    return (
        f"model.shard={info.mode}: weights sharded over {info.size} ranks; this rank holds "
        f"{mine / 2**20:.2f} of {whole / 2**20:.2f} MiB"
    )


def idle_step(model) -> None:
    """Take part in one document's gathers without a document (``model.shard=job`` only).

    With the weights sharded over the whole job, every rank must all-gather the same groups in
    the same order. A ring that has no document this round (or an empty one, which runs no model)
    calls this: every group in the order a forward gathers them (``ShardInfo.gather_order``).
    """
    info = shard_info(model)
    if info is None or info.mode != "job":
        return
    with torch.no_grad():
        for module, free_after in info.gather_order:
            module.unshard()
            if free_after:
                module.reshard()
    release(model)


def weights_fingerprint(model) -> torch.Tensor:
    """(sum, sum of squares) of all weights in float64, over the whole (sharded) model.

    Collective over the shard group; equal on every rank that holds the same weights, so
    ``model.check_same_weights``'s comparison works on it across rings.
    """
    from torch.distributed.tensor import DTensor

    info = shard_info(model)
    s = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            x = (p.to_local() if isinstance(p, DTensor) else p).detach().double().cpu()
            s[0] += x.sum()
            s[1] += (x * x).sum()
    if info is not None and info.size > 1:
        s = s.to(_comm(info))
        dist.all_reduce(s, group=info.group)
    return s.cpu()


def _comm(info: ShardInfo) -> torch.device:
    from .scoring import comm_device

    return comm_device(info.group)


# -- gradients ----------------------------------------------------------------------------------


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (collective over the shard group: all ranks call it)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            out[name] = torch.zeros(p.shape, dtype=p.dtype)
        elif isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor().detach()
        else:
            out[name] = p.grad.detach().clone()
    return out


def sharded_grad_norms(model) -> dict[str, float]:
    """L2 norm per ``scoring.param_group`` from the gradient shards (one all-reduce)."""
    from torch.distributed.tensor import DTensor

    from .scoring import param_group

    info = shard_info(model)
    keys: list[str] = []
    sums: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        key = param_group(name)
        if key not in keys:
            keys.append(key)
            sums.append(torch.zeros((), dtype=torch.float64))
        g = p.grad
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            sums[keys.index(key)] += local.detach().double().pow(2).sum().cpu()
    total = torch.stack(sums)
    if info is not None and info.size > 1:
        total = total.to(_comm(info))
        dist.all_reduce(total, group=info.group)
    return {k: math.sqrt(float(v)) for k, v in zip(keys, total.cpu().tolist(), strict=True)}


# -- one document -------------------------------------------------------------------------------


def run_task_sharded(
    task: str,
    model,
    ids: torch.Tensor,
    *,
    group,
    layout: str,
    chunk_size: int = 4096,
    gather_grads: bool = False,
):
    """``scoring.run_task`` for a sharded model (its result type and contract).

    ``score`` / ``embed``: run_task itself (FSDP gathers layer by layer inside it), then
    ``release``. ``grad``: the same forward, FSDP's reduce-scatter (a sum) instead of
    run_task's all-reduce, norms from the shards; ``gather_grads`` (the same value on every
    rank: it is a collective) returns the whole gradients. ``group`` is the ring.
    """
    from .scoring import run_task

    info = shard_info(model)
    if info is None:
        return run_task(
            task,
            model,
            ids,
            group=group,
            layout=layout,
            chunk_size=chunk_size,
            keep_grads=gather_grads,
        )
    if task == "grad" and info.mode == "job":
        raise ValueError(
            "model.shard=job cannot run mode=grad: FSDP's reduce-scatter over the whole job "
            "would sum the gradients of the different documents the rings run at once; use "
            "model.shard=ring"
        )
    try:
        if task != "grad":
            result = run_task(task, model, ids, group=group, layout=layout, chunk_size=chunk_size)
            if int(ids.numel()) == 0:
                idle_step(model)
            return result
        return _grad_task(
            model, ids, group=group, layout=layout, chunk_size=chunk_size, gather=gather_grads
        )
    finally:
        release(model)


def _grad_task(model, ids, *, group, layout: str, chunk_size: int, gather: bool):
    from .scoring import (
        ShardResult,
        all_sum,
        make_shard,
        score_shard,
        score_stats,
        window_refusal,
    )

    start = time.perf_counter()
    ids = ids.to(torch.int64).flatten()
    n = int(ids.numel())
    too_long = window_refusal(model.config, n)
    if too_long:
        raise ValueError(too_long)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = make_shard(ids, rank=rank, world_size=world, layout=layout)
    tensors = {
        "positions": shard.positions[shard.real].clone(),
        "input_ids": shard.ids[shard.real].clone(),
    }
    lp, ll_local = score_shard(
        model, shard, group=group, layout=layout, chunk_size=chunk_size, grad=True
    )
    (ll,) = all_sum([float(ll_local.detach())], group)
    tensors["token_logprob"] = lp.detach().float().contiguous()
    n_scored = max(n - 1, 0)
    stats: dict[str, Any] = {"n_tokens": n, **score_stats(ll, n_scored)}
    model.zero_grad(set_to_none=True)
    if n_scored > 0:
        (-ll_local / n_scored).backward()
    norms = sharded_grad_norms(model)
    stats["loss"] = -ll / n_scored if n_scored else None
    stats["grad_norms"] = norms
    stats["grad_norm"] = math.sqrt(sum(v * v for v in norms.values()))
    grads = {k: v.cpu() for k, v in full_gradients(model).items()} if gather else None
    model.zero_grad(set_to_none=True)
    return ShardResult(tensors, stats, time.perf_counter() - start, grads)


# -- loading ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside: every registered parameter is created on the meta device, buffers are not.

    Buffers (RoPE's inv_freq and the like) are computed in ``__init__``, not loaded, and are
    small: they stay real. Parameters take no memory until their shards are allocated.
    """
    original = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def checkpoint_files(path: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a model directory (index.json or one file), the
    directory checked first (``directory.check_model_directory``: nothing read from
    elsewhere through a link)."""
    check_model_directory(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: no readable weight_map ({err})") from None
        files = {}
        for name, file in weight_map.items():
            target = (path / str(file)).resolve()
            if target.parent != path.resolve() or not target.is_file():
                raise ValueError(f"{index}: weight_map[{name!r}] = {file!r} is not a file here")
            files[name] = target
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE}: sharded loading reads safetensors"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _local_rows(param) -> tuple[int, int]:
    """(start, stop) of the dim-0 rows of ``param`` (a Shard(0) DTensor) that this rank holds."""
    rows = int(param.shape[0])
    mesh = param.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    step = -(-rows // size)
    start = min(rows, rank * step)
    stop = min(rows, start + step)
    if param.to_local().shape[0] != stop - start:
        raise RuntimeError(
            f"sharded loading: rows {start}:{stop} of {tuple(param.shape)} expected on rank "
            f"{rank} of {size}, FSDP holds {param.to_local().shape[0]}: not supported"
        )
    return start, stop


def load_local_shards(model, path: str | Path) -> int:
    """Read each parameter's local rows from the model directory's safetensors; bytes read.

    Buffers the checkpoint holds are read whole (small); the others keep their computed value.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    path = Path(path)
    files = checkpoint_files(path)
    wanted: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if name not in files:
            raise ValueError(
                f"{path}: the checkpoint has no tensor {name!r} (sharded loading needs the "
                "checkpoint's names to be the model's parameter names)"
            )
        wanted.setdefault(files[name], []).append((name, p))
    for name, b in model.named_buffers():
        if name in files:
            wanted.setdefault(files[name], []).append((name, b))
    read = 0
    with torch.no_grad():
        for file, params in wanted.items():
            with safe_open(str(file), framework="pt") as f:
                for name, p in params:
                    piece = f.get_slice(name)
                    if list(piece.get_shape()) != list(p.shape):
                        raise ValueError(
                            f"{file}: {name} has shape {piece.get_shape()}, the model "
                            f"{list(p.shape)}"
                        )
                    if isinstance(p, DTensor):
                        start, stop = _local_rows(p)
                        target = p.to_local()
                        data = piece[start:stop]
                    else:
                        target, data = p, piece[:]
                    target.copy_(data.to(target.dtype))
                    read += data.numel() * data.element_size()
    return read


def load_sharded_model(
    model_path,
    *,
    mode: str,
    mesh_or_group=None,
    dtype: str = "float32",
    attn_implementation: str = "ringattn",
    device=None,
    overrides: dict | None = None,
    reshard_after_forward: bool = True,
):
    """``model.load_model`` with the weights sharded (``mode`` ring or job), in eval mode.

    A model directory: built on meta, sharded, each rank reading its rows only. A ``.json``
    config or None (random weights): built whole on the host CPU with the seed (as every rank
    does unsharded), then sharded; the device only ever holds the shards.
    """
    from ..model.load import builds_random, load_model, model_directory, torch_dtype

    if check_mode(mode) == "none":
        raise ValueError("load_sharded_model: model.shard=none: use model.load_model")
    if builds_random(model_path):
        model = load_model(
            model_path, dtype=dtype, attn_implementation=attn_implementation, overrides=overrides
        )
        shard_model(
            model,
            mode=mode,
            mesh_or_group=mesh_or_group,
            reshard_after_forward=reshard_after_forward,
        )
        if device is not None:
            model.to(device)
        return model
    path = model_directory(model_path)  # a .gguf file: its cached conversion
    if not path.is_dir():
        raise FileNotFoundError(f"model_path {str(model_path)!r} is not a local directory")
    model = _meta_model(path, torch_dtype(dtype), attn_implementation, overrides)
    shard_model(
        model, mode=mode, mesh_or_group=mesh_or_group, reshard_after_forward=reshard_after_forward
    )
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    target = device if device is not None else torch.device(_device_type(shard_info(model).group))
    model.to_empty(device=target)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    load_local_shards(model, path)
    model.eval()
    return model


def _meta_model(path: Path, dtype: torch.dtype, attn_implementation: str, overrides):
    from transformers import AutoModelForCausalLM

    from ..model.load import load_config

    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    config, _ = load_config(path, overrides)  # overrides checked, set on the loaded config
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )
    return model
