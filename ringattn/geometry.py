"""Where each token of a ring's sequence lives, and which (query, key) pairs each step computes.

No torch here: the planner (``ringctl.planner``) prices rings with the very rules the engine
runs, and ``import ringattn.geometry`` does not load torch (``ringattn/__init__`` is lazy).

A ``SequenceLayout`` gives every rank the same number of rows and lists, per rank, its
``Run``s: consecutive packed positions of one document at consecutive local rows. Rows of no
document are padding (``doc == PAD``): they see nothing and nothing sees them. Layouts:

* plain ``contiguous`` / ``zigzag`` (one document, N a multiple of P or 2P): rank r holds
  ``[rN/P, (r+1)N/P)``, or chunks r and 2P-1-r of 2P;
* packed (``cu_seqlens = [0, l1, l1+l2, ..., N]``, flash-attn's varlen convention, any lengths):
  ``contiguous`` cuts the packed tokens into P equal slices (padding at the end, as
  ring-flash-attention's llama3 variant, unbalanced under a causal mask); ``zigzag`` is the
  balanced packed layout (``_balanced_runs``): the longest documents are cut into 2P chunks
  each and zigzagged over every rank (TransformerEngine's per-document DualChunkSwap, without
  its padding to 2P), the others stay whole on one rank, placed longest first where the causal
  work is least; as few documents are cut as keep every rank within ``BALANCE_TOLERANCE`` of
  the mean work. Padding: under P x ``row_multiple`` rows.

The mask, everywhere: query row a sees key row b iff both belong to the same document and,
under ``causal``, ``pos(b) <= pos(a)`` and (with a sliding window W, transformers'
convention) ``pos(a) - pos(b) < W``.

At step s, rank r holds the K/V block of rank ``src = r - s`` (mod P). ``SequenceLayout.plan``
lists the (query rows x key rows) ``Block``s of that block to compute: a plain rectangle, a
top-left causal square, or a sliding window's boundary (``offset``, ``window``: computed over the
visible band only by ``kernels.BandedKernel``). Anything not listed is never computed: future
blocks, blocks behind the window, other documents' blocks. ``SequenceLayout.reach`` says how far
the ring must go: when no rank needs the blocks of far ranks (a short window; documents that
live on one rank), the ring stops there instead of sending blocks nobody computes on.
"""

from __future__ import annotations

import bisect
import functools
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

LAYOUTS = ("contiguous", "zigzag")  # the ring's layouts (``ring_attention``)
HYBRID_LAYOUTS = ("hybrid-zigzag", "hybrid-contiguous")  # ``hybrid_attention``'s
PAD = -1  # the document of a padding run
ALL = slice(None)
# the balanced packed layout cuts documents until every rank's causal work is within this
# fraction of the mean (when cutting can reach it)
BALANCE_TOLERANCE = 0.02
# ring reach walks each query run over the key runs it sees; beyond this many visits it
# answers the plain ring (always correct, just not shortened)
REACH_WORK_LIMIT = 4_000_000


# ----------------------------------------------------------------------------- the padding rule
def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def check_sequence_layout(layout: str) -> None:
    """A ring layout or a hybrid one: what the sharding functions accept."""
    if layout not in LAYOUTS + HYBRID_LAYOUTS:
        raise ValueError(
            f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS + HYBRID_LAYOUTS)}"
        )


def ring_layout_of(layout: str) -> str:
    """The layout the ring of Ulysses groups sees: ``hybrid-zigzag`` -> ``zigzag``."""
    check_sequence_layout(layout)
    return layout.removeprefix("hybrid-")


