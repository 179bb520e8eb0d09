"""Tiny GGUF model files written here with the ``gguf`` package's own writer (no tests here).

A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with random weights, some of them quantised
(Q8_0 and Q4_1, what llama.cpp writes), and a byte-level BPE tokenizer in the file (the 256
byte symbols, a few merges, ``<s>`` and ``</s>``): what a user's llama.cpp or Ollama file looks
like, small enough to convert and score in a second. Options make the files the tests refuse:
an architecture transformers does not load from GGUF, a quantisation type the gguf package
cannot dequantise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
SPECIALS = ["<s>", "</s>", "<|endoftext|>"]  # the last: GPT-2's, which transformers adds


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order (byte-level BPE's
    alphabet: printable Latin-1 bytes stand for themselves, the others for chr(256 + k))."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def vocabulary() -> list[str]:
    symbols = byte_symbols()
    return symbols + ["".join(m.split(" ")) for m in MERGES] + SPECIALS


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    context: int = 512,
    add_bos: bool = True,
    arch: str = "llama",
    bad_quant: str | None = None,
) -> Path:
    """A tiny Llama GGUF at ``path``; ``context``: its llama.context_length (the trained
    context); ``add_bos``: whether its tokenizer adds ``<s>``; ``arch``: the architecture it
    declares; ``bad_quant``: the name of a quantisation type to store one tensor in."""
    import gguf

    tokens = vocabulary()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    _metadata(w, arch, context, len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_add_bos_token(add_bos)
    for name, array, kind in _tensors(rng, len(tokens)):
        if bad_quant and name == "blk.0.attn_q.weight":
            kind = bad_quant
        _add(w, name, array, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(w, arch: str, context: int, vocab: int) -> None:
    w.add_name("ringctl tiny test llama")
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)


def _tensors(rng, vocab: int):
    """(GGUF name, float32 array in transformers' (out, in) shape, storage type)."""

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    kv = KV_HEADS * HIDDEN // HEADS
    yield "token_embd.weight", matrix(vocab, HIDDEN), "Q8_0"
    for i in range(LAYERS):
        yield f"blk.{i}.attn_norm.weight", norm(), "F32"
        yield f"blk.{i}.attn_q.weight", matrix(HIDDEN, HIDDEN), "Q4_1"
        yield f"blk.{i}.attn_k.weight", matrix(kv, HIDDEN), "Q4_1"
        yield f"blk.{i}.attn_v.weight", matrix(kv, HIDDEN), "Q8_0"
        yield f"blk.{i}.attn_output.weight", matrix(HIDDEN, HIDDEN), "Q4_1"
        yield f"blk.{i}.ffn_norm.weight", norm(), "F32"
        yield f"blk.{i}.ffn_gate.weight", matrix(FFN, HIDDEN), "Q4_1"
        yield f"blk.{i}.ffn_up.weight", matrix(FFN, HIDDEN), "Q4_1"
        yield f"blk.{i}.ffn_down.weight", matrix(HIDDEN, FFN), "F16"
    yield "output_norm.weight", norm(), "F32"


def _add(w, name: str, array: np.ndarray, kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, array)
    elif kind == "F16":
        w.add_tensor(name, array.astype(np.float16))
    elif _can_quantise(qtype):
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    else:  # a type the package cannot make either: raw bytes of the right size
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)


def _can_quantise(qtype) -> bool:
    import gguf

    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True
