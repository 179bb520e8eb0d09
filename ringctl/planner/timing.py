"""Whole-model time of one sequence on a ring: matmuls, ring attention, lm_head, recompute,
FSDP collectives and (hybrid layouts) the Ulysses all-to-all; then tokens/s and MFU per GPU.

Per decoder layer the rank computes its projections and MLP on its N/P tokens (matmul
throughput: the device's peak x ``matmul_efficiency``, or on a calibrated CPU the measured
rate at each matmul's own width, ``Device.matmul_rate``) and its share of attention (the ring
model of ``cost``, which already hides or exposes the K/V transfers step by step). Training
runs each matmul backward as two of its forward FLOPs: the input's gradient sums over the
output width, the weight's over the tokens; ``checkpoint=full`` recomputes each
layer's forward (ring attention included) before its backward; ``selective`` recomputes
only element-wise work, counted as free.

Sharded weights are all-gathered a layer at a time, prefetched one layer ahead, so a layer
costs max(its compute, its collectives) and only the first gather (and, backward, the last
reduce-scatter) is exposed. FSDP2 reshards after forward, so backward gathers each layer
again and reduce-scatters its gradient. The collectives cross NVLink while the shard group
fits one node, else the device's inter-node network.

The Ulysses all-to-all (q, k, v in, output back; backward: dout in, dq, dk, dv back) sits on
the critical path of every layer: its volume is (U-1)/U of the tensors, over NVLink.
"""

from __future__ import annotations

from .memory import DTYPE_BYTES, runs_lm_head
from .model import (
    elementwise_bytes_per_token,
    layer_matmuls,
    layer_params,
    linear_flops_per_token,
    lm_head_flops_per_token,
    lm_head_matmul,
)
from .window import layer_windows, window_scores