def grid_layout(layout: str, ulysses_degree: int = 1) -> str:
    """The layout a sequence is sharded in for ring ``layout`` with Ulysses groups of
    ``ulysses_degree`` (its hybrid form above 1: ``hybrid_attention``'s), whose
    ``layout_multiple`` is the length rule of such a grid (lcm(P, 2R) for zigzag, not 2P)."""
    check_layout(layout)
    return f"hybrid-{layout}" if ulysses_degree > 1 else layout


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def hybrid_grid(world_size: int, ulysses_degree: int, rank: int) -> tuple[int, int, int]:
    """(ring size R, ring rank, ulysses rank) of hybrid rank ``rank`` among P = U x R ranks.
    The gate of every layout function's ranks: whole numbers (a float rank raised a
    TypeError from inside a tuple index; world_size=True was a ring of 1)."""
    world_size, ulysses_degree, rank = whole_numbers(
        world_size=world_size, ulysses_degree=ulysses_degree, rank=rank
    )
    if ulysses_degree < 1 or world_size < 1 or world_size % ulysses_degree:
        raise ValueError(
            f"the Ulysses degree U={ulysses_degree} must be >= 1 and divide the world size "
            f"P={world_size} (P = U x R, R the ring size)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return world_size // ulysses_degree, rank // ulysses_degree, rank % ulysses_degree


def ulysses_problem(u: int, ranks: int, heads: int, kv_heads: int) -> str | None:
    """Why a Ulysses degree U cannot split this attention over ``ranks`` (a phrase to follow
    the degree's name), or None: U divides the ranks (U x R grid) and the query heads, and
    the K/V heads and U divide one another (split over the group, or replicated across it).
    The one rule of the engine (``hybrid._local_problem``, for a grid of U ranks), the planner
    (estimate, splits, ``hybrid.ulysses_degrees``, `ringctl plan`) and the jobs' checks."""
    if u == 1:
        return None
    if u < 1 or ranks % u:
        return f"must divide the ranks ({ranks})"
    if heads % u:
        return f"must divide the heads ({heads})"
    if kv_heads % u and u % kv_heads:
        return (
            f"and the K/V heads ({kv_heads}) must divide one another (K/V heads split over "
            "the group, or replicated across it)"
        )
    return None


def layout_multiple(layout: str, world_size: int, ulysses_degree: int = 1) -> int:
    """What a plain sequence's length must be a multiple of to split over ``world_size`` ranks
    in ``layout``: P (contiguous), 2P (zigzag), lcm(P, 2R) (hybrid-zigzag, R = P / U)."""
    check_sequence_layout(layout)
    world_size, ulysses_degree = whole_numbers(world_size=world_size, ulysses_degree=ulysses_degree)
    if layout in LAYOUTS:
        if ulysses_degree != 1:
            raise ValueError(
                f"ulysses_degree={ulysses_degree} needs a hybrid layout "
                f"({', '.join(HYBRID_LAYOUTS)}); the {layout!r} layout has no Ulysses groups"
            )
        return world_size * chunks_per_rank(layout)
    ring_size, _, _ = hybrid_grid(world_size, ulysses_degree, 0)
    if ring_layout_of(layout) == "contiguous":
        return world_size
    return _lcm(world_size, 2 * ring_size)


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


def padded_length(seq_len: int, *, world_size: int, layout: str, ulysses_degree: int = 1) -> int:
    """The smallest length >= seq_len (at least one unit: an empty document still occupies its
    ring for one step) that the layout can split over ``world_size`` ranks."""
    unit = layout_multiple(layout, world_size, ulysses_degree)
    return -(-max(seq_len, 1) // unit) * unit


# ----------------------------------------------------------------------------- what a ring holds
def ring_holds(tokens: int, size: int, budget: int, layout: str) -> bool:
    """Does a ring of ``size`` ranks hold a plain sequence of ``tokens`` under a budget of
    rows per rank? Its padded length (the padding rule) over the ring's ranks is what each
    rank holds. The one answer: ringctl's submit, scheduler, planner and messages ask this."""
    return padded_length(tokens, world_size=size, layout=layout) // size <= budget


def ring_capacity(size: int, budget: int, layout: str) -> int:
    """The most tokens a ring of ``size`` ranks holds under ``budget`` (``ring_holds``)."""
    unit = layout_multiple(layout, size)
    return budget * size // unit * unit


def ranks_needed(tokens: int, budget: int, layout: str) -> int:
    """The fewest ranks of a ring that holds ``tokens`` under ``budget``. A rank holds at
    least ``chunks_per_rank(layout)`` rows (the layout's chunks), so a smaller budget holds
    nothing on any ring: ValueError (the search grew without end). With a budget of at least
    that, ``max(tokens, 1)`` ranks hold one chunk of a token each, so the search ends there."""
    least = chunks_per_rank(layout)
    if budget < least:
        raise ValueError(
            f"a budget of {budget} per rank holds no token in the {layout} layout, whose "
            f"ranks hold at least {least} rows each"
        )
    size = max(1, -(-tokens // budget))
    while not ring_holds(tokens, size, budget, layout):
        if size >= max(tokens, 1):  # held there by the argument above: never reached
            raise ValueError(f"no ring holds {tokens} tokens under a budget of {budget}")
        size += 1
    return size


# ----------------------------------------------------------------------------- counting pairs
def prefix_keys(u: int, window: int | None) -> int:
    """sum over t = 1..u of min(t, W): the keys the first u queries of a document see under
    the causal mask (W None: no window)."""
    if u <= 0:
        return 0
    if window is None or u <= window:
        return u * (u + 1) // 2
    return window * (window + 1) // 2 + (u - window) * window


def run_pairs(offset: int, length: int, causal: bool, window: int | None, doc_len: int) -> int:
    """Visible (query, key) pairs of the queries at document positions [offset, offset +
    length) against their whole document of ``doc_len`` tokens."""
    if not causal:
        return length * doc_len
    return prefix_keys(offset + length, window) - prefix_keys(offset, window)


# ----------------------------------------------------------------------------- runs and blocks
@dataclass(frozen=True)
class Run:
    """Packed positions [start, start + length) of document ``doc`` (which starts at packed
    position ``doc_start``), held at local rows [local, local + length)."""

    local: int
    start: int
    length: int
    doc: int = 0
    doc_start: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Block:
    """Query rows x key rows of one ring step, and the mask on them.

    ``causal``: the top-left aligned causal mask (a diagonal square: key row b visible to query
    row a iff b <= a); with ``reverse`` its mirror (b >= a: the oldest keys of a sliding window,
    computed as the causal mask over the rows and keys in reverse order). With ``window`` set
    the mask is the window's band: key row b is visible to query row a iff
    ``a + offset - window < b <= a + offset`` (the masked banded kernel, for short windows).
    """

    q: slice
    kv: slice
    causal: bool
    offset: int = 0
    window: int | None = None
    reverse: bool = False


def _sub(rows: slice, start: int, stop: int | None = None) -> slice:
    """Rows [start, stop) of ``rows`` (relative to its start)."""
    base = rows.start
    return slice(base + start, rows.stop if stop is None else base + stop)


def _causal_pieces(q: Run, k: Run) -> list[Block]:
    """The causal relation of a query run against a key run of the same document (no window),
    as plain rectangles and at most one top-left causal square: key row b is visible to query
    row a iff ``b <= a + delta``, delta = q.start - k.start."""
    delta = q.start - k.start
    if q.length - 1 + delta < 0:  # every key after every query
        return []
    if k.length - 1 <= delta:  # every key at or before every query
        return [Block(q.rows, k.rows, False)]
    qrows, qlen = q.rows, q.length
    if delta < 0:  # the first -delta queries see none of these keys
        qrows, qlen, delta = _sub(qrows, -delta), qlen + delta, 0
    pieces = []
    if delta > 0:  # keys before the diagonal: seen by every query
        pieces.append(Block(qrows, _sub(k.rows, 0, delta), False))
    diag = min(qlen, k.length - delta)
    pieces.append(Block(_sub(qrows, 0, diag), _sub(k.rows, delta, delta + diag), True))
    if qlen > diag:  # queries past the last key see every key on and after the diagonal
        pieces.append(Block(_sub(qrows, diag), _sub(k.rows, delta), False))
    return pieces


def _reverse_pieces(q: Run, k: Run, window: int) -> list[Block]:
    """The window's lower edge alone: key row b is visible to query row a iff
    ``b >= a + e``, e = q.start - k.start - window + 1 (no upper bound applies to these keys),
    as plain rectangles and at most one reversed causal square (the mirror of
    ``_causal_pieces``)."""
    e = q.start - k.start - window + 1
    if e > k.length - 1:  # every key too old for every query
        return []
    if q.length - 1 + e <= 0:  # every key young enough for every query
        return [Block(q.rows, k.rows, False)]
    qrows, krows, qlen, klen = q.rows, k.rows, q.length, k.length
    pieces = []
    if e < 0:  # the first -e queries see every key
        pieces.append(Block(_sub(qrows, 0, -e), krows, False))
        qrows, qlen = _sub(qrows, -e), qlen + e
    elif e > 0:  # the first e keys are too old for every query
        krows, klen = _sub(krows, e), klen - e
    diag = min(qlen, klen)
    pieces.append(Block(_sub(qrows, 0, diag), _sub(krows, 0, diag), True, reverse=True))
    if klen > diag:  # keys past the last query's start: seen by every query
        pieces.append(Block(_sub(qrows, 0, diag), _sub(krows, diag), False))
    return pieces


def _window_piece(q: Run, k: Run, window: int) -> list[Block]:
    """A query run against a key run of the same document under a causal sliding window.

    With delta = q.start - k.start, query row a sees key row b iff
    ``a + delta - window < b <= a + delta``. Where the window cuts no visible pair (the
    newest query is within W of the oldest key), the plain causal pieces; a window shorter than
    ``SPLIT_WINDOW``, one masked band over the keys some query row sees (a neighbour's block
    then travels as the W - 1 rows before the queries, not the whole chunk: ``kv_rows``);
    else the band cut into unmasked pieces (``_band_pieces``)."""
    delta = q.start - k.start
    newest = q.length - 1 + delta  # the latest key row any query row may see
    oldest = delta - window + 1  # the earliest key row any query row may see
    if newest < 0 or oldest > k.length - 1:
        return []
    if newest < window:  # the window cuts nothing here
        return _causal_pieces(q, k)
    if window < SPLIT_WINDOW:
        seen = _clip(k, q.start - window + 1, q.end)  # not None: checked just above
        return [Block(q.rows, seen.rows, True, offset=q.start - seen.start, window=window)]
    return _band_pieces(q, k, window)


# Windows at least this long are computed as unmasked pieces (plain rectangles, causal squares
# and their mirrors) of SPLIT_ROWS query rows each; shorter ones by the masked banded kernel
# (the pieces would be too small to run the kernels well).
SPLIT_WINDOW = 256
SPLIT_ROWS = 1024


def _band_pieces(q: Run, k: Run, window: int) -> list[Block]:
    """A band cut into chunks of R <= W query rows. Chunk [r0, r1) sees the keys of the
    positions [pos(r0) - W + 1, pos(r1 - 1)]: the newest R (from pos(r0)) under the causal
    mask alone, the oldest R - 1 under the window's lower edge alone, and every key between
    by every row of the chunk. No piece needs a mask: the kernels' own causal flag does it
    (on reversed rows for the lower edge), and nothing outside the band is computed."""
    rows = min(window, SPLIT_ROWS)
    pieces: list[Block] = []
    for r0 in range(0, q.length, rows):
        r1 = min(q.length, r0 + rows)
        chunk = Run(q.local + r0, q.start + r0, r1 - r0, q.doc, q.doc_start)
        first, last = chunk.start - window + 1, chunk.end - 1  # positions some row sees
        newest = _clip(k, chunk.start, last + 1)
        middle = _clip(k, chunk.end - window, chunk.start)
        oldest = _clip(k, first, chunk.end - window)
        if newest is not None:
            pieces.extend(_causal_pieces(chunk, newest))
        if middle is not None:
            pieces.append(Block(chunk.rows, middle.rows, False))
        if oldest is not None:
            pieces.extend(_reverse_pieces(chunk, oldest, window))
    return pieces


def _clip(k: Run, start: int, stop: int) -> Run | None:
    """The part of key run ``k`` at positions [start, stop), or None."""
    start, stop = max(start, k.start), min(stop, k.end)
    if start >= stop:
        return None
    return Run(k.local + start - k.start, start, stop - start, k.doc, k.doc_start)


def _coalesce(blocks: list[Block]) -> tuple[Block, ...]:
    """Plain rectangles that share their keys and have adjacent queries (or the reverse) become
    one: one kernel call instead of two."""
    out: list[Block] = []
    for blk in sorted(blocks, key=lambda b: (b.kv.start or 0, b.q.start or 0)):
        last = out[-1] if out else None
        if last is not None and _joinable(last, blk):
            out[-1] = _joined(last, blk)
        else:
            out.append(blk)
    again: list[Block] = []
    for blk in sorted(out, key=lambda b: (b.q.start or 0, b.kv.start or 0)):
        last = again[-1] if again else None
        if last is not None and _joinable(last, blk, by_keys=True):
            again[-1] = _joined(last, blk, by_keys=True)
        else:
            again.append(blk)
    return tuple(again)


def _joinable(a: Block, b: Block, by_keys: bool = False) -> bool:
    if a.causal or b.causal or a.window is not None or b.window is not None:
        return False
    if by_keys:
        return a.q == b.q and a.kv.stop == b.kv.start
    return a.kv == b.kv and a.q.stop == b.q.start


def _joined(a: Block, b: Block, by_keys: bool = False) -> Block:
    if by_keys:
        return Block(a.q, slice(a.kv.start, b.kv.stop), False)
    return Block(slice(a.q.start, b.q.stop), a.kv, False)


# ----------------------------------------------------------------------------- the layout
_PLANS_BUILT = [0]  # plans computed in this process (the others came from a layout's cache)


def plans_built() -> int:
    """How many step plans this process has computed, not taken from a layout's cache (a
    benchmark checks that a shape's later calls compute none)."""
    return _PLANS_BUILT[0]


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """Every rank's runs (see the module docstring). Built once per shape by ``plain_layout`` /
    ``packed_layout`` (cached), so its plans are computed once and kept here."""

    name: str
    world_size: int
    rows: int  # rows per rank, padding included
    tokens: int  # real tokens
    runs: tuple[tuple[Run, ...], ...]
    packed: bool
    doc_lengths: tuple[int, ...]
    balance_window: int | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def fingerprint(self) -> int:
        """``packing_checksum`` of this layout's documents (ranks compare it before a ring)."""
        window = None if self.name == "contiguous" else self.balance_window  # unused there
        return packing_checksum(self.doc_lengths, window)

    @property
    def padding(self) -> int:
        """Rows the layout adds to the real tokens (over all ranks)."""
        return self.world_size * self.rows - self.tokens

    def positions(self, rank: int) -> list[int]:
        """Packed position of each local row of ``rank``; -1 for a padding row."""
        out = [-1] * self.rows
        for run in self.runs[rank]:
            if run.doc != PAD:
                out[run.local : run.local + run.length] = range(run.start, run.end)
        return out

    def document_positions(self, rank: int) -> list[int]:
        """Each local row's position within its own document (RoPE); -1 for padding."""
        out = [-1] * self.rows
        for run in self.runs[rank]:
            if run.doc != PAD:
                first = run.start - run.doc_start
                out[run.local : run.local + run.length] = range(first, first + run.length)
        return out

    def pairs(self, rank: int, causal: bool, window: int | None) -> int:
        """Visible (query, key) pairs of ``rank``'s queries: its attention work."""
        return sum(
            run_pairs(r.start - r.doc_start, r.length, causal, window, self.doc_lengths[r.doc])
            for r in self.runs[rank]
            if r.doc != PAD
        )

    def longest_document(self) -> int:
        return max(self.doc_lengths, default=0)

    def window_cuts(self, causal: bool, window: int | None) -> bool:
        """Does the window cut anything (else the plan is the plain causal one)?"""
        return causal and window is not None and window < self.longest_document()

    def plan(self, step: int, rank: int, causal: bool, window: int | None) -> tuple[Block, ...]:
        """The blocks ``rank`` computes against the K/V block it holds at ``step``."""
        key = (step, rank, causal, window)
        if key not in self._plans:
            _PLANS_BUILT[0] += 1
            self._plans[key] = _plan(self, (rank - step) % self.world_size, rank, causal, window)
        return self._plans[key]

    def reach(self, causal: bool, window: int | None) -> tuple[int, int]:
        """(forward hops, backward hops): every rank's plan is empty at every step but 0,
        1..forward (the blocks of ranks r-1 .. r-forward) and P-backward..P-1 (those of ranks
        r+1 .. r+backward). (P - 1, 0) is the plain ring."""
        key = ("reach", causal, window)
        if key not in self._plans:
            self._plans[key] = _reach(self, causal, window)
        return self._plans[key]

    def kv_rows(self, owner: int, shift: int, hops: int, causal: bool, window: int | None) -> slice:
        """The rows of ``owner``'s K/V block that travel on a leg of ``hops`` (``shift``: +1
        forward, -1 backward), at every hop of it. On a one-hop leg (a window's ring, or
        P = 2) those its one holder's plan reads: under a window of W, the rows within W - 1
        of the holder's queries; without one, at P = 2 in zigzag, rank 0's early half. One
        row where it reads none (a transfer of nothing is not worth its own path through
        every backend). On a longer leg the whole block: which rows the later holders read
        would take every rank's plans against every block, P^2 of them per layout (0.6 s
        per rank for a packed batch on 64 ranks), and in a plain causal ring the last
        holders read all of it anyway."""
        if hops != 1:
            return slice(0, self.rows)
        key = ("kv_rows", owner, shift, causal, window)
        if key not in self._plans:
            holder, step = (owner + shift) % self.world_size, shift % self.world_size
            read = [blk.kv for blk in self.plan(step, holder, causal, window)]
            self._plans[key] = (
                slice(min(r.start for r in read), max(r.stop for r in read))
                if read
                else slice(0, 1)
            )
        return self._plans[key]


def _plan(layout: SequenceLayout, src: int, rank: int, causal: bool, window) -> tuple[Block, ...]:
    cut = layout.window_cuts(causal, window)
    qruns = [r for r in layout.runs[rank] if r.doc != PAD]
    if src == rank and not cut:  # own block, no window: one block per document
        return _coalesce([_own_block(rows, causal) for rows in _document_rows(qruns)])
    kruns_by_doc: dict[int, list[Run]] = {}
    for r in layout.runs[src]:
        if r.doc != PAD:
            kruns_by_doc.setdefault(r.doc, []).append(r)
    pieces: list[Block] = []
    for q in qruns:
        for k in kruns_by_doc.get(q.doc, ()):
            if not causal:
                pieces.append(Block(q.rows, k.rows, False))
            elif cut:
                pieces.extend(_window_piece(q, k, window))
            else:
                pieces.extend(_causal_pieces(q, k))
    return _coalesce(pieces)


def _document_rows(runs: list[Run]) -> list[slice]:
    """The local rows of each document on a rank. Every layout here keeps a document's rows
    on a rank consecutive and in position order, so the causal relation among them is the
    top-left causal square."""
    rows: dict[int, slice] = {}
    for r in runs:
        s = rows.get(r.doc)
        if s is not None and (s.stop != r.local):
            raise AssertionError("a document's rows on a rank must be consecutive")
        rows[r.doc] = slice(r.local if s is None else s.start, r.local + r.length)
    return list(rows.values())


def _own_block(rows: slice, causal: bool) -> Block:
    return Block(rows, rows, causal)


# ----------------------------------------------------------------------------- ring reach
def _reach(layout: SequenceLayout, causal: bool, window: int | None) -> tuple[int, int]:
    world = layout.world_size
    plain = (world - 1, 0)
    if world < 2:
        return plain
    if not layout.packed and (not causal or not layout.window_cuts(causal, window)):
        return plain
    needed = _needed_steps(layout, causal, window if layout.window_cuts(causal, window) else None)
    if needed is None:
        return plain
    forward = next((f for f in range(world) if f + 1 not in needed), world - 1)
    backward = next((b for b in range(world) if world - b - 1 not in needed), 0)
    covered = set(range(1, forward + 1)) | set(range(world - backward, world))
    if forward + backward >= world - 1 or not needed <= covered:
        return plain
    return forward, backward


def _needed_steps(layout: SequenceLayout, causal: bool, window: int | None) -> set[int] | None:
    """The steps > 0 at which some rank sees some key, or None when finding out would cost
    more than ``REACH_WORK_LIMIT`` visits. A run of queries [start, end) sees exactly the keys
    of its document in [start - W + 1, end) (causal; each query its own window, consecutive
    windows overlap) or all of its document (not causal)."""
    world = layout.world_size
    owners = sorted(
        (r.start, r.end, rank)
        for rank, runs in enumerate(layout.runs)
        for r in runs
        if r.doc != PAD
    )
    starts = [o[0] for o in owners]
    steps: set[int] = set()
    visits = 0
    for rank, runs in enumerate(layout.runs):
        for run in runs:
            if run.doc == PAD:
                continue
            lo, hi = _visible_keys(layout, run, causal, window)
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while i < len(owners) and owners[i][0] < hi:
                if owners[i][1] > lo:
                    steps.add((rank - owners[i][2]) % world)
                i += 1
                visits += 1
            if visits > REACH_WORK_LIMIT or len(steps) == world:
                return None
    steps.discard(0)
    return steps


def _visible_keys(layout: SequenceLayout, run: Run, causal: bool, window) -> tuple[int, int]:
    """[lo, hi) of the packed positions that the queries of ``run`` see."""
    doc_end = run.doc_start + layout.doc_lengths[run.doc]
    if not causal:
        return run.doc_start, doc_end
    lo = run.doc_start if window is None else max(run.doc_start, run.start - window + 1)
    return lo, run.end


# ----------------------------------------------------------------------------- builders
@functools.lru_cache(maxsize=256)
def plain_layout(seq_len: int, world_size: int, layout: str) -> SequenceLayout:
    """One document over the ring (``layouts.sequence_positions``, as runs). The caller checks
    that ``seq_len`` is a multiple of ``layout_multiple``."""
    check_layout(layout)
    per_rank = seq_len // world_size
    runs = []
    for rank in range(world_size):
        if layout == "contiguous":
            runs.append((Run(0, rank * per_rank, per_rank),))
        else:
            half = per_rank // 2
            late = 2 * world_size - 1 - rank
            runs.append((Run(0, rank * half, half), Run(half, late * half, half)))
    return SequenceLayout(layout, world_size, per_rank, seq_len, tuple(runs), False, (seq_len,))


def integer_of(value) -> int | None:
    """``value`` as an int where it is an integer of any kind (numpy's too), else None: never
    a bool (``operator.index(True)`` is 1) nor a float silently cut (3.9 -> 3). The one
    reading of a whole-number argument (a window, the entries of cu_seqlens)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def whole_numbers(**named) -> tuple[int, ...]:
    """The values as ints (``integer_of``), or a ValueError naming the first that is not one."""
    for name, value in named.items():
        if integer_of(value) is None:
            raise ValueError(f"{name} must be an int, got {value!r}")
    return tuple(integer_of(value) for value in named.values())


def check_balance_window(balance_window) -> int | None:
    """The window a packing's causal work is balanced for: a whole number >= 1 (numpy's
    too, as an int) or None; ValueError otherwise."""
    if balance_window is None:
        return None
    keys = integer_of(balance_window)
    if keys is None or keys < 1:
        raise ValueError(
            f"balance_window must be a whole number >= 1 or None, got {balance_window!r}"
        )
    return keys


def check_cu_seqlens(cu_seqlens: Sequence[int]) -> tuple[int, ...]:
    """``[0, l1, l1 + l2, ..., N]``: starts at 0, never decreases, N >= 1 (empty documents are
    allowed and hold no rows)."""
    cu = tuple(int(c) for c in cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(
            "cu_seqlens must be [0, l1, l1+l2, ..., N] (flash-attn's varlen convention): "
            f"got {list(cu[:8])}{' ...' if len(cu) > 8 else ''}"
        )
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"cu_seqlens must not decrease: cu_seqlens[{i}] = {cu[i]} < "
                f"cu_seqlens[{i - 1}] = {cu[i - 1]}"
            )
    if cu[-1] < 1:
        raise ValueError("cu_seqlens packs no token (N = 0)")
    return cu


def packing_checksum(doc_lengths: Sequence[int], balance_window: int | None = None) -> int:
    """A 31-bit checksum of a packing: its documents' lengths, and the window its causal work
    is balanced for. The ranks of a ring compare it before a call (the layout and the world
    size apart), so it is the same whichever form a rank passes the packing in: cu_seqlens
    as a list or a tensor, or the SequenceLayout ``pack_sequence`` made of it (a rank passing
    one and its neighbour the other, the same packing, were refused as disagreeing)."""
    key = (tuple(int(n) for n in doc_lengths), balance_window)
    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=64)
def packed_layout(
    cu_seqlens: tuple[int, ...],
    world_size: int,
    layout: str,
    row_multiple: int = 1,
    balance_window: int | None = None,
) -> SequenceLayout:
    """Packed documents over the ring (the module docstring); rows per rank a multiple of
    ``row_multiple`` (a hybrid ring's Ulysses degree). ``balance_window``: balance the causal
    work under that sliding window (a windowed model's) instead of full causal attention; the
    ranks' rows are the same either way, only which documents go where changes."""
    check_layout(layout)
    if world_size < 1 or row_multiple < 1:
        raise ValueError(f"world_size ({world_size}) and row_multiple must be >= 1")
    balance_window = check_balance_window(balance_window)
    cu = check_cu_seqlens(cu_seqlens)
    lengths = tuple(b - a for a, b in zip(cu, cu[1:], strict=False))
    tokens = cu[-1]
    unit = world_size * row_multiple
    rows = -(-tokens // unit) * row_multiple
    if layout == "contiguous":
        pieces = _contiguous_runs(cu, lengths, world_size, rows)
    else:
        pieces = _balanced_runs(cu, lengths, world_size, rows, balance_window)
    runs = tuple(_local_rows(p, rows) for p in pieces)
    return SequenceLayout(layout, world_size, rows, tokens, runs, True, lengths, balance_window)


# a placed piece before local rows are given: (doc, start, length, doc_start)
_Piece = tuple[int, int, int, int]


def _local_rows(pieces: list[_Piece], rows: int) -> tuple[Run, ...]:
    """A rank's pieces as runs at consecutive local rows, ordered by (document, position) so
    each document's rows are consecutive and in order; padding fills the rest."""
    out, local = [], 0
    for doc, start, length, doc_start in sorted(pieces):
        out.append(Run(local, start, length, doc, doc_start))
        local += length
    if local > rows:
        raise AssertionError(f"a rank holds {local} rows, more than {rows}")
    if local < rows:
        out.append(Run(local, -1, rows - local, PAD, -1))
    return tuple(out)


def _contiguous_runs(cu, lengths, world: int, rows: int) -> list[list[_Piece]]:
    """Rank r holds packed positions [r x rows, (r + 1) x rows), cut at document edges."""
    pieces: list[list[_Piece]] = [[] for _ in range(world)]
    for doc, length in enumerate(lengths):
        pos, end = cu[doc], cu[doc] + length
        while pos < end:
            rank = pos // rows
            stop = min(end, (rank + 1) * rows)
            pieces[rank].append((doc, pos, stop - pos, cu[doc]))
            pos = stop
    return pieces


def _balanced_runs(cu, lengths, world: int, rows: int, window: int | None) -> list[list[_Piece]]:
    """The fewest cut documents (longest first) that keep every rank's causal work within
    ``BALANCE_TOLERANCE`` of the mean: none first (no document then needs the ring), else a
    binary search over how many are cut (the work is nearly monotone in it); where no count
    reaches the tolerance, the most even placement seen."""
    order = sorted(
        (i for i, n in enumerate(lengths) if n), key=lambda i: (-prefix_keys(lengths[i], window), i)
    )
    mean = sum(prefix_keys(n, window) for n in lengths) / world

    def attempt(cut: int) -> tuple[float, list]:
        placed, work = _place(cu, lengths, order, cut, world, rows, window)
        return max(work) / mean, placed

    lo = sum(1 for i in order if lengths[i] > rows)  # these cannot stay whole
    ratio, placed = attempt(lo)
    if ratio <= 1 + BALANCE_TOLERANCE:
        return placed
    best, fit = (ratio, placed), None
    lo, hi = lo + 1, len(order)
    while lo <= hi:
        cut = (lo + hi) // 2
        ratio, placed = attempt(cut)
        if ratio < best[0]:
            best = (ratio, placed)
        if ratio <= 1 + BALANCE_TOLERANCE:
            fit, hi = placed, cut - 1
        else:
            lo = cut + 1
    return fit if fit is not None else best[1]


def _place(cu, lengths, order, cut: int, world: int, rows: int, window: int | None):
    """Cut the first ``cut`` documents of ``order`` over every rank (zigzag), place the rest
    whole where the work is least and they fit, then fill the gaps with what fits nowhere.
    Returns (pieces per rank, causal work per rank)."""
    pieces: list[list[_Piece]] = [[] for _ in range(world)]
    used, work = [0] * world, [0] * world

    def put(rank: int, doc: int, start: int, length: int) -> None:
        pieces[rank].append((doc, start, length, cu[doc]))
        used[rank] += length
        work[rank] += run_pairs(start - cu[doc], length, True, window, lengths[doc])

    for doc in order[:cut]:
        for rank, start, length in _zigzag_chunks(cu[doc], lengths[doc], world, used, window):
            put(rank, doc, start, length)
    spilled = []
    for doc in order[cut:]:
        n = lengths[doc]
        fits = [r for r in range(world) if used[r] + n <= rows]
        if not fits:
            spilled.append(doc)
            continue
        put(min(fits, key=lambda r: (work[r], used[r], r)), doc, cu[doc], n)
    for doc in sorted(spilled):  # into the gaps, in order, cut where a rank is full
        pos, end = cu[doc], cu[doc] + lengths[doc]
        for rank in range(world):
            take = min(end - pos, rows - used[rank])
            if take > 0:
                put(rank, doc, pos, take)
                pos += take
    return pieces, work


def _zigzag_chunks(start: int, length: int, world: int, used: list[int], window: int | None):
    """(rank, start, length) of a document cut over every rank in the zigzag pattern: rank r
    holds the r-th chunk from the front and the r-th from the back. Each rank gets
    ``length / P`` rows (one more for the ranks holding the fewest rows so far), split between
    its two chunks so that its causal work (under ``window``) is the document's over P: with
    no window that is the equal chunks of the plain zigzag layout; under a window the early
    chunks, which see fewer keys, grow."""
    base, extra = divmod(length, world)
    by_rows = sorted(range(world), key=lambda r: (used[r], r))
    rows = [base + (1 if r in set(by_rows[:extra]) else 0) for r in range(world)]
    fronts, backs = [0] * world, [0] * world
    lo, hi = 0, length  # document positions not yet given to a rank
    left = prefix_keys(length, window)  # their causal work
    for rank in range(world):
        front = _front_share(lo, hi, rows[rank], left / (world - rank), window)
        fronts[rank], backs[rank] = front, rows[rank] - front
        left -= _pair_work(lo, hi, front, rows[rank], window)
        lo, hi = lo + front, hi - backs[rank]
    out, pos = [], start
    for rank, size in [*enumerate(fronts), *reversed(list(enumerate(backs)))]:
        if size:
            out.append((rank, pos, size))
        pos += size
    return out


def _pair_work(lo: int, hi: int, front: int, rows: int, window: int | None) -> int:
    """Causal work of the document positions [lo, lo + front) and [hi - (rows - front), hi)."""
    back = rows - front
    return (
        prefix_keys(lo + front, window)
        - prefix_keys(lo, window)
        + prefix_keys(hi, window)
        - prefix_keys(hi - back, window)
    )


def _front_share(lo: int, hi: int, rows: int, target: float, window: int | None) -> int:
    """How many of ``rows`` to take from the front of [lo, hi) (the rest from the back): as
    near an even split as keeps the work between ``BALANCE_TOLERANCE`` below ``target`` and a
    thousandth above it (chunks of similar size keep a windowed ring's neighbours near; a rank
    a little under its share costs nothing, the later ranks take the rest). The work never
    grows with the front share (a front position sees no more keys than a back one):
    bisections find the shares that qualify."""

    def first_at_most(limit: float) -> int:  # the smallest front share whose work <= limit
        a, b = 0, rows + 1
        while a < b:
            mid = (a + b) // 2
            if mid <= rows and _pair_work(lo, hi, mid, rows, window) > limit:
                a = mid + 1
            else:
                b = mid
        return a

    low = first_at_most(target * 1.001)
    high = first_at_most(target * (1 - BALANCE_TOLERANCE)) - 1
    if low <= high:
        return min(max(rows // 2, low), high)
    near = [a for a in (low - 1, low) if 0 <= a <= rows]
    return min(near, key=lambda a: abs(_pair_work(lo, hi, a, rows, window) - target))


# ----------------------------------------------------------------------------- the banded kernel
BANDED_MAX_SCORES = 2**26  # scores the banded kernel holds at once, all heads of the batch


def banded_rows(batch: int, heads: int, window: int, max_scores: int = BANDED_MAX_SCORES) -> int:
    """Query rows per chunk of the banded kernel (``kernels.BandedKernel``): about the window
    (a chunk of R rows computes R x (R + W - 1) scores for R x W visible ones), at most 1024,
    within ``max_scores``."""
    rows = max(64, min(1024, window))
    per_row = batch * heads * (rows + window)
    return max(16, min(rows, max_scores // max(1, per_row)))


def band_chunks(sq: int, sk: int, offset: int, window: int | None, rows: int):
    """(r0, r1, k0, k1) per chunk of ``rows`` query rows that sees some key: rows [r0, r1)
    against the keys [k0, k1) they can see (key b visible to query a iff
    ``a + offset - window < b <= a + offset``; no lower bound when ``window`` is None)."""
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        k0 = 0 if window is None else max(0, r0 + offset - window + 1)
        k1 = min(sk, r1 + offset)
        if k0 < k1:
            yield r0, r1, k0, k1


def _band_chunk(j: int, rows: int, sq: int, sk: int, offset: int, window: int):
    """(query rows, keys) of chunk j of ``band_chunks``; keys may be <= 0."""
    r0, r1 = j * rows, min(sq, (j + 1) * rows)
    k0, k1 = max(0, r0 + offset - window + 1), min(sk, r1 + offset)
    return r1 - r0, k1 - k0


@functools.lru_cache(maxsize=4096)
def band_chunk_shapes(sq: int, sk: int, offset: int, window: int, rows: int) -> tuple:
    """((query rows, keys), count) of ``band_chunks``' chunks, counted rather than walked:
    chunks away from the piece's edges are all R x (R + W - 1), so the cost is O(W / R)
    whatever the piece's length (the planner prices long pieces with it)."""
    first = max(0, -offset) // rows  # the first row that sees a key: offset + r >= 0
    last_row = min(sq, sk - 1 + window - offset) - 1  # rows with r + offset - W + 1 < sk
    if last_row < max(0, -offset):
        return ()
    last = last_row // rows
    lo = max(first, -(-(window - 1 - offset) // rows))  # k0 > 0 from here on
    hi = min(last, (sk - rows - offset) // rows, sq // rows - 1)  # whole rows, k1 < sk
    shapes: dict[tuple[int, int], int] = {}
    if hi >= lo:
        shapes[(rows, rows + window - 1)] = hi - lo + 1
        edges = [*range(first, lo), *range(hi + 1, last + 1)]
    else:
        edges = list(range(first, last + 1))
    for j in edges:
        r, keys = _band_chunk(j, rows, sq, sk, offset, window)
        if keys > 0:
            shapes[(r, keys)] = shapes.get((r, keys), 0) + 1
    return tuple(sorted(shapes.items()))


# ----------------------------------------------------------------------------- plain shortcuts
def shard_runs(rank: int, world_size: int, seq_local: int, layout: str) -> tuple[Run, ...]:
    """The runs of a plain (one-document) sequence that ``rank`` holds."""
    return plain_layout(world_size * seq_local, world_size, layout).runs[rank]


def block_plan(
    *,
    step: int,
    rank: int,
    world_size: int,
    seq_local: int,
    causal: bool,
    layout: str,
    window: int | None = None,
) -> tuple[Block, ...]:
    """``SequenceLayout.plan`` of a plain sequence of ``world_size x seq_local`` tokens."""
    lay = plain_layout(world_size * seq_local, world_size, layout)
    return lay.plan(step, rank, causal, window)


def ring_reach(
    world_size: int, seq_local: int, causal: bool, layout: str, window: int | None
) -> tuple[int, int]:
    """``SequenceLayout.reach`` of a plain sequence of ``world_size x seq_local`` tokens."""
    return plain_layout(world_size * seq_local, world_size, layout).reach(causal, window)
