"""Text -> token ids, offline.

Which tokenizer (``names.resolve_tokenizer_path``): ``tokenizer_path`` when given; else the model
directory's own tokenizer when it has one (``tokenizer.json``, ``tokenizer_config.json``,
``tokenizer.model``; a GGUF file's is in the file, saved with its conversion); else bytes.
``tokenizer_path: bytes`` asks for bytes explicitly. Bytes fit only a model whose vocabulary is
the 256 byte values (the bundled model, or a .json config with ``vocab_size: 256``): any other
is refused (``vocabulary_mismatch``), since byte ids fed to a
model trained on another vocabulary give plausible-looking garbage.

* ``ByteTokenizer`` (``tokenizer_path=None`` and no tokenizer with the model): the document's
  UTF-8 bytes are the ids (vocabulary 256). Nothing to download; lossless, invalid UTF-8
  included. It adds no BOS token, so the first byte of a document is context only and is never
  scored.
* ``HFTokenizer``: ``AutoTokenizer.from_pretrained(local_dir)`` with ``HF_HUB_OFFLINE=1`` (a hub
  id fails at once instead of hanging). It gets the text with U+FFFD for invalid bytes, and
  adds the tokenizer's special tokens (e.g. a BOS) as the model was trained with.

**Scored bytes** (``scored_bytes``, the denominator of bits per byte for every tokenizer). A
document's token ``ids[0]`` is context only: scoring predicts ``ids[1:]``. Its scored bytes
are the UTF-8 bytes of the text after the end of its first token: the document's UTF-8 length
less the bytes of ``text[:end]``, ``end`` the first token's end offset in the text (the
tokenizer's own offsets). So: the byte tokenizer, N - 1; a tokenizer that adds a BOS token
(which covers no text, offsets (0, 0)), every byte; one that adds none (SmolLM2), every byte
but those of the first word piece. The text is the one the tokenizer was given (invalid UTF-8
as U+FFFD, 3 bytes each); fewer than 2 tokens score nothing (None).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .directory import check_model_directory
from .hub import go_offline


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256

    def encode(self, raw: bytes) -> torch.Tensor:
        if not raw:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def describe(self) -> dict:
        return {"kind": self.name, "vocab_size": self.vocab_size}

    def scored(self, raw: bytes) -> tuple[torch.Tensor, int | None]:
        """(ids, scored bytes: every byte but the first; see the module docstring)."""
        return self.encode(raw), (len(raw) - 1 if len(raw) >= 2 else None)


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer_path {str(path)!r} is not a local directory (no download is done: "
                "save the tokenizer with save_pretrained and give its directory)"
            )
        check_model_directory(path)  # no file of it read from elsewhere
        go_offline()
        from transformers import AutoTokenizer

        self.path = str(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
        except Exception as err:  # the tokenizers library raises its own (a bare Exception)
            said = " ".join(str(err).split())[:300]
            raise ValueError(
                f"{self.path}: the tokenizer cannot be loaded ({type(err).__name__}: {said})"
            ) from None
        self.vocab_size = len(self.tok)
        self.name = f"hf:{self.path}"

    def encode(self, raw: bytes) -> torch.Tensor:
        text = raw.decode("utf-8", "replace")
        ids = self.tok(text, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)

    def describe(self) -> dict:
        return {"kind": "hf", "path": self.path, "vocab_size": self.vocab_size}

    def scored(self, raw: bytes) -> tuple[torch.Tensor, int | None]:
        """(ids as ``encode`` gives them, scored bytes: the UTF-8 bytes after the end of the
        first token, by the tokenizer's own offsets; None with fewer than 2 tokens, or for a
        tokenizer without offsets)."""
        text = raw.decode("utf-8", "replace")
        try:
            enc = self.tok(
                text,
                add_special_tokens=True,
                return_attention_mask=False,
                return_offsets_mapping=True,
            )
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets
            return self.encode(raw), None
        ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
        if ids.numel() < 2:
            return ids, None
        end = int(enc["offset_mapping"][0][1])
        return ids, len(text.encode("utf-8")) - len(text[:end].encode("utf-8"))


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
