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
for a Llama layer with a fused attention kernel (no n^2 scores), checked against
saved_tensors_hooks and the live tensor bytes of real 2-rank steps (within 0.95-1.05 of the
peak for float32, bfloat16 and autocast training, FSDP, scoring and grad): the RMSNorms'
(``norm_bytes``: input, ``x * rsqrt`` and output, by precision), q/k/v (``(H + 2 KV) d``),
the attention output (``H d``) and the gated MLP's gate, up, activation and product (4i);
under autocast every layer's matrices cast to half precision, kept until backward.
``selective`` keeps only the matmul and attention outputs (recomputing norms and
activations: h + (H + 2 KV) d + H d + 2i); ``full`` keeps each layer's input (h) and holds
one layer's full set while it is recomputed. Inference keeps one layer live at a time.
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
    # under autocast the residual stream and the norms stay float32 (norm_bytes)
    shown = f"{w.dtype} (the residual stream and norms float32)" if autocast(w) else w.dtype
    out.update(
        {
            "activations": shown,
            "K/V blocks on the ring": w.dtype,
            "log-sum-exp, softmax statistics": "float32",
        }
    )
    if trains:
        out["dK/dV accumulators (travelling)"] = "float32"
    if w.model is not None and runs_lm_head(w):
        out["logits, log-softmax"] = logits_dtype(w.dtype)
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
    train = qkv + out + 4 * i  # the norms' are in bytes: norm_bytes
    selective = h + qkv + out + 2 * i
    recomputed = qkv + out + 4 * i * f  # the MLP runs chunk by chunk
    live = 2 * h + max(qkv + out, 3 * i * f)
    grads = 2 * h + 3 * i * f
    return train, selective, recomputed, live, grads


def autocast(w) -> bool:
    """Training in bfloat16/float16 by autocast over float32 weights (the training job's
    ``task.dtype: bfloat16``, ``Workload.autocast``), not a model cast to it nor FSDP's mixed
    precision."""
    return w.autocast and w.trains and DTYPE_BYTES[w.dtype] != 4


def norm_bytes(w) -> float:
    """Bytes a token's two RMSNorms of one layer keep for backward, as autograd saves them
    (measured with saved_tensors_hooks on transformers' Llama layer): each norm's input in
    float32 (a float32 copy of a half-precision one, for the square) and ``x * rsqrt`` in
    float32; then its output as each projection reads it: in float32 (12h bytes a norm),
    once in half precision for a model cast to it (8h), and under autocast once per
    projection that casts it (q, k, v; gate, up: 26h for both norms). The planner counted
    each norm's input and output only (float32 priced 0.89x, bfloat16 0.81x of the saved
    bytes, autocast as a half-precision model)."""
    h, b = w.model.hidden, DTYPE_BYTES[w.dtype]
    if b >= 4:
        return 2 * 3 * b * h
    if autocast(w):
        return 2 * 8 * h + (3 + 2) * b * h
    return 2 * (4 + 2 * b) * h


def activation_parts(w, tokens: float) -> dict[str, float]:
    """Bytes of saved / live activations for ``tokens`` tokens on this rank."""
    from .model import ModelShape

    m: ModelShape = w.model
    b = DTYPE_BYTES[w.dtype]
    train, selective, recomputed, live, _ = _elems(w, tokens)
    lse = 4 * w.heads  # float32 log-sum-exp per token and head, saved by the kernel
    if not w.trains:
        return {"activations (one layer live, no autograd)": live * tokens * b}
    casts = {}
    if autocast(w):  # cached per autocast region: every layer's, kept until it ends (also
        # under full checkpointing: the cache outlives the checkpointed layers' recompute)
        casts["weight casts (autocast: every layer's, saved for backward)"] = (
            m.layers * matrix_params(w) + head_matrix(w)
        ) * b
    if w.checkpoint == "full":
        return {
            "checkpoints (each layer's input)": m.layers * m.hidden * tokens * b,
            "recomputed layer (during its backward)": (recomputed * b + norm_bytes(w) + lse)
            * tokens,
        } | casts
    if w.checkpoint == "selective":
        per_layer = selective * b + lse
    else:
        per_layer = train * b + norm_bytes(w) + lse
    parts = {f"activations (all layers, checkpoint {w.checkpoint})": m.layers * per_layer * tokens}
    return parts | casts


