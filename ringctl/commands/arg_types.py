"""Command-line numbers checked where argparse reads them: a count below its least, past its
most, or a rate that is not a finite positive number is refused with argparse's one line
(``argument --seq: ...``), before a planner prints nonsense from it with exit 0 (a negative
sequence priced at negative GiB, a NaN link at "nan ms") or a Python error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..config import MAX_RANKS

MAX_TOKENS = 1 << 40  # a sequence's tokens: far past any job, short of the planner's overflow


def whole(least: int = 1, most: int = MAX_TOKENS) -> Callable[[str], int]:
    """An argparse type: a whole number in [least, most]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be from {least} to {most:,}, got {value}")
        return value

    return parse


def ranks(text: str) -> int:
    """An argparse type: a number of ranks (or nodes), 1 to MAX_RANKS."""
    return whole(1, MAX_RANKS)(text)


def finite(least: float = 0.0, *, above: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number above ``least`` (or at least it, ``above=False``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low = value > least if above else value >= least
        if not (math.isfinite(value) and low):
            sign = ">" if above else ">="
            raise argparse.ArgumentTypeError(f"must be a finite number {sign} {least}, got {text}")
        return value

    return parse
