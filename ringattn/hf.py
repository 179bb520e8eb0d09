"""Ring attention as a Hugging Face ``transformers`` attention implementation.

    from ringattn.hf import register, ring_settings
    register()                                   # name "ringattn"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ringattn")
    # every rank feeds its shard, with the GLOBAL positions of that shard:
    with ring_settings(group=group, layout="zigzag", seq_len=n_tokens, model=model):
        out = model(input_ids=shard_ids, position_ids=shard_positions, use_cache=False)

The ring's settings reach every attention call in one of two ways: ``ring_settings(...)`` (a
context manager: it works even for models that do not pass ``model(...)`` keyword arguments
down to their attention layers, such as StableLM and Nemotron), or the keyword arguments
``ring_group`` / ``ring_layout`` / ``ring_seq_len`` given to ``model(...)`` (they win when
both are there). ``group`` is a ``torch.distributed`` process group (default: the default
group); ``layout`` is ``"contiguous"`` or ``"zigzag"``, as in ``ringattn.shard_sequence``, and
must be given whenever the group has more than one rank (a wrong layout gives wrong numbers
silently); ``seq_len`` is the document's real (unpadded) global length.

``cu_seqlens`` (``ring_settings(cu_seqlens=...)`` or ``ring_cu_seqlens=``): packed documents,
as ``ring_attention``'s (pass ``ringattn.pack_sequence``'s layout, built with the window the
model balances for, and the same to ``shard_sequence``), with each row's position within its
own document as ``position_ids`` (``ringattn.document_positions``). A model whose RoPE depends
on the sequence's length is refused there: a pack's documents would share one scaling.

``seq_len`` with ``model`` also makes RoPE whose frequencies depend on the sequence length
(``dynamic`` NTK scaling, Phi-3's ``longrope``) use the document's global length on every rank:
transformers picks the scaling from the largest position it sees, which on a ring is each
rank's own largest position, not the document's length.

Attention is always causal (these are causal LMs) and over one unpadded document per batch row.
What cannot be honoured is refused with a ValueError instead of being dropped silently:

* a 2D padding ``attention_mask`` with a zero in it (an all-ones mask is accepted),
* a 4D mask, logit soft-capping, and attention dropout,
* attention sinks (gpt-oss's ``s_aux``) when ``ring_attention`` has no ``sinks=`` parameter.

``count_calls()`` counts the attention calls (and distinct layers, and those that passed a
sliding window) of a forward: a model that computes attention some other way never calls this
function, and a caller that counts can refuse it instead of scoring with per-shard attention.

``transformers`` is imported here only, and only when ``register`` is called: ``import
ringattn`` never pulls it in.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .checks import Shifts, refused_together, shifts_agreed
from .geometry import PAD
from .hybrid import hybrid_rank
from .layouts import HYBRID_LAYOUTS, packed_share, packing_argument
from .ring import ring_attention

DEFAULT_NAME = "ringattn"
# RoPE types whose frequencies transformers recomputes from the largest position it is given.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class RingSettings:
    group: Any = None
    layout: str | None = None
    seq_len: int | None = None  # the document's real global length
    ulysses_group: Any = None  # hybrid layouts: the Ulysses group (``group`` is the ring)
    cu_seqlens: Any = None  # packed documents (ringattn.pack_sequence's layout)


_SETTINGS: contextvars.ContextVar[RingSettings | None] = contextvars.ContextVar(
    "ringattn_hf_settings", default=None
)


@dataclass
class CallCount:
    """Attention calls seen inside one ``count_calls()`` block."""

    calls: int = 0
    layers: set[int] = field(default_factory=set)  # id() of each attention module called
    windowed: set[int] = field(default_factory=set)  # those that passed a sliding window
    on_call: Callable[[CallCount], None] | None = None  # told after each call is counted


_COUNTERS: list[CallCount] = []


@contextlib.contextmanager
def count_calls(on_call: Callable[[CallCount], None] | None = None) -> Iterator[CallCount]:
    """Count the calls of ``ring_attention_forward`` (and the distinct layers) in the block;
    ``on_call(counter)`` after each (a caller's progress within one long forward)."""
    counter = CallCount(on_call=on_call)
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def supports_sinks() -> bool:
    """Whether this ``ring_attention`` merges attention sinks (a ``sinks=`` parameter)."""
    return "sinks" in inspect.signature(ring_attention).parameters


def _setting(kwargs: dict, name: str) -> Any:
    if kwargs.get(f"ring_{name}") is not None:
        return kwargs[f"ring_{name}"]
    settings = _SETTINGS.get()
    return getattr(settings, name) if settings is not None else None


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _window(module, kwargs: dict) -> int | None:
    """The layer's sliding window for ring (or hybrid) attention, counted; None: none."""
    window = kwargs.get("sliding_window")
    if window is None:
        return None
    for counter in _COUNTERS:
        counter.windowed.add(id(module))
    return int(window)


def _sinks(module: torch.nn.Module, kwargs: dict) -> torch.Tensor | None:
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(
            f"ringattn: {type(module).__name__} has attention sinks that it did not pass to "
            "the attention function (s_aux): refused rather than ignored"
        )
    if sinks is not None and not supports_sinks():
        raise ValueError(
            f"ringattn: {type(module).__name__} uses attention sinks (gpt-oss), and this "
            "ringattn's ring_attention has no sinks= parameter: refused rather than ignored"
        )
    return sinks


class AttentionMaskError(ValueError):
    """A mask reached the attention call: ring attention applies only its own causal mask.
    Typed, so that a caller that passed none can say the model built it (ringctl's probe)."""


def _refuse_unsupported(module, attention_mask, dropout, kwargs) -> None:
    if attention_mask is not None:
        raise AttentionMaskError(
            "ringattn: an attention mask reached the attention layer "
            f"(shape {tuple(attention_mask.shape)}); ring attention applies the causal mask "
            "itself over one unpadded document per row and cannot honour a custom or padding "
            "mask: pass attention_mask=None"
        )
    if dropout:
        raise ValueError(
            f"ringattn: attention dropout ({dropout}) is not supported; use model.eval() or "
            "set attention_dropout=0"
        )
    causal = kwargs.get("is_causal")
    if causal is None:  # as transformers' sdpa reads it: the call's, else the module's
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise ValueError(
            f"ringattn: {type(module).__name__} attends both ways (is_causal=False), and ring "
            "attention applies the causal mask: refused rather than run causal"
        )
    if kwargs.get("output_attentions"):  # transformers warns for sdpa; it got [] silently
        raise ValueError(
            "ringattn: output_attentions=True: ring attention never forms the attention "
            "weights (an N x N matrix no rank holds); pass output_attentions=False"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"ringattn: {type(module).__name__} soft-caps its attention logits "
            f"(softcap={kwargs['softcap']}), which ring attention does not implement"
        )


def _refuse_cached_keys(query: torch.Tensor, key: torch.Tensor) -> None:
    """More keys than queries: a KV cache's (generate() with use_cache, past_key_values),
    which ring attention does not hold (it was refused as "q and k/v must agree")."""
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"ringattn: {key.shape[2]} keys for {query.shape[2]} queries reached the attention "
            "layer (a KV cache: past_key_values, or generate() with use_cache=True); ring "
            "attention attends over the sequence it is given: pass use_cache=False"
        )


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer.

    query is (batch, heads, seq_local, head_dim), key/value (batch, kv_heads, seq_local,
    head_dim) with RoPE applied and GQA heads not repeated. Returns (batch, seq_local, heads,
    head_dim) and no attention weights.
    """
    padded = _take_padding_refusal()  # first: never left for a later call, whatever refuses
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    _refuse_cached_keys(query, key)
    group = _setting(kwargs, "group")
    layout = _setting(kwargs, "layout")
    ulysses = _setting(kwargs, "ulysses_group")
    world = _world(group) * (_world(ulysses) if ulysses is not None else 1)
    layout = _layout(module, layout, world)
    window = _window(module, kwargs)
    sinks = _sinks(module, kwargs)
    extra = {} if sinks is None else {"sinks": sinks}
    cu_seqlens = _setting(kwargs, "cu_seqlens")
    refusal, shifts = _packing_refusal(module, kwargs, cu_seqlens, layout, world)
    if padded is not None and world == 1:  # no agreement follows: raised here
        raise padded
    refusal = refusal or padded
    if cu_seqlens is not None:
        extra["cu_seqlens"] = cu_seqlens
    for counter in _COUNTERS:
        counter.calls += 1
        counter.layers.add(id(module))
        if counter.on_call is not None:
            counter.on_call(counter)
    q, k, v = _autocast_inputs(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    if ulysses is not None and layout not in HYBRID_LAYOUTS:
        raise ValueError(
            f"ringattn: a Ulysses group needs a hybrid layout ({', '.join(HYBRID_LAYOUTS)}), "
            f"not {layout!r}"
        )
    # the engine keeps its own precision; the ring's (or the grid's) agreement raises this
    # rank's refusal on every rank and compares the documents' shifts
    with (
        torch.autocast(q.device.type, enabled=False),
        refused_together(refusal),
        shifts_agreed(shifts),
    ):
        if layout in HYBRID_LAYOUTS:
            hybrid = _hybrid(
                module, q, k, v, scaling, layout, ulysses, group, sinks, window, cu_seqlens
            )
            return hybrid, None
        out = ring_attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=scaling,
            group=group,
            layout=layout,
            window=window,
            **extra,
        )
    return out, None


def _layout(module, layout: str | None, world: int) -> str:
    """The layout the input was sharded with: given (ring_settings or ring_layout=), or, for
    one process, contiguous. A ring without one cannot tell its ranks' rows apart."""
    if layout is not None:
        return layout
    if world > 1:
        raise ValueError(
            f"ringattn: no ring layout reached {type(module).__name__}: run the model "
            "inside ringattn.hf.ring_settings(layout=...) or pass ring_layout='zigzag' or "
            "'contiguous' (the layout the input was sharded with) to model(...)"
        )
    return "contiguous"


