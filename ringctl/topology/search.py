"""Exact search for the best order of k of n vertices, as a cycle or as a path.

The quality of an order is the key (bottleneck, -hops at the bottleneck, total bandwidth),
compared lexicographically: the slowest hop sets the pace of the whole ring, then fewer hops at
that pace, then more bandwidth overall. The search is exact for up to EXACT_LIMIT vertices:

1. binary search over the distinct bandwidth levels for the highest level t at which an order
   using only links of at least t exists (this is how an all-NVLink cycle of a hybrid
   cube-mesh is found even where index order is not one);
2. at that level, a dynamic programme over subsets (Held-Karp) maximising
   `total - BIG * hops_at_t`, which is additive, so keeping the best per (subset, end) is exact.

A path may carry weights on its first and last vertex (`start_w`, `end_w`): the placement uses
them for the link from the node's NIC to its entry and exit GPU, so the same key also prefers
entry and exit GPUs close to a fast NIC. Above EXACT_LIMIT vertices a greedy order improved by
2-opt moves is used (16-GPU nodes are NVSwitch machines whose links are all equal anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EXACT_LIMIT", "MAX_STARTS", "best_order", "order_key"]

EXACT_LIMIT = 12
# Starting points of the heuristic above EXACT_LIMIT: every vertex up to 16 GPUs (the largest
# nodes built, DGX-2/HGX-2, so their orders are as before), 16 spread over the indices above.
# Every start costing O(k^3) per 2-opt pass, all n of them took 3.6 s at 64 GPUs, 17 s at 96.
MAX_STARTS = 16

Weights = Sequence[Sequence[float]]


def _edges(order: Sequence[int], w: Weights, cycle: bool, start_w, end_w) -> list[float]:
    edges = [w[a][b] for a, b in zip(order, order[1:], strict=False)]
    if cycle and len(order) > 1:
        edges.append(w[order[-1]][order[0]])
    if not cycle and start_w is not None:
        edges.append(start_w[order[0]])
    if not cycle and end_w is not None:
        edges.append(end_w[order[-1]])
    return edges


def order_key(
    order: Sequence[int],
    w: Weights,
    cycle: bool,
    start_w: Sequence[float] | None = None,
    end_w: Sequence[float] | None = None,
) -> tuple[float, int, float]:
    """(bottleneck, -number of hops at the bottleneck, total): larger is better."""
    edges = _edges(order, w, cycle, start_w, end_w)
    if not edges:
        return (float("inf"), 0, 0.0)
    low = min(edges)
    return (low, -sum(1 for e in edges if e == low), sum(edges))


def _dp(w, k, t, big, starts, finish, allowed):
    """Held-Karp over subsets of `allowed`: the best path of k vertices using links >= t.

    Scores are `total - big * hops_at_t`. starts: {v: score of starting at v};
    finish(v): score added for ending at v, or None where v may not end the path.
    Returns (score, order) or None when no such path exists.
    """
    best: dict[tuple[int, int], float] = {(1 << v, v): s for v, s in starts.items()}
    parent: dict[tuple[int, int], int] = {}
    frontier = list(best)
    for _ in range(k - 1):
        nxt: dict[tuple[int, int], float] = {}
        for mask, v in frontier:
            base = best[(mask, v)]
            row = w[v]
            for u in allowed:
                bit = 1 << u
                if mask & bit or row[u] < t:
                    continue
                key = (mask | bit, u)
                score = base + (row[u] - big if row[u] == t else row[u])
                if score > nxt.get(key, -float("inf")):
                    nxt[key] = score
                    parent[key] = v
        best.update(nxt)
        frontier = list(nxt)
    result = None
    for mask, v in frontier:
        extra = finish(v)
        if extra is not None and (result is None or best[(mask, v)] + extra > result[0]):
            result = (best[(mask, v)] + extra, mask, v)
    if result is None:
        return None
    score, mask, v = result
    order = [v]
    while mask & (mask - 1):
        prev = parent[(mask, v)]
        mask ^= 1 << v
        v = prev
        order.append(v)
    return score, order[::-1]


def _exact(w, k, cycle, start_w, end_w, t, big):
    """The best order whose links are all >= t, or None when there is none."""
    n = len(w)

    def pay(x: float | None) -> float | None:
        """Score of one pseudo or closing link: None when below the threshold."""
        if x is None:
            return 0.0
        if x < t:
            return None
        return x - big if x == t else x

    if cycle:
        best = None
        for s in [0] if k == n else range(n - k + 1):
            found = _dp(w, k, t, big, {s: 0.0}, lambda v, s=s: pay(w[v][s]), range(s, n))
            if found and (best is None or found[0] > best[0]):
                best = found
        return best[1] if best else None
    starts = {}
    for v in range(n):
        paid = pay(None if start_w is None else start_w[v])
        if paid is not None:
            starts[v] = paid
    found = _dp(w, k, t, big, starts, lambda v: pay(None if end_w is None else end_w[v]), range(n))
    return found[1] if found else None


def _levels(n, w, start_w, end_w) -> list[float]:
    values = {w[i][j] for i in range(n) for j in range(n) if i != j}
    values |= set(start_w or ()) | set(end_w or ())
    return sorted(values, reverse=True)


def _greedy(n: int, k: int, w: Weights, s: int) -> list[int]:
    """k vertices from s on, each step to the fastest link left (the lowest index on ties)."""
    order, left = [s], set(range(n)) - {s}
    while len(order) < k:
        nxt = max(sorted(left), key=lambda u: w[order[-1]][u])
        order.append(nxt)
        left.remove(nxt)
    return order


def _two_opt(order: list[int], key) -> list[int]:
    """Reverse segments while one improves the key (the incumbent's key kept, not recomputed
    for every candidate: that alone was a third of the time)."""
    best_key = key(order)
    improved = True
    while improved:
        improved = False
        for i in range(len(order) - 1):
            for j in range(i + 2, len(order) + 1):
                cand = order[:i] + order[i:j][::-1] + order[j:]
                cand_key = key(cand)
                if cand_key > best_key:
                    order, best_key, improved = cand, cand_key, True
    return order


def _starts(n: int) -> list[int]:
    """Starting vertices of the heuristic: all of them up to MAX_STARTS, else MAX_STARTS spread
    evenly over the indices (a start costs a full 2-opt, O(k^3) per pass)."""
    if n <= MAX_STARTS:
        return list(range(n))
    return sorted({i * n // MAX_STARTS for i in range(MAX_STARTS)})


def _greedy_2opt(n, k, w, cycle, start_w, end_w) -> list[int]:
    def key(o):
        return order_key(o, w, cycle, start_w, end_w)

    best = None
    for s in _starts(n):
        order = _two_opt(_greedy(n, k, w, s), key)
        if best is None or key(order) > key(best):
            best = order
    return best


def best_order(
    w: Weights,
    k: int | None = None,
    *,
    cycle: bool,
    start_w: Sequence[float] | None = None,
    end_w: Sequence[float] | None = None,
) -> list[int]:
    """Best order of k of the n vertices of the symmetric bandwidth matrix `w` (diagonal unused).

    `cycle=True` closes the order into a ring; otherwise it is a path whose ends also pay
    `start_w[first]` and `end_w[last]` when given.
    """
    n = len(w)
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"cannot order {k} of {n} vertices")
    if n == 1 or (k == 1 and cycle):
        return [0]
    if n > EXACT_LIMIT:
        return _greedy_2opt(n, k, w, cycle, start_w, end_w)
    levels = _levels(n, w, start_w, end_w)
    big = 1.0 + (k + 2) * max(levels)
    # levels run from fast to slow; find the first (fastest) one at which an order exists
    lo, hi, found = 0, len(levels) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        order = _exact(w, k, cycle, start_w, end_w, levels[mid], big)
        if order is not None:
            found, hi = order, mid - 1
        else:
            lo = mid + 1
    return found if found is not None else list(range(k))
