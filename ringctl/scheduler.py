"""The scheduler: which ring runs which document, and in what order. The job's one policy.

The job runs it (``longdoc/schedule.py`` feeds it the documents' estimated lengths), and
`ringctl plan JOB` / `ringctl plan --corpus` run the same function on the same lengths and have
the planner price what it decided (``priced``, with ``planner/pricing.document_cost``), so the
makespan plan prints is that of the schedule the job will run. Torch-free.

No coordinator: every rank builds the same schedule from the same inputs (each document's
length estimate, the job's size, the ring sizes, the per-rank token budget, a cost model), so
they agree without talking. The policy:

1. Each document goes to the smallest ring size whose ranks hold it: padded length / size
   <= the budget (padding to the layout's multiple included). None holds it: refused by name
   before anything runs (`DocumentTooLong`), with the ring size it would need.
2. Balance: phases run one after another and each lasts at least its longest document, so a
   document that alone outlasts its phase's average ring load, and runs faster on the next
   larger ring size, moves there, until none does (the smallest ring that *holds* a long
   document can take longer than the rest of the job: docs/planner-validation.md measures it).
3. Work runs in phases, from the largest ring size to the smallest (a phase of size N has
   W/N rings running at once); a phase ends when its slowest ring ends.
4. Within a phase, documents in decreasing predicted cost (attention ~ n^2, the rest ~ n; ties
   by input order) each go to the least-loaded ring (ties: lowest ring index): longest
   processing time first, within 4/3 of the best makespan of a phase.

The ring sizes and the budget come from the job's `ring` section (``schedule_documents``):
``ring.size`` null is one ring of the whole job in input order (no budget needed), N is W/N
rings of N ranks, ``auto`` every divisor of W (``rings.ring_sizes``), which needs a budget.

`schedule.json` in the job directory is this schedule, written and read here (``Schedule``:
``to_dict`` / ``from_dict``, ``write_schedule`` / ``read_schedule``); `ringctl status` reads it
for progress per ring, `ringctl plan JOBDIR` prices it. Whether a ring holds a document is
``ringattn.geometry.ring_holds``'s one answer.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from ringattn.geometry import ranks_needed, ring_capacity, ring_holds

from .errors import UserError
from .rings import Ring, ring_sizes

SCHEDULE_VERSION = 1
UNLIMITED = 1 << 62

Cost = Callable[[int, int], float]  # (tokens, ring size) -> predicted seconds (or relative)


class DocumentTooLong(UserError):
    """A document that no ring of the job can hold."""


@dataclass(frozen=True)
class DocLength:
    index: int  # position in the job's input order
    doc_id: str
    tokens: int  # an estimate is fine (see `longdoc.schedule`)


@dataclass
class Assignment:
    index: int
    doc_id: str
    tokens: int
    ring_size: int
    ring: int
    members: list[int]
    order: int  # position in its ring's queue within the phase
    predicted_s: float
    source: str = ""  # the document's input (schedule.json says where it came from)


@dataclass
class Schedule:
    world: int
    sizes: list[int]
    budget: int
    entries: list[Assignment]
    phases: list[dict] = field(default_factory=list)
    length_source: str = "estimate"
    cost_unit: str = "relative"  # "seconds" when a device's cost model priced it

    @property
    def makespan(self) -> float:
        return sum(p["predicted_s"] for p in self.phases)

    def for_rank(self, rank: int) -> list[tuple[int, Ring, list[Assignment]]]:
        """(ring size, this rank's ring, its documents in order) for each phase, in order;
        every rank gets every phase (possibly with no documents) so phases stay in step."""
        plan = []
        for phase in self.phases:
            size = phase["ring_size"]
            ring = Ring(size, rank // size)
            mine = [e for e in self.entries if e.ring_size == size and e.ring == ring.index]
            plan.append((size, ring, sorted(mine, key=lambda e: e.order)))
        return plan

    def to_dict(self) -> dict:
        """schedule.json (``write_schedule``; ``Schedule.from_dict`` reads it back)."""
        return {
            "version": SCHEDULE_VERSION,
            "world_size": self.world,
            "ring_sizes": self.sizes,
            "max_tokens_per_rank": self.budget,
            "length_source": self.length_source,
            "cost_unit": self.cost_unit,
            "predicted_makespan_s": self.makespan,
            "phases": self.phases,
            "documents": [asdict(e) for e in sorted(self.entries, key=lambda e: e.index)],
        }

    @classmethod
    def from_dict(cls, data, where: str = "the schedule") -> Schedule:
        """A schedule as ``to_dict`` wrote it, checked as hostile input (a remote copy of a
        job directory): the version, every field's type, phases that match the documents."""
        if not isinstance(data, dict) or data.get("version") != SCHEDULE_VERSION:
            raise ValueError(f"{where}: not a schedule (version {SCHEDULE_VERSION})")
        try:
            entries = [_assignment(row) for row in data["documents"]]
            phases = [_phase(row) for row in data["phases"]]
            schedule = cls(
                _count(data["world_size"]),
                [_count(n) for n in data["ring_sizes"]],
                _count(data["max_tokens_per_rank"], 0),
                entries,
                phases,
                str(data["length_source"]),
                str(data["cost_unit"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: a field is missing or of the wrong type ({err})") from None
        sizes = {p["ring_size"] for p in phases}
        if any(e.ring_size not in sizes for e in entries):
            raise ValueError(f"{where}: a document's ring size has no phase")
        return schedule


def _count(value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{value!r} is not an integer >= {least}")
    return value


def _assignment(row: dict) -> Assignment:
    if not isinstance(row, dict):
        raise TypeError("a document entry is not a mapping")
    members = row["members"]
    if not isinstance(members, list):
        raise TypeError("members is not a list")
    predicted = row["predicted_s"]
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)):
        raise TypeError("predicted_s is not a number")
    return Assignment(
        _count(row["index"], 0),
        str(row["doc_id"]),
        _count(row["tokens"], 0),
        _count(row["ring_size"]),
        _count(row["ring"], 0),
        [_count(m, 0) for m in members],
        _count(row["order"], 0),
        float(predicted),
        str(row.get("source", "")),
    )


def _phase(row: dict) -> dict:
    if not isinstance(row, dict):
        raise TypeError("a phase is not a mapping")
    predicted = row["predicted_s"]
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)):
        raise TypeError("a phase's predicted_s is not a number")
    return {
        "ring_size": _count(row["ring_size"]),
        "rings": _count(row["rings"]),
        "documents": _count(row["documents"], 0),
        "predicted_s": float(predicted),
    }


def write_schedule(path, schedule: Schedule) -> None:
    """schedule.json of the job directory (rank 0)."""
    from .atomic import atomic_write_json

    atomic_write_json(path, schedule.to_dict())


def read_schedule(path) -> Schedule:
    """schedule.json back, checked (ValueError naming the file)."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"{path}: not readable as JSON ({type(err).__name__})") from None
    return Schedule.from_dict(data, str(path))


def ring_for(tokens: int, sizes: Sequence[int], budget: int, layout: str):
    """The smallest ring size that holds `tokens` (``ring_holds``) under the budget, or
    None."""
    for size in sorted(sizes):
        if ring_holds(tokens, size, budget, layout):
            return size
    return None


def default_cost(tokens: int, size: int) -> float:
    """Relative cost when no device is known: attention n^2 plus the rest, both over the ring,
    and a per-step cost for each of the ring's size steps."""
    n = max(tokens, 1)
    return (n * n / 4096.0 + 16.0 * n) / size + 64.0 * (size - 1)


def build_schedule(
    docs: Sequence[DocLength],
    *,
    world: int,
    sizes: Sequence[int],
    budget: int,
    layout: str,
    cost: Cost = default_cost,
) -> Schedule:
    """The schedule of `docs` on a job of `world` ranks (see the module docstring)."""
    choice: dict[int, int] = {}
    for doc in docs:
        size = ring_for(doc.tokens, sizes, budget, layout)
        if size is None:
            raise DocumentTooLong(too_long(doc.doc_id, doc.tokens, sizes, budget, layout))
        choice[doc.index] = size
    while _promote(docs, choice, sorted(sizes), world, cost):
        pass
    entries: list[Assignment] = []
    phases = []
    for size in sorted(set(choice.values()), reverse=True):
        placed, longest = _place_phase(
            [d for d in docs if choice[d.index] == size], size, world, cost
        )
        entries += placed
        phases.append(
            {
                "ring_size": size,
                "rings": world // size,
                "documents": len(placed),
                "predicted_s": longest,
            }
        )
    return Schedule(world, sorted(sizes), budget, entries, phases)


def _promote(docs: Sequence[DocLength], choice: dict[int, int], sizes, world: int, cost) -> bool:
    """Move to the next larger ring size every document that alone outlasts its phase's
    average ring load (the phase's rank-seconds / W) and runs faster there (a short one, whose
    cost is the ring's per-step overhead, stays); True when any moved. Sizes only grow,
    so the loop that calls this ends."""
    phase: dict[int, float] = {}
    for doc in docs:
        size = choice[doc.index]
        phase[size] = phase.get(size, 0.0) + cost(doc.tokens, size) * size / world
    moved = False
    for doc in docs:
        size = choice[doc.index]
        if size == sizes[-1] or cost(doc.tokens, size) <= phase[size]:
            continue
        bigger = sizes[sizes.index(size) + 1]
        if cost(doc.tokens, bigger) < cost(doc.tokens, size):  # it does run faster there
            choice[doc.index], moved = bigger, True
    return moved


def _place_phase(docs: list[DocLength], size: int, world: int, cost: Cost):
    """Longest first to the least-loaded ring of this size; returns (entries, phase time)."""
    loads = [(0.0, ring) for ring in range(world // size)]
    heapq.heapify(loads)
    queue_len = [0] * (world // size)
    placed = []
    for doc in sorted(docs, key=lambda d: (-cost(d.tokens, size), d.index)):
        load, ring = heapq.heappop(loads)
        seconds = cost(doc.tokens, size)
        members = Ring(size, ring).members
        placed.append(
            Assignment(
                doc.index, doc.doc_id, doc.tokens, size, ring, members, queue_len[ring], seconds
            )
        )
        queue_len[ring] += 1
        heapq.heappush(loads, (load + seconds, ring))
    return placed, max((load for load, _ in loads), default=0.0)


def too_long(doc_id: str, tokens: int, sizes, budget: int, layout: str) -> str:
    """Why no ring of the job holds a document (``ring_holds``), with what would. A budget
    under the layout's rows per rank (a device's, which the config's check never saw) holds
    nothing on any ring: then only a larger budget would (``ranks_needed`` says why)."""
    biggest = max(sizes)
    try:
        need = f"it needs a ring of at least {ranks_needed(tokens, budget, layout)} ranks, or"
    except ValueError as err:
        need = f"{err}: it needs"
    return (
        f"document {doc_id!r} has {tokens:,} tokens: no ring of this job holds it "
        f"(max_tokens_per_rank {budget:,}; the largest ring, {biggest} ranks, holds "
        f"{ring_capacity(biggest, budget, layout):,}); {need} a larger ring.max_tokens_per_rank"
    )


def schedule_documents(
    docs: Sequence[DocLength],
    *,
    world: int,
    size: int | str | None,
    budget: int | None,
    layout: str,
) -> Schedule:
    """The schedule of a job's ``ring.size`` and ``ring.max_tokens_per_rank``: null size and
    no budget is the single ring of 0.1 (input order); ``auto`` needs a budget (ValueError)."""
    sizes = ring_sizes(world, size if size is not None else world)
    if budget is None and len(sizes) > 1:
        raise ValueError(
            "ring.size=auto needs a per-rank token budget: set ring.max_tokens_per_rank "
            "(`ringctl plan JOB` suggests one for the job's device and model)"
        )
    kwargs = {"world": world, "sizes": sizes, "layout": layout}
    if sizes == [world] and budget is None:  # the single ring of 0.1: input order
        return build_schedule(docs, budget=UNLIMITED, cost=same_cost, **kwargs)
    return build_schedule(docs, budget=int(budget or UNLIMITED), **kwargs)


def same_cost(tokens: int, size: int) -> float:
    """Every document the same: on one ring, the schedule keeps the input order."""
    return 1.0


def priced(schedule: Schedule, cost: Cost) -> Schedule:
    """The same assignments and order, each priced by ``cost`` (the planner's seconds): a
    phase lasts as long as its busiest ring. What the scheduler decided is left as it is."""
    entries = [replace(e, predicted_s=cost(e.tokens, e.ring_size)) for e in schedule.entries]
    phases = []
    for phase in schedule.phases:
        loads: dict[int, float] = {}
        for e in entries:
            if e.ring_size == phase["ring_size"]:
                loads[e.ring] = loads.get(e.ring, 0.0) + e.predicted_s
        phases.append({**phase, "predicted_s": max(loads.values(), default=0.0)})
    return replace(schedule, entries=entries, phases=phases, cost_unit="seconds")