def _packing_refusal(
    module, kwargs, cu_seqlens, layout, world
) -> tuple[PositionsError | None, Shifts]:
    """``_check_packing``'s refusal of this rank's position_ids, kept for the ring's agreement
    to raise on every rank (``refused_together``: each rank checks its own positions, and a
    refusal on one alone left the others failing on a lost peer), and the shifts of the
    documents at its pieces' ends, for the agreement to compare across ranks
    (``shifts_agreed``). Raised here where no agreement follows: one rank."""
    try:
        shifts = _check_packing(module, kwargs, cu_seqlens)
    except PositionsError as err:
        if world == 1:
            raise
        return err, ()
    return None, shifts


class PositionsError(ValueError):
    """position_ids that disagree with the ring's layout of the documents on this rank."""


# flash-attn's packing keywords, which transformers passes on from a packed batch (e.g. a
# DataCollatorWithFlattening's): ring attention takes the packing from its settings only.
_FLASH_PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _check_packing(module: torch.nn.Module, kwargs: dict, cu_seqlens: Any) -> Shifts:
    """Packed documents reach ring attention one way: ``ring_settings(cu_seqlens=...)`` or
    ``ring_cu_seqlens=``. Each of these attended across documents with no error before:
    flash-attn's packing keywords (ignored); ``position_ids`` that restart within a row with
    no cu_seqlens (the packing transformers infers from them was dropped); rows of a batch
    with different ``position_ids`` under the one cu_seqlens; and RoPE scaled by the
    sequence's length (``ring_settings(model=...)`` refuses it; without ``model`` it passed).
    Returns the position shifts the ring's ranks must agree on (``_position_jump``)."""
    given = [key for key in _FLASH_PACKING if kwargs.get(key) is not None]
    if given:
        raise ValueError(
            f"ringattn: packed-batch keywords ({', '.join(given)}) reached the attention layer; "
            "ring attention ignores them: give the documents' boundaries as "
            "ring_cu_seqlens=... (or ring_settings(cu_seqlens=...))"
        )
    pos = kwargs.get("position_ids")
    shifts: Shifts = ()
    if isinstance(pos, torch.Tensor) and pos.shape[-1] > 1:
        shifts = _check_positions_once(pos, cu_seqlens, kwargs)
    if cu_seqlens is None:
        return shifts
    kind = _length_rope(getattr(module, "config", None))
    if kind:
        raise ValueError(
            f"ringattn: the model scales RoPE by the sequence's length ({kind}); packed "
            "documents would share one scaling: run them one per sequence"
        )
    return shifts


