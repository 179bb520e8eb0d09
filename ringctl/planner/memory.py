"""Per-rank memory of a model under ring attention: states, activations, logits, buffers.

Every part is stated with the dtype it is held in (``precision``), because mixed precision is
where memory models go wrong by 2-4x:

* weights: in the compute dtype for inference and for training without an optimizer; with
  ``optimizer="adam"`` the stored weights are float32 masters (the compute dtype exists only
  as FSDP's per-layer gathered copy, or as autocast's transient casts when unsharded);
* gradients: float32 with Adam (FSDP2's ``reduce_dtype``), else the compute dtype;
* Adam moments: two float32 tensors per parameter;
* activations and K/V transfers: the compute dtype; dK/dV accumulators, log-sum-exp and
  the loss's logits: float32.

Sharding (``shard``) over a degree D: ``weights`` divides the weights (and masters) by D,
``full`` also the gradients and optimizer state (FSDP's FULL_SHARD / ZeRO-3). Sharded weights
are gathered a unit (decoder layer, or embedding / lm_head) at a time, with the next unit
prefetched: two units in flight.

Activations per token of one decoder layer, counted as the tensors PyTorch autograd saves
for a Llama layer with a fused attention kernel (no n^2 scores): both RMSNorms' inputs and
outputs (4h), q/k/v (``(H + 2 KV) d``), the attention output (``H d``) and the gated MLP's
gate, up, activation and product (4i). ``selective`` keeps only the matmul and attention
outputs (recomputing norms and activations: h + (H + 2 KV) d + H d + 2i); ``full`` keeps each
layer's input (h) and holds one layer's full set while it is recomputed. Inference keeps one
layer live at a time.
"""

from __future__ import annotations

from ringattn.geometry import banded_rows

from .window import largest_chunk

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
TRAIN = "train"  # the planner's mode of a forward + backward + optimizer step
MODES = ("score", "embed", TRAIN)
CHECKPOINTS = ("none", "full", "selective")
SHARDS = ("none", "weights", "full")
OPTIMIZERS = (None, "adam")


def runs_lm_head(w) -> bool:
    """Whether the job runs the output head: scoring and training do; ``embed`` returns
    the hidden states before it (its logits were priced: 4.9 GiB a rank of nothing)."""
    return w.run_mode != "embed"


def precision(w) -> dict[str, str]:
    """The dtype each kind of tensor is held in, as the memory model counts it."""
    trains = w.trains
    adam = trains and w.optimizer == "adam"
    out = {
        "weights (stored)": "float32" if adam else w.dtype,
        "weights (compute)": w.dtype,
    }
    if trains:
        out["gradients"] = "float32" if adam else w.dtype
    if adam:
        out["Adam moments (2 per parameter)"] = "float32"
    out.update(
        {
            "activations": w.dtype,
            "K/V blocks on the ring": w.dtype,
            "log-sum-exp, softmax statistics": "float32",
        }
    )
    if trains:
        out["dK/dV accumulators (travelling)"] = "float32"
    if w.model is not None and runs_lm_head(w):
        out["logits, log-softmax"] = "float32"
    return out


def _mlp_share(w, tokens: float) -> float:
    """The share of the rank's tokens whose MLP intermediates are alive at once: all of them,
    or one chunk with ``mlp_chunk`` (blockwise feedforward, Liu & Abbeel 2023: the MLP and
    its recompute run chunk by chunk, so only a layer's inputs/outputs span every token)."""
    return 1.0 if not w.mlp_chunk else min(1.0, w.mlp_chunk / max(tokens, 1.0))


def _elems(w, tokens: float):
    """Per-token elements of one layer: (train saved, selective saved, recomputed layer under
    full checkpointing, inference live, backward gradients)."""
    m, heads, kv, d = w.model, w.heads, w.kv_heads, w.head_dim
    h, i = m.hidden, m.active_inter  # a token's MLP width (its experts' with experts)
    f = _mlp_share(w, tokens)
    qkv, out = (heads + 2 * kv) * d, heads * d
    train = 4 * h + qkv + out + 4 * i
    selective = h + qkv + out + 2 * i
    recomputed = qkv + out + (4 * h + 4 * i) * f  # norms and MLP run chunk by chunk
    live = 2 * h + max(qkv + out, 3 * i * f)
    grads = 2 * h + 3 * i * f
    return train, selective, recomputed, live, grads


