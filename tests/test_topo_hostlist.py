"""The hostlist parser: Slurm's rules on examples, and round trips as properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringctl.topology.hostlist import HostlistError, compress, expand


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
        ("tux[8-10]", ["tux8", "tux9", "tux10"]),
        ("tux[08-10]", ["tux08", "tux09", "tux10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("my-long-prefix-[3,1]", ["my-long-prefix-3", "my-long-prefix-1"]),
        ("a,b,a", ["a", "b", "a"]),
        ("[7-8]x", ["7x", "8x"]),
        ("", []),
    ],
)
def test_expand_examples(expr, names):
    assert expand(expr) == names


@pytest.mark.parametrize("expr", ["n[1-", "n]1[", "n[[1]]", "n[a-b]", "n[5-3]", "n[1-2],,m", "n[]"])
def test_expand_refuses_malformed(expr):
    with pytest.raises(HostlistError):
        expand(expr)


def test_compress_examples():
    assert compress(["gpu001", "gpu002", "gpu003", "gpu010"]) == "gpu[001-003,010]"
    assert compress(["n8", "n9", "n10", "n010", "n011"]) == "n[8-10,010-011]"
    assert compress(["b2", "a1", "b3"]) == "b2,a1,b3"  # order kept, so no merging across a1
    assert compress(["login", "n1"]) == "login,n1"
    with pytest.raises(HostlistError):
        compress(["bad,name"])


prefix = st.text(alphabet="abcxyz-", min_size=0, max_size=4)
number = st.integers(min_value=0, max_value=120)
width = st.integers(min_value=0, max_value=3)


@st.composite
def host(draw) -> str:
    p = draw(prefix)
    if draw(st.booleans()):
        n, w = draw(number), draw(width)
        return p + str(n).zfill(w)
    return p or "h"


@st.composite
def runs(draw) -> tuple[list[str], int]:
    """Host lists made of consecutive runs, as real allocations are; and how many runs."""
    out: list[str] = []
    count = draw(st.integers(0, 4))
    for _ in range(count):
        p, start, w = draw(prefix), draw(number), draw(width)
        out += [p + str(n).zfill(w) for n in range(start, start + draw(st.integers(1, 12)))]
    return out, count


@settings(max_examples=300, deadline=None)
@given(st.lists(host(), max_size=25) | runs().map(lambda r: r[0]))
def test_expand_compress_round_trip(names):
    text = compress(names)
    assert expand(text) == names
    assert compress(expand(text)) == text


def _top_level_items(text: str) -> int:
    depth, items = 0, 1 if text else 0
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        items += ch == "," and depth == 0
    return items


@settings(max_examples=200, deadline=None)
@given(runs())
def test_compress_writes_each_run_as_at_most_one_item(drawn):
    names, count = drawn
    assert _top_level_items(compress(names)) <= count
