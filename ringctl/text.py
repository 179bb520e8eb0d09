"""Two small rules for text this tool did not write (tool outputs, files, job records).

`echo`: an error quotes the offending word, cut to ECHO_CHARS: the inputs come from files and
stdin of any size, and a one-line error that repeats a 50 MB word (or 50 MB of NULs) is neither
one line nor readable.

`ascii_number`: a count or index is ASCII digits, and not too many of them. `str.isdigit()`
also accepts '²' (which `int()` then refuses with a traceback) and '١' (which `int()` silently
reads as 1, so `n[١-٣]` named n1..n3); more than 4,300 digits make `int()` raise too.
"""

from __future__ import annotations

__all__ = ["ECHO_CHARS", "ascii_number", "cut", "echo", "is_ascii_number"]

ECHO_CHARS = 80


def cut(value: object, limit: int = ECHO_CHARS) -> str:
    """value's text, cut to `limit` characters with '...' when longer."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """`repr` of value's text cut to `limit` characters (see `cut`)."""
    return repr(cut(value, limit))


def is_ascii_number(value: str, max_digits: int) -> bool:
    """Whether value is 1..max_digits ASCII digits (nothing else: no sign, blank or '_')."""
    return 0 < len(value) <= max_digits and value.isascii() and value.isdigit()


def ascii_number(value: str, max_digits: int) -> int | None:
    """The number value spells in ASCII digits, or None when it is not one (see above)."""
    return int(value) if is_ascii_number(value, max_digits) else None
