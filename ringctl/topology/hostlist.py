"""Slurm hostlist expressions: `gpu[001-004,010]`, `rack[1-2]-n[01-02]`, `a1,b[3-4]`.

Our own small parser (no third-party hostlist library, so no licence to track). The rules are
Slurm's: top-level commas separate items; inside brackets, commas separate pieces and `a-b`
is a range whose numbers are zero-padded to the width of `a` (`[08-10]` gives 08, 09, 10 and
`[8-10]` gives 8, 9, 10); several bracket groups in one item expand as a product, leftmost
slowest; order is kept and duplicates are not removed, because Slurm's task order follows it.

Expansion is bounded: the number of names an expression stands for is counted from its bracket
ranges first (no name is built), and an expression over MAX_HOSTS names is refused with one
line. Without the count, `a[1-1000]b[1-1000]c[1-1000]` (10^9 names) would take gigabytes
before failing; with it, a typo costs nothing. MAX_HOSTS is far above any real cluster (the
largest have tens of thousands of nodes) and still leaves `n[1-1000000]` expandable.

Numbers in brackets are ASCII digits, at most MAX_DIGITS of them (see text.py): '²' and '١'
pass `str.isdigit()`, and `int()` refuses the one with a traceback and reads the other as 1.
An error quotes at most ECHO_CHARS of the expression.
"""

from __future__ import annotations

import re

from ..text import echo, is_ascii_number

__all__ = ["MAX_HOSTS", "HostlistError", "compress", "count", "expand"]

MAX_HOSTS = 2_000_000
# Digits of one bracket number: Slurm keeps them in an unsigned long (up to 20 digits); 18 keep
# every count and range within 10^18, far past any padded node number.
MAX_DIGITS = 18

_TRAILING_DIGITS = re.compile(r"^(.*?)([0-9]+)$")


class HostlistError(ValueError):
    """A malformed hostlist expression; the message says where."""


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' at position {i} in {echo(expr)}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"']' without '[' at position {i} in {echo(expr)}")
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"'[' not closed in {echo(expr)}")
    items.append(expr[start:])
    return items


def _bracket_pieces(body: str, expr: str) -> list[tuple[str, str | None]]:
    """`001-004,010` -> [('001', '004'), ('010', None)], checked but not expanded."""
    pieces: list[tuple[str, str | None]] = []
    for piece in body.split(","):
        piece = piece.strip()
        lo, sep, hi = piece.partition("-")
        if not is_ascii_number(lo, MAX_DIGITS) or (sep and not is_ascii_number(hi, MAX_DIGITS)):
            raise HostlistError(
                f"expected a number (ASCII digits, at most {MAX_DIGITS}) or a range a-b in "
                f"{echo('[' + body + ']')} of {echo(expr)}"
            )
        if sep and int(hi) < int(lo):
            raise HostlistError(f"range {piece} runs backwards in {echo(expr)}")
        pieces.append((lo, hi if sep else None))
    return pieces


def _pieces_count(pieces: list[tuple[str, str | None]]) -> int:
    return sum(1 if hi is None else int(hi) - int(lo) + 1 for lo, hi in pieces)


def _expand_pieces(pieces: list[tuple[str, str | None]]) -> list[str]:
    """Names of checked pieces (padding from each lower bound)."""
    out: list[str] = []
    for lo, hi in pieces:
        if hi is None:
            out.append(lo)
            continue
        width = len(lo)
        numbers = range(int(lo), int(hi) + 1)
        out.extend(map(str, numbers) if width == 1 else (str(n).zfill(width) for n in numbers))
    return out


def _parse_item(item: str, expr: str) -> list[str | list[tuple[str, str | None]]]:
    """An item as its literal parts (str) and bracket pieces (list), in order."""
    parts: list[str | list[tuple[str, str | None]]] = []
    for part in re.split(r"(\[[^\]]*\])", item):
        if part.startswith("["):
            parts.append(_bracket_pieces(part[1:-1], expr))
        elif "]" in part:
            raise HostlistError(f"']' without '[' in {echo(expr)}")
        elif part:
            parts.append(part)
    return parts


def _parse(expr: str) -> list[list[str | list[tuple[str, str | None]]]]:
    items = []
    for item in _split_top_level(expr):
        item = item.strip()
        if not item:
            raise HostlistError(f"empty item in {echo(expr)}")
        items.append(_parse_item(item, expr))
    return items


def _count_parsed(items, expr: str, limit: int) -> int:
    """Names the parsed items stand for; refused as soon as the running total passes limit."""
    total = 0
    for parts in items:
        size = 1
        for part in parts:
            if isinstance(part, list):
                size *= _pieces_count(part)
                if size > limit:
                    break
        total += size
        if total > limit:
            raise HostlistError(
                f"{echo(expr)} stands for more than {limit:,} host names; refusing to expand it"
            )
    return total


def count(expr: str, limit: int = MAX_HOSTS) -> int:
    """How many names `expand(expr)` gives, without building them (refused above `limit`)."""
    expr = expr.strip()
    return _count_parsed(_parse(expr), expr, limit) if expr else 0


def expand(expr: str, limit: int = MAX_HOSTS) -> list[str]:
    """Every host name of a hostlist expression, in Slurm's order (no sorting, no dedup).

    Raises HostlistError for a malformed expression or one over `limit` names (counted before
    anything is allocated)."""
    expr = expr.strip()
    if not expr:
        return []
    items = _parse(expr)
    _count_parsed(items, expr, limit)
    out: list[str] = []
    for parts in items:
        names = [""]
        for part in parts:
            choices = _expand_pieces(part) if isinstance(part, list) else [part]
            if len(names) == 1:
                prefix = names[0]
                names = [prefix + c for c in choices] if prefix else choices
            else:
                names = [n + c for n in names for c in choices]
        out.extend(names)
    return out


def compress(names: list[str]) -> str:
    """A short hostlist expression that `expand` turns back into exactly `names`, order kept.

    Only neighbouring names sharing a prefix are merged, so the order survives; a name that
    cannot be written inside a hostlist (it holds `[`, `]` or `,`) raises HostlistError.
    """
    items: list[tuple[str, list[list[str]]]] = []  # (prefix, pieces [first, last-or-first])
    for name in names:
        if not name or any(c in name for c in "[],") or name != name.strip():
            raise HostlistError(f"{echo(name)} cannot be written in a hostlist")
        m = _TRAILING_DIGITS.match(name)
        if not m:
            items.append((name, []))
            continue
        prefix, digits = m.groups()
        if items and items[-1][1] and items[-1][0] == prefix:
            pieces = items[-1][1]
            first, last = pieces[-1]
            width = len(first)
            n = int(digits)
            if n == int(last) + 1 and str(n).zfill(width) == digits:
                pieces[-1][1] = digits
            else:
                pieces.append([digits, digits])
        else:
            items.append((prefix, [[digits, digits]]))
    out = []
    for prefix, pieces in items:
        if not pieces:
            out.append(prefix)
        elif len(pieces) == 1 and pieces[0][0] == pieces[0][1]:
            out.append(prefix + pieces[0][0])
        else:
            body = ",".join(a if a == b else f"{a}-{b}" for a, b in pieces)
            out.append(f"{prefix}[{body}]")
    return ",".join(out)
