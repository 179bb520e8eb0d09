"""Text -> token ids, offline.

Which tokenizer (``resolve_tokenizer_path``): ``tokenizer_path`` when given; else the model
directory's own tokenizer when it has one (``tokenizer.json``, ``tokenizer_config.json``,
``tokenizer.model``); else bytes. ``tokenizer_path: bytes`` asks for bytes explicitly. Bytes fit
only a model whose vocabulary is the 256 byte values (the bundled model, or a .json config with
``vocab_size: 256``): any other is refused (``vocabulary_mismatch``), since byte ids fed to a
model trained on another vocabulary give plausible-looking garbage.

* ``ByteTokenizer`` (``tokenizer_path=None`` and no tokenizer with the model): the document's
  UTF-8 bytes are the ids (vocabulary 256). Nothing to download; lossless, invalid UTF-8
  included. It adds no BOS token, so the first byte of a document is context only and is never
  scored.
* ``HFTokenizer``: ``AutoTokenizer.from_pretrained(local_dir)`` with ``HF_HUB_OFFLINE=1`` (a hub
  id fails at once instead of hanging). It gets the text with U+FFFD for invalid bytes, and
  adds the tokenizer's special tokens (e.g. a BOS) as the model was trained with.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256

    def encode(self, raw: bytes) -> torch.Tensor:
        if not raw:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def describe(self) -> dict:
        return {"kind": self.name, "vocab_size": self.vocab_size}


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer_path {str(path)!r} is not a local directory (no download is done: "
                "save the tokenizer with save_pretrained and give its directory)"
            )
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoTokenizer

        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
        self.vocab_size = len(self.tok)
        self.name = f"hf:{self.path}"

    def encode(self, raw: bytes) -> torch.Tensor:
        text = raw.decode("utf-8", "replace")
        ids = self.tok(text, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)

    def describe(self) -> dict:
        return {"kind": "hf", "path": self.path, "vocab_size": self.vocab_size}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer_path(tokenizer_path: str | None, model_path: str | None) -> str | None:
    """The tokenizer directory a job uses (None: bytes); see the module docstring."""
    if tokenizer_path == "bytes":
        return None
    if tokenizer_path:
        return tokenizer_path
    if model_path and Path(model_path).is_dir():
        if any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
            return model_path
    return None


def vocabulary_mismatch(tokenizer_vocab: int, model_vocab: int, *, is_bytes: bool) -> str:
    """Why these cannot work together, or ""."""
    if is_bytes and model_vocab != ByteTokenizer.vocab_size:
        return (
            f"the byte-level tokenizer (256 ids) does not match the model's vocabulary "
            f"({model_vocab}) and the model directory has no tokenizer files: give "
            "task.tokenizer_path"
        )
    if tokenizer_vocab > model_vocab:
        return (
            f"the tokenizer's vocabulary ({tokenizer_vocab}) is larger than the model's "
            f"({model_vocab})"
        )
    return ""


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if path in (None, "", "bytes") else HFTokenizer(path)
