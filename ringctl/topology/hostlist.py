"""Slurm hostlist expressions: `gpu[001-004,010]`, `rack[1-2]-n[01-02]`, `a1,b[3-4]`.

Our own small parser (no third-party hostlist library, so no licence to track). The rules are
Slurm's: top-level commas separate items; inside brackets, commas separate pieces and `a-b`
is a range whose numbers are zero-padded to the width of `a` (`[08-10]` gives 08, 09, 10 and
`[8-10]` gives 8, 9, 10); several bracket groups in one item expand as a product, leftmost
slowest; order is kept and duplicates are not removed, because Slurm's task order follows it.
"""

from __future__ import annotations

import re

__all__ = ["HostlistError", "expand", "compress"]

_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")


class HostlistError(ValueError):
    """A malformed hostlist expression; the message says where."""


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' at position {i} in {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"']' without '[' at position {i} in {expr!r}")
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"'[' not closed in {expr!r}")
    items.append(expr[start:])
    return items


def _expand_bracket(body: str, expr: str) -> list[str]:
    """`001-004,010` -> ['001', '002', '003', '004', '010'] (padding from each lower bound)."""
    out: list[str] = []
    for piece in body.split(","):
        piece = piece.strip()
        lo, sep, hi = piece.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"expected a number or a range a-b in [{body}] of {expr!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise HostlistError(f"range {piece} runs backwards in {expr!r}")
        if b - a > 1_000_000:
            raise HostlistError(f"range {piece} is too large in {expr!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _expand_item(item: str, expr: str) -> list[str]:
    parts = re.split(r"(\[[^\]]*\])", item)
    names = [""]
    for part in parts:
        if part.startswith("["):
            choices = _expand_bracket(part[1:-1], expr)
        else:
            if "]" in part:
                raise HostlistError(f"']' without '[' in {expr!r}")
            choices = [part]
        names = [n + c for n in names for c in choices]
    return names


def expand(expr: str) -> list[str]:
    """Every host name of a hostlist expression, in Slurm's order (no sorting, no dedup)."""
    expr = expr.strip()
    if not expr:
        return []
    out: list[str] = []
    for item in _split_top_level(expr):
        item = item.strip()
        if not item:
            raise HostlistError(f"empty item in {expr!r}")
        out.extend(_expand_item(item, expr))
    return out


def compress(names: list[str]) -> str:
    """A short hostlist expression that `expand` turns back into exactly `names`, order kept.

    Only neighbouring names sharing a prefix are merged, so the order survives; a name that
    cannot be written inside a hostlist (it holds `[`, `]` or `,`) raises HostlistError.
    """
    items: list[tuple[str, list[list[str]]]] = []  # (prefix, pieces [first, last-or-first])
    for name in names:
        if not name or any(c in name for c in "[],") or name != name.strip():
            raise HostlistError(f"{name!r} cannot be written in a hostlist")
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
