"""Text that came from elsewhere (rank logs, document ids, file names), made safe to print.

A rank log is written by the job, which on a remote cluster anyone with that account can
change; a document id comes from a file name or a record. Printed as they are, an ESC or OSC
sequence in them drives the reader's terminal (colours, the window title, hyperlinks, on some
terminals the clipboard), and a newline or carriage return splits or overwrites a table row.
`visible` writes such characters as escapes (`\\x1b`, `\\r`, `\\u2028`), so what is printed is
what is there.
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable
from typing import TextIO

__all__ = ["console", "for_terminal", "visible"]

# Unicode's control (Cc: C0, DEL, C1), surrogate (Cs: undecodable bytes kept by
# surrogateescape), line and paragraph separator (Zl, Zp) categories, and the bidirectional
# embeddings, overrides and isolates (which reorder what is shown).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_BIDI = frozenset(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, keep: str = "") -> str:
    """text with every control, surrogate, separator and bidi character but those in `keep`
    written as a backslash escape; the rest (backslashes included) unchanged."""
    if text.isprintable():  # the common case, in C
        return text
    return "".join(
        _escape(ch)
        if ch not in keep and (ch in _BIDI or unicodedata.category(ch) in _ESCAPED_CATEGORIES)
        else ch
        for ch in text
    )


def for_terminal(stream: TextIO | None = None) -> Callable[[str], str]:
    """How to print log lines on `stream` (default stdout), asked once: escaped (tabs and
    newlines kept) when it is a terminal; unchanged when it is a pipe or a file, where the
    reader asked for the bytes as they are."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: not a terminal
        tty = False
    if not tty:
        return str
    return lambda line: visible(line, keep="\t\n")


def console(**options):
    """A rich Console whose writes to a reader gone away (`ringctl plan | head`) raise
    BrokenPipeError, as print's do, so `ringctl.cli` exits 141 as documented: rich's own
    handler exited 1, which is `plan`'s "does not fit"."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console(**options)