def activation_parts(w, tokens: float) -> dict[str, float]:
    """Bytes of saved / live activations for ``tokens`` tokens on this rank."""
    from .model import ModelShape

    m: ModelShape = w.model
    b = DTYPE_BYTES[w.dtype]
    train, selective, recomputed, live, _ = _elems(w, tokens)
    lse = 4 * w.heads  # float32 log-sum-exp per token and head, saved by the kernel
    if not w.trains:
        return {"activations (one layer live, no autograd)": live * tokens * b}
    if w.checkpoint == "full":
        return {
            "checkpoints (each layer's input)": m.layers * m.hidden * tokens * b,
            "recomputed layer (during its backward)": (recomputed * b + lse) * tokens,
        }
    per_layer = selective * b + lse if w.checkpoint == "selective" else train * b + lse
    parts = {f"activations (all layers, checkpoint {w.checkpoint})": m.layers * per_layer * tokens}
    return parts


def backward_working_set(w, tokens: float) -> float:
    """One layer's activation gradients while it runs backward (the MLP's are the largest),
    plus the residual stream's gradient."""
    return _elems(w, tokens)[4] * tokens * DTYPE_BYTES[w.dtype]


def logits_bytes(w, tokens: float) -> float:
    """lm_head output and the log-softmax over one chunk (``lm_head_chunk`` tokens; 0: all
    tokens of the rank at once, as a training loop that calls cross_entropy on the whole
    sequence does): the matmul's output in the compute dtype, its float32 upcast (none when
    computing in float32), the saved log-softmax, and its gradient when training."""
    b = DTYPE_BYTES[w.dtype]
    per = b + (4 if b != 4 else 0) + 4 + (4 if w.trains else 0)
    chunk = tokens if not w.lm_head_chunk else min(tokens, w.lm_head_chunk)
    return chunk * w.model.vocab * per


def state_parts(w, degree: int) -> dict[str, float]:
    """Weights, gradients, optimizer state and FSDP's gathered units, per rank."""
    from .model import total_params

    m = w.model
    b = DTYPE_BYTES[w.dtype]
    n = total_params(m, w.heads, w.kv_heads, w.head_dim)
    adam = w.trains and w.optimizer == "adam"
    d_w = degree if w.shard in ("weights", "full") else 1
    d_s = degree if w.shard == "full" else 1
    stored = 4 if adam else b
    grad = 4 if adam else b
    label = "float32 masters" if adam else w.dtype
    shard_note = f", 1/{d_w} shard" if d_w > 1 else ""
    parts = {f"weights ({label}{shard_note})": n * stored / d_w}
    if w.trains:
        parts[
            f"gradients ({'float32' if adam else w.dtype}{f', 1/{d_s} shard' if d_s > 1 else ''})"
        ] = n * grad / d_s
    if adam:
        parts[f"Adam moments (float32 x2{f', 1/{d_s} shard' if d_s > 1 else ''})"] = n * 8 / d_s
    if d_w > 1:
        unit = largest_unit(w)
        gathered = 2 * unit * b  # the unit computing and the next one prefetched
        if w.trains:
            gathered += unit * grad  # a unit's full gradient before its reduce-scatter
        parts["gathered weights (FSDP: 2 units in flight)"] = gathered
    elif adam and b != 4:
        # Unsharded mixed precision: autocast casts a matmul's weight per use; the largest
        # cast alive at once is about one unit.
        parts["weight casts (autocast, one unit)"] = largest_unit(w) * b
    return parts


def largest_unit(w) -> int:
    """Parameters of the largest unit gathered (FSDP) or cast (autocast) at once: one decoder
    layer, or the embedding or lm_head matrix, vocab x hidden whole (tied, the one matrix is
    still all of it, not half of embedding_params)."""
    from .model import layer_params

    m = w.model
    return max(layer_params(m, w.heads, w.kv_heads, w.head_dim), m.vocab * m.hidden)


def banded_workspace(w, ranks: int, window: int, cpu: bool) -> float:
    """Bytes the banded kernel holds for one chunk of a windowed layer's boundary blocks
    (ringattn.kernels.BandedKernel): at most R query rows against the R + W - 1 keys they
    reach, the largest chunk the busiest rank computes (``window.largest_chunk``), whatever
    the sequence length beyond. On host CPUs (the fused path) the band's additive mask in the
    compute dtype (two alive: the zeros and the filled copy) and four boolean masks per score;
    elsewhere (matmuls in float32) every head's scores: s, the masked s and p forward, also dP
    and dS backward, and the boolean mask."""
    rows = banded_rows(w.batch, w.heads, window)
    scores = largest_chunk(ranks, int(w.seq_len // ranks), w.layout, window, rows)
    if cpu:
        return scores * (2 * DTYPE_BYTES[w.dtype] + 4)
    acc = 8 if w.dtype == "float64" else 4
    return scores * (w.batch * w.heads * (4 if w.trains else 3) * acc + 1)


def output_bytes(w, tokens: float) -> dict[str, float]:
    mode = w.run_mode
    if mode == "score":
        return {"log-probabilities (float32)": tokens * 4}
    if mode == "embed":
        return {"hidden states (output)": tokens * w.model.hidden * DTYPE_BYTES[w.dtype]}
    return {}