# The position_ids last checked (a weak reference, its version) and the settings they were
# checked under: every attention layer of one forward gets the same tensor, which is checked
# once, not once a layer (each check waits for the device).
_POSITIONS_CHECKED: list = [None]
_PACKING_SETTINGS = ("group", "layout", "ulysses_group")  # what else the check depends on


def _check_positions_once(pos: torch.Tensor, cu_seqlens: Any, kwargs: dict) -> Shifts:
    """position_ids against the packing, once per tensor: restarting within a row with no
    cu_seqlens (documents packed without saying so, attended across); under cu_seqlens, rows
    of a batch that differ, or a jump inside a document it packs (``_position_jump``). Each
    a PositionsError: one rank may find it alone, and the ring's agreement raises it on all."""
    # an inference tensor has no version counter (torch.inference_mode: a traceback), and
    # may be changed in place between forwards: checked at every call
    version = object() if pos.is_inference() else pos._version
    key = (version, *(_setting(kwargs, s) for s in _PACKING_SETTINGS))
    last = _POSITIONS_CHECKED[0]
    if last is not None and last[0]() is pos and last[1] is cu_seqlens and last[2] == key:
        return last[3]
    if cu_seqlens is None and bool((pos[..., 1:] < pos[..., :-1]).any()):
        raise PositionsError(
            "ringattn: position_ids restart within a row (packed documents) but no "
            "cu_seqlens reached ring attention, which would attend across them: pass "
            "ring_cu_seqlens=... (or ring_settings(cu_seqlens=...))"
        )
    packed = cu_seqlens is not None
    if packed and pos.dim() == 2 and not bool((pos == pos[:1]).all()):
        raise PositionsError(
            "ringattn: the rows of a packed batch have different position_ids, but one "
            "cu_seqlens packs every row: pack each row alike, or run them one at a time"
        )
    shifts: Shifts = ()
    if pos.dim() <= 2:  # 1-D positions (3-D: multimodal RoPE, not token indices)
        shifts = _position_jump(pos, cu_seqlens, kwargs, steps=packed)
    _POSITIONS_CHECKED[0] = (weakref.ref(pos), cu_seqlens, key, shifts)
    return shifts