def collective_s(nbytes: float, degree: int, link) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` (the full tensor) over ``degree``."""
    if degree <= 1:
        return 0.0
    return (degree - 1) / degree * nbytes / link.bytes_per_s + (degree - 1) * link.latency_s


def all_to_all_s(w, ranks: int, link) -> tuple[float, float]:
    """(forward, backward) seconds per layer of the Ulysses all-to-all on one rank."""
    u = w.ulysses
    if u <= 1:
        return 0.0, 0.0
    tokens = w.batch * w.seq_len / ranks
    b = DTYPE_BYTES[w.dtype]
    kv_heads = max(w.kv_heads, u)  # fewer K/V heads than U: each rank gets one, replicated
    qkv = tokens * (w.heads + 2 * kv_heads) * w.head_dim * b
    out = tokens * w.heads * w.head_dim * b
    share = (u - 1) / u
    one = 2 * link.latency_s * (u - 1)
    return share * (qkv + out) / link.bytes_per_s + one, share * (
        out + qkv
    ) / link.bytes_per_s + one


def attention_flops(w, ranks: int) -> float:
    """Forward attention FLOPs per rank over all layers, 4 per score and head dimension:
    N^2 scores without a mask, half of them causal, and under a sliding window W the
    sum_i min(i + 1, W) scores each query i sees (``window.window_scores``)."""
    per_score = 4.0 * w.batch * w.heads * w.head_dim / ranks
    total = 0.0
    for window, layers in layer_windows(w):
        if window is not None:
            scores = window_scores(w.seq_len, window)
        else:
            scores = w.seq_len**2 / 2 if w.causal else w.seq_len**2
        total += layers * per_score * scores
    return total


def matmul_s(shapes, tokens: float, device, dtype: str, ranks_on_host: int) -> tuple[float, float]:
    """(forward, backward) seconds of the matmuls ``shapes`` ((in, out) widths) on ``tokens``
    tokens: forward at the rate of the in width; backward the input's gradient at the rate of
    the out width and the weight's at the rate of a sum over tokens (the widest)."""
    forward = backward = 0.0
    for k, n in shapes:
        flops = 2.0 * tokens * k * n
        forward += flops / device.matmul_rate(dtype, k, ranks_on_host)
        backward += flops / device.matmul_rate(dtype, n, ranks_on_host)
        backward += flops / device.matmul_rate(dtype, None, ranks_on_host)
    return forward, backward


def elementwise_s(w, tokens: float, device, ranks_on_host: int) -> float:
    """Forward seconds of one rank's elementwise work (model.elementwise_bytes_per_token) at
    the device's measured rate; 0 where it has none (a datasheet entry)."""
    if not device.elementwise_gbytes_s:
        return 0.0
    per_token = elementwise_bytes_per_token(
        w.model, w.heads, w.kv_heads, w.head_dim, DTYPE_BYTES[w.dtype]
    )
    rate = device.elementwise_gbytes_s * 1e9 / device.time_shared(ranks_on_host)
    return tokens * per_token / rate


def _phase_parts(phase: str, lin: float, att: float, head: float, elem: float) -> dict:
    """One phase's parts of the whole-model time; the elementwise part only where the device
    prices it (a datasheet entry's report keeps its rows)."""
    parts = {f"projections + MLP ({phase})": lin, f"ring attention ({phase})": att}
    if head:  # none for embed (runs_lm_head)
        parts[f"lm_head ({phase})"] = head
    if elem:
        parts[f"norms, RoPE, activations ({phase})"] = elem
    return parts


def model_time(w, ranks, device, attn_s, *, ranks_on_host, intra, net) -> dict | None:
    """Seconds by part, total, tokens/s/GPU and MFU; None when the device has no matmul rate
    (an entry calibrated before matmuls were timed)."""
    if w.model is None or w.dtype not in device.tflops:
        return None
    m = w.model
    peak = device.tflops[w.dtype] * 1e12
    tokens = w.batch * w.seq_len / ranks
    L = m.layers
    layer = layer_matmuls(m, w.heads, w.kv_heads, w.head_dim)
    one_f, one_b = matmul_s(layer, tokens, device, w.dtype, ranks_on_host)
    lin_f, lin_b = L * one_f, L * one_b  # every layer alike: one priced, times L
    head = [lm_head_matmul(m)] if runs_lm_head(w) else []  # embed stops before it
    head_f, head_b = matmul_s(head, tokens, device, w.dtype, ranks_on_host)
    att_f, elem_f = attn_s["forward"], elementwise_s(w, tokens, device, ranks_on_host)
    trains = w.trains
    att_b, elem_b = attn_s.get("backward", 0.0), 2 * elem_f
    recompute = lin_f + att_f + elem_f if trains and w.checkpoint == "full" else 0.0
    degree = (w.shard_degree or ranks) if w.shard != "none" else 1
    link = intra if degree <= ranks_on_host else net
    b = DTYPE_BYTES[w.dtype]
    layer_bytes = layer_params(m, w.heads, w.kv_heads, w.head_dim) * b
    grad_b = 4 if w.optimizer == "adam" else b
    gather = collective_s(layer_bytes, degree, link)
    scatter = collective_s(layer_bytes / b * grad_b, degree, link) if trains else 0.0
    a2a_f, a2a_b = all_to_all_s(w, ranks, intra)
    fwd_layer = (lin_f + att_f + elem_f) / L
    parts = _phase_parts("forward", lin_f, att_f, head_f, elem_f)
    forward = L * max(fwd_layer, gather) + gather + L * a2a_f + head_f
    total = forward
    if trains:
        parts |= _phase_parts("backward", lin_b, att_b, head_b, elem_b)
        parts["recompute (checkpoint=full)"] = recompute
        bwd_layer = (lin_b + att_b + elem_b + recompute) / L
        backward = L * max(bwd_layer, gather + scatter) + scatter + L * a2a_b + head_b
        total += backward
    if degree > 1:
        parts[f"FSDP collectives over {degree} ({link.name}), exposed"] = total - (
            sum(parts.values()) + L * (a2a_f + (a2a_b if trains else 0.0))
        )
    if w.ulysses > 1:
        parts[f"Ulysses all-to-all x{w.ulysses} ({intra.name})"] = L * (
            a2a_f + (a2a_b if trains else 0.0)
        )
    useful = tokens * (
        linear_flops_per_token(m, w.heads, w.kv_heads, w.head_dim)
        + (lm_head_flops_per_token(m) if head else 0.0)
    ) + attention_flops(w, ranks)
    useful *= 3 if trains else 1
    return {
        "parts": parts,
        "total_s": total,
        "tokens_per_s_per_gpu": tokens / total,
        "mfu": useful / (total * peak),
    }
