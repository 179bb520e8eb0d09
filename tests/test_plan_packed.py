"""The planner prices a packed sequence by its visible pairs (the sum over its documents):
one document packed alone costs what the document costs; a thousand short documents cost the
projections of all their tokens and the attention of their own pairs, not that of one long
document; under a window, the window's pairs."""

from __future__ import annotations

import pytest

from ringctl.planner.cost import Workload
from ringctl.planner.devices import get_device
from ringctl.planner.model import presets
from ringctl.planner.pricing import document_cost, packed_cost

H100 = get_device("H100-SXM")
L8 = presets()["llama3-8b"]
SCORE = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, model=L8, mode="score")


def test_one_document_packed_alone_costs_what_it_costs():
    n = 32768  # a multiple of 2P: no padding either way
    assert packed_cost([n], 8, SCORE, H100) == pytest.approx(
        document_cost(n, 8, SCORE, H100), rel=1e-3
    )


def test_short_documents_cost_their_own_pairs():
    many = [256] * 512  # 131072 tokens
    one = document_cost(131072, 8, SCORE, H100)
    packed = packed_cost(many, 8, SCORE, H100)
    assert packed < one / 2  # attention of 512 x 256^2 / 2 pairs, not 131072^2 / 2
    attention_only = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, mode="score")
    ratio = packed_cost(many, 8, attention_only, H100) / document_cost(
        131072, 8, attention_only, H100
    )
    assert ratio == pytest.approx(512 * 256 * 257 / (131072 * 131073), rel=0.05)


def test_a_window_prices_the_windows_pairs():
    windowed = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, mode="score", window=4096)
    plain = Workload(seq_len=0, heads=32, kv_heads=8, head_dim=128, mode="score")
    docs = [65536, 65536]
    assert packed_cost(docs, 8, windowed, H100) < packed_cost(docs, 8, plain, H100) / 4
