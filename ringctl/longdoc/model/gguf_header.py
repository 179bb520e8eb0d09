"""A GGUF file's header walked within its size before the gguf package reads it.

gguf's reader builds a Python object per array element as the header claims them: a 94-byte
file claiming an array of 2**50 elements hung `ringctl submit` (and every rank) in its loop,
holding the conversion's lock, and ended in MemoryError. Here every count is checked against
the bytes left in the file before anything is built: an array of N items of a fixed size needs
N x size bytes, of strings at least N x 8 (each a length and its bytes), and each tensor's
record at least 24. A walk over a real header (SmolLM2: 49k vocabulary strings) takes
milliseconds; a lying one is refused naming the field.

The layout (ggml's docs/gguf.md, little-endian): magic "GGUF", version u32, tensor count u64,
key-value count u64; each key-value: key (u64 length + bytes), value type u32, value; an
array value: item type u32, count u64, items; a string: u64 length + bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b"GGUF"
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type: bytes
STRING, ARRAY = 8, 9
MIN_TENSOR_RECORD = 8 + 4 + 4 + 8  # name length, dims, type, offset (a name and dims more)


class _Header:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 (closed by header_refusal)
        self.left = path.stat().st_size

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise ValueError(f"{what} claims {n:,} bytes, {self.left:,} are left in the file")
        self.left -= n
        return self.f.read(n)

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def skip_string(self, what: str) -> None:
        self._skip(self.u64(what), what)

    def _skip(self, n: int, what: str) -> None:
        if n > self.left:
            raise ValueError(f"{what} claims {n:,} bytes, {self.left:,} are left in the file")
        self.f.seek(n, 1)
        self.left -= n

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in FIXED:
            self._skip(FIXED[kind], what)
        elif kind == STRING:
            self.skip_string(what)
        elif kind == ARRAY and depth < 4:
            item, count = self.u32(what), self.u64(what)
            least = FIXED.get(item, 8)  # a string or an array: at least its u64 length
            if count * least > self.left:
                raise ValueError(
                    f"{what}: an array of {count:,} items needs at least {count * least:,} "
                    f"bytes, {self.left:,} are left in the file"
                )
            if item in FIXED:
                self._skip(count * FIXED[item], what)
            else:
                for _ in range(count):  # bounded: each item takes 8 bytes or more
                    self.skip_value(item, what, depth + 1)
        else:
            raise ValueError(f"{what}: value type {kind} is not one GGUF has")


def header_refusal(path: Path) -> str | None:
    """Why the header of the GGUF file ``path`` cannot be what it claims, in one line naming
    the file and the field, or None (then the gguf package may read it)."""
    try:
        h = _Header(path)
    except OSError as err:
        return f"{path}: cannot be read ({err.strerror})"
    try:
        if h.take(4, "the magic") != MAGIC:
            return f"{path}: not a GGUF file (no GGUF magic)"
        h.u32("the version")
        tensors, fields = h.u64("the tensor count"), h.u64("the field count")
        for i in range(fields):
            if 8 * 2 > h.left:
                raise ValueError(f"field {i + 1} of {fields:,} is past the end of the file")
            key_length = h.u64(f"field {i + 1}'s key")
            key = h.take(key_length, f"field {i + 1}'s key").decode("utf-8", "replace")
            h.skip_value(h.u32(key), key)
        if tensors * MIN_TENSOR_RECORD > h.left:
            return (
                f"{path}: {tensors:,} tensors need at least {tensors * MIN_TENSOR_RECORD:,} "
                f"bytes of records, {h.left:,} are left in the file"
            )
    except (ValueError, struct.error) as err:
        return f"{path}: not a GGUF file the gguf package can read (header: {err})"
    finally:
        h.f.close()
    return None
