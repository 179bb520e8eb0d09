"""Tiny models and the single-process reference for the long-document tests (no tests here).

The reference is the stock transformers model (``eager`` or ``sdpa`` attention) on the whole,
unsharded document in one process: full logits, log-softmax, labels shifted by one, HF's own
hidden states, and autograd on the mean NLL. Nothing in it goes through ringattn or the
longdoc code, except the seeded construction (so both sides hold identical weights).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 1234

# 2 layers, hidden 64, 4 heads, 2 KV heads (GQA), vocabulary 256 = the byte tokenizer.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MODEL_CONFIGS = {
    "llama": dict(model_type="llama", rope_theta=10000.0, **TINY),
    "qwen2": dict(model_type="qwen2", rope_theta=10000.0, use_sliding_window=False, **TINY),
    # A sliding window shorter than every ring's blocks at N=301: the ring windows it.
    "mistral-window16": dict(model_type="mistral", rope_theta=10000.0, sliding_window=16, **TINY),
}


def build(kind: str, attn_implementation: str):
    """A tiny random-initialised model (seeded: the same weights in every process)."""
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    config = AutoConfig.for_model(**MODEL_CONFIGS[kind])
    model = build_random(
        config, seed=SEED, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def document(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed + n))


def reference(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """token_logprob (N-1,), hidden (N, H), loss and grads of the mean NLL (N >= 2)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    logits = out.logits[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    result = {"token_logprob": lp.detach(), "hidden": out.hidden_states[-1][0].detach()}
    if ids.numel() >= 2:
        loss = -lp.mean()
        loss.backward()
        result["loss"] = loss.detach()
        result["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    return result


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (scale-free; 0 for two empty tensors)."""
    if ref.numel() == 0:
        return 0.0 if x.numel() == 0 else float("inf")
    return ((x.double() - ref.double()).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def unshard(per_rank: list[dict], name: str, n: int) -> torch.Tensor:
    """The whole document's ``name`` from every rank's shard (by its ``positions``), each
    position covered exactly once (asserted)."""
    first = per_rank[0][name]
    full = torch.full((n, *first.shape[1:]), float("nan"), dtype=torch.float32)
    seen = torch.zeros(n, dtype=torch.int64)
    for t in per_rank:
        full[t["positions"]] = t[name].float()
        seen[t["positions"]] += 1
    assert torch.equal(seen, torch.ones(n, dtype=torch.int64)), f"coverage {seen.tolist()}"
    return full


def word_model(root: Path) -> Path:
    """A saved tiny Llama (vocabulary 3: "abcdefghij", "a", unknown) with a word-level
    tokenizer in its directory: one token per word ("abcdefghij " is 11 bytes a token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from ringctl.longdoc.model.load import build_random

    folder = root / "words"
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "abcdefghij": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    build_random(config, seed=1, dtype=torch.float32, attn_implementation="eager").save_pretrained(
        folder
    )
    return folder