def _position_jump(pos: torch.Tensor, cu_seqlens: Any, kwargs: dict, *, steps: bool) -> Shifts:
    """Within each run of one document on this rank, position_ids go up by one a row (from
    wherever they start: a document's own positions or the sequence's, RoPE being relative),
    and the runs of one document on this rank (zigzag gives a rank two pieces of a long one)
    are shifted alike: position_ids that restart inside a document cu_seqlens says is one
    (restarting at 8 where it says 5), or a rank's own 0..S-1 over two pieces of a document,
    mean the caller's documents and the ring's disagree, which RoPE would turn into wrong
    numbers with no error. One read of the rows from the device. Without cu_seqlens
    (``steps`` False) only the pieces' shifts are compared: one sequence's positions may skip.
    Returns the shifts of the documents this rank holds part of, which may continue on other
    ranks: the ring's agreement compares them there (``shifts_agreed``).
    """
    runs = list(_document_runs(cu_seqlens, kwargs, pos.shape[-1]))
    rows = pos.reshape(-1, pos.shape[-1])
    step_ok = (rows[:, 1:] - rows[:, :-1] == 1).all(0)  # row i -> i + 1
    firsts = rows[0, [run[1] for run in runs]]
    step_ok, firsts = step_ok.cpu(), firsts.tolist()
    shifts: dict[int, int] = {}
    for (doc, first, last, doc_row, _), at in zip(runs, firsts, strict=True):
        if steps and not bool(step_ok[first:last].all()):
            raise PositionsError(
                f"ringattn: position_ids jump inside document {doc} of cu_seqlens (local "
                f"rows {first}-{last}): the positions and cu_seqlens pack different "
                "documents; give each row its position within its document "
                "(ringattn.document_positions)"
            )
        if shifts.setdefault(doc, at - doc_row) != at - doc_row:
            raise PositionsError(
                f"ringattn: position_ids of document {doc} do not follow its pieces on this "
                f"rank (local row {first} is its token {doc_row}, at position {at}): give each "
                "row its position in its document, or in the sequence for one document "
                "(ringattn.document_positions, or shard_sequence of the positions)"
            )
    return _shared_shifts(runs, shifts)


def _shared_shifts(runs: list[tuple[int, int, int, int, int]], shifts: dict) -> Shifts:
    """(document, shift) of each document this rank holds only part of: the documents another
    rank may hold too (a document held whole here is this rank's alone)."""
    held: dict[int, int] = {}
    length: dict[int, int] = {}
    for doc, first, last, _, doc_length in runs:
        held[doc] = held.get(doc, 0) + last - first + 1
        length[doc] = doc_length
    return tuple((doc, shifts[doc]) for doc, rows in held.items() if rows < length[doc])


