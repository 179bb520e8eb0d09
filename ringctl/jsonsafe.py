"""Strict JSON: no NaN or Infinity, which Python's json writes and reads by default but which
is not JSON (jq, JavaScript's JSON.parse and most other readers refuse the whole document).

`finite_json` replaces every non-finite float with null and says where it found them, so a
writer can keep its files strict and a reader of a fetched file (a job's progress, a shard's
entry) can pass its values on with a note instead of a crash.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_json", "whole_number"]


def finite_json(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """(obj with each NaN/inf float, in any dict or list, replaced by None; the places replaced,
    as dotted keys and [indices] below `where`)."""
    replaced: list[str] = []
    return _walk(obj, where, replaced), replaced


def _walk(obj: Any, where: str, replaced: list[str]) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        replaced.append(where or "(the value)")
        return None
    if isinstance(obj, dict):
        return {k: _walk(v, f"{where}.{k}" if where else str(k), replaced) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(v, f"{where}[{i}]", replaced) for i, v in enumerate(obj)]
    return obj


def whole_number(value: Any, least: int = 0, most: int | None = None) -> bool:
    """An int read from a file (not a bool, not a float equal to one) in [least, most]."""
    return type(value) is int and value >= least and (most is None or value <= most)