def backward_working_set(w, tokens: float) -> float:
    """One layer's activation gradients while it runs backward (the MLP's are the largest),
    plus the residual stream's gradient."""
    return _elems(w, tokens)[4] * tokens * DTYPE_BYTES[w.dtype]


def logits_dtype(dtype: str) -> str:
    """The dtype the logits and log-softmax are computed in: float32 at least (scoring's
    ``output_head``: bf16/fp16 go up to float32, float64 stays float64)."""
    return "float64" if dtype == "float64" else "float32"


def logits_bytes(w, tokens: float) -> float:
    """lm_head output and the log-softmax over one chunk (``lm_head_chunk`` tokens; 0: all
    tokens of the rank at once, as a training loop that calls cross_entropy on the whole
    sequence does): the matmul's output in the compute dtype, its float32 upcast (none when
    computing in float32 or float64, which the logits keep), the saved log-softmax, and when
    training two gradients alive in its backward (the log-softmax's and the logits': the
    job's chunked loss measured 1.21x of one gradient's count in float32, 0.95x of two in
    bfloat16), all in the logits' dtype (``logits_dtype``)."""
    b = DTYPE_BYTES[w.dtype]
    kept = DTYPE_BYTES[logits_dtype(w.dtype)]
    per = b + (kept if kept != b else 0) + kept + (2 * kept if w.trains else 0)
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
        # the unit computing and the next one prefetched: in the compute dtype (FSDP's mixed
        # precision), or float32 under autocast, which casts them (activation_parts)
        gathered = 2 * unit * (stored if autocast(w) else b)
        if w.trains:
            gathered += unit * grad  # a unit's full gradient before its reduce-scatter
        parts["gathered weights (FSDP: 2 units in flight)"] = gathered
    elif adam and b != 4 and not autocast(w):
        # Unsharded mixed precision: a matmul's weight cast per use; the largest cast alive
        # at once is about one unit.
        parts["weight casts (mixed precision, one unit)"] = largest_unit(w) * b
    return parts


def optimizer_step_parts(w, degree: int, ranks: int) -> dict[str, float]:
    """What the step after backward adds (the activations freed by then): one float32 copy
    of the gradients, the flat buffer of their all-reduce (``train.step.sum_gradients``,
    unsharded over more than one rank) or AdamW's foreach temporary (the second moments'
    square roots, on GPUs); per shard under FSDP. The peak of a weight-heavy step is here
    (1.13x of the plan before)."""
    from .model import total_params

    if not w.trains:
        return {}
    n = total_params(w.model, w.heads, w.kv_heads, w.head_dim)
    adam = w.optimizer == "adam"
    grad = 4 if adam else DTYPE_BYTES[w.dtype]
    d_s = degree if w.shard == "full" else 1
    if not adam and (d_s > 1 or ranks == 1):
        return {}
    if not adam:  # no optimizer: the all-reduce's flat copy alone, in the gradients' dtype
        return {f"gradient all-reduce (a {w.dtype} copy of the gradients)": n * grad}
    return {"optimizer step (a float32 copy of the gradients: all-reduce, AdamW)": n * grad / d_s}


def matrix_params(w) -> int:
    """A layer's matrices' parameters (what autocast casts: not its norms)."""
    from .model import layer_params

    m = w.model
    return layer_params(m, w.heads, w.kv_heads, w.head_dim) - 2 * m.hidden


def head_matrix(w) -> int:
    """The output head's matrix (autocast casts it; the embedding lookup it does not)."""
    return w.model.vocab * w.model.hidden if runs_lm_head(w) else 0


def largest_unit(w) -> int:
    """Parameters of the largest unit gathered (FSDP) or cast per use (mixed precision
    without FSDP) at once: one decoder layer, or the embedding or lm_head matrix, vocab x
    hidden whole (tied, the one matrix is still all of it, not half of embedding_params)."""
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
    """The outputs a rank keeps, and in inference the input embeddings, which transformers'
    model forward keeps alive through every layer (1.17x of the plan before)."""
    mode, b = w.run_mode, DTYPE_BYTES[w.dtype]
    kept = {}
    if not w.trains:
        kept["input embeddings (kept by the model's forward)"] = tokens * w.model.hidden * b
    if mode == "score":
        return {"log-probabilities (float32)": tokens * 4} | kept
    if mode == "embed":
        return {"hidden states (output)": tokens * w.model.hidden * b} | kept
    return kept