def _document_runs(
    cu_seqlens: Any, kwargs: dict, local_rows: int
) -> Iterator[tuple[int, int, int, int, int]]:
    """(document, first local row, last local row, the first row's token index in its
    document, the document's length) of each run of one document on this rank:
    a plain ring's rank, or a hybrid
    grid's member (its share of its ring rank's rows, as ``ringattn.layouts.
    sequence_positions`` gives it). Without cu_seqlens the sequence is one document."""
    ring, ulysses = _setting(kwargs, "group"), _setting(kwargs, "ulysses_group")
    degree = 1 if ulysses is None else _world(ulysses)
    world = _world(ring) * degree
    if ulysses is not None:
        rank = hybrid_rank(ulysses, ring)
    else:
        rank = dist.get_rank(ring) if dist.is_initialized() else 0
    layout = _setting(kwargs, "layout") or "contiguous"
    geo, ring_rank, rows = packed_share(
        cu_seqlens,
        world_size=world,
        rank=rank,
        layout=layout,
        ulysses_degree=degree,
        tokens=local_rows * world,
    )
    for run in geo.runs[ring_rank]:
        start = max(run.local, rows.start)
        first = start - rows.start
        last = min(run.local + run.length, rows.stop) - 1 - rows.start
        if run.doc != PAD and last >= first:
            doc_row = run.start - run.doc_start + start - run.local
            yield run.doc, first, last, doc_row, geo.doc_lengths[run.doc]


def _length_rope(config: Any) -> str | None:
    """The length-dependent RoPE type a config names (rope_parameters, per layer type or
    one), or None."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    found = [params] + [v for v in params.values() if isinstance(v, dict)]
    for entry in found:
        kind = str(entry.get("rope_type") or entry.get("type") or "")
        if scales_with_length(kind):
            return kind
    return None


def _autocast_inputs(q, k, v):
    """q, k, v in one dtype under ``torch.autocast``: its lower precision, as autocast gives
    sdpa. Without this a model under autocast (the training job's bfloat16) reaches attention
    with q and k lifted back to float32 by RoPE's float32 cos/sin and v in bfloat16."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _hybrid(module, q, k, v, scaling, layout, ulysses, ring, sinks, window, cu_seqlens):
    from .hybrid import hybrid_attention

    if ulysses is None:
        raise ValueError(
            f"ringattn: the {layout!r} layout needs the Ulysses group: "
            "ring_settings(ulysses_group=..., group=<the ring>) (ringattn.hybrid.hybrid_groups)"
        )
    if sinks is not None:
        raise ValueError(
            f"ringattn: {type(module).__name__} uses attention sinks, which hybrid attention "
            "does not merge: refused rather than ignored"
        )
    return hybrid_attention(
        q,
        k,
        v,
        causal=True,
        softmax_scale=scaling,
        layout=layout,
        ulysses_group=ulysses,
        ring_group=ring,
        window=window,
        cu_seqlens=cu_seqlens,
    )


def scales_with_length(rope_type: str) -> bool:
    """Whether a RoPE type's frequencies depend on the sequence's length."""
    return rope_type in LENGTH_DEPENDENT_ROPE or "dynamic" in rope_type


def rope_types(module: torch.nn.Module) -> dict[str, str]:
    """{attribute prefix: rope type} of a rotary-embedding module ({} for anything else)."""
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, str) and hasattr(module, "inv_freq"):
        return {"": kind}
    if isinstance(kind, dict):
        return {f"{layer}_": str(t) for layer, t in kind.items()}
    return {}


def _reset_dynamic(module: torch.nn.Module, prefix: str) -> None:
    """Forget the frequencies a longer earlier document left (dynamic RoPE caches them)."""
    original = getattr(module, f"{prefix}original_inv_freq", None)
    cached = getattr(module, "original_max_seq_len", None)
    if original is not None and cached is not None:
        current = getattr(module, f"{prefix}inv_freq")
        module.register_buffer(f"{prefix}inv_freq", original.to(current.device), persistent=False)
        setattr(module, f"{prefix}max_seq_len_cached", cached)


def _global_rope_hooks(model: torch.nn.Module, seq_len: int) -> list:
    """Hooks making length-dependent RoPE see the document's length ``seq_len`` on every rank.

    transformers takes the length as ``max(position_ids) + 1``; one extra position
    ``seq_len - 1`` is appended to the positions (those past the document, i.e. padding, are
    clamped to it: their outputs are dropped and no real token attends to them), and its
    cos/sin are cut off the output again.
    """
    last = max(int(seq_len), 1) - 1
    hooks = []
    for module in model.modules():
        types = rope_types(module)
        if not any(scales_with_length(t) for t in types.values()):
            continue

        def before(mod, args, kwargs, _types=types):
            for prefix, kind in _types.items():
                if "dynamic" in kind:
                    _reset_dynamic(mod, prefix)
            args = list(args)
            pos = args[1] if len(args) > 1 else kwargs["position_ids"]
            pos = torch.cat([pos.clamp(max=last), torch.full_like(pos[..., :1], last)], dim=-1)
            if len(args) > 1:
                args[1] = pos
            else:
                kwargs["position_ids"] = pos
            return tuple(args), kwargs

        def after(mod, args, kwargs, output):
            return tuple(t[..., :-1, :] for t in output)

        hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(module.register_forward_hook(after, with_kwargs=True))
    return hooks


@contextlib.contextmanager
def ring_settings(
    *,
    group: Any = None,
    layout: str | None = None,
    seq_len: int | None = None,
    model: torch.nn.Module | None = None,
    ulysses_group: Any = None,
    cu_seqlens: Any = None,
) -> Iterator[RingSettings]:
    """The ring's settings for every attention call in the block (see the module docstring)."""
    if cu_seqlens is not None and model is not None:
        _refuse_packed_length_rope(model)
    cu_seqlens = packing_argument(cu_seqlens)  # every layer reads it: an iterator, once
    settings = RingSettings(
        group=group,
        layout=layout,
        seq_len=seq_len,
        ulysses_group=ulysses_group,
        cu_seqlens=cu_seqlens,
    )
    token = _SETTINGS.set(settings)
    hooks = _global_rope_hooks(model, seq_len) if model is not None and seq_len else []
    try:
        yield settings
    finally:
        for hook in hooks:
            hook.remove()
        _SETTINGS.reset(token)


def _refuse_packed_length_rope(model: torch.nn.Module) -> None:
    """RoPE scaled by the sequence's length cannot serve a pack: each document needs its own."""
    for module in model.modules():
        kinds = [t for t in rope_types(module).values() if scales_with_length(t)]
        if kinds:
            raise ValueError(
                f"ringattn: {type(module).__name__} scales RoPE by the sequence's length "
                f"({kinds[0]}); packed documents would share one scaling: run them one per "
                "sequence"
            )


def _refuse_padding_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """Mask function for the same name: lets no padding mask be dropped silently.

    transformers builds the layer mask from the user's 2D mask through this function. Ring
    attention needs none, so this returns None, after checking that the 2D mask pads nothing.
    A mask that pads is refused by the next attention call (``_padding_refusal``), through
    the ring's agreement on every rank: each rank sees only its own shard of the mask, and a
    rank raising here alone left the others waiting for it until the group's timeout.
    """
    padded = attention_mask is not None and not bool(attention_mask.all())
    _PADDED.set(
        ValueError(
            "ringattn: a padding attention_mask (with zeros) was given; ring attention runs one "
            "unpadded document per row and would ignore it. Remove the padding (one document "
            "per call) and pass attention_mask=None"
        )
        if padded
        else None
    )
    return None


# The refusal of this forward's padding mask (``_refuse_padding_mask``), taken by its first
# attention call.
_PADDED: contextvars.ContextVar[ValueError | None] = contextvars.ContextVar(
    "ringattn_padded", default=None
)


def _take_padding_refusal() -> ValueError | None:
    """The padding mask's refusal, taken once (a later forward that builds no mask must not
    see it), for the ring's agreement to raise on every rank."""
    refusal = _PADDED.get()
    if refusal is not None:
        _PADDED.set(None)
    return refusal


def register(name: str = DEFAULT_NAME) -> str:
    """Register ring attention with transformers under ``name`` (idempotent); returns name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, ring_attention_forward)
    AttentionMaskInterface.register(name, _refuse_padding_mask)
    return name


__all__ = [
    "DEFAULT_NAME",
    "AttentionMaskError",
    "CallCount",
    "RingSettings",
    "count_calls",
    "register",
    "ring_attention_forward",
    "ring_settings",
    "supports_sinks",
]
