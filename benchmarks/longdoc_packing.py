"""Short documents in the long-document job: packed sequences against padded rows and one
document at a time, side by side in one run, same ranks, same corpus.

    python -m benchmarks.longdoc_packing                    # 2 local CPU ranks, ring of 2
    python -m benchmarks.longdoc_packing --docs 120 --budget 2048

A seeded corpus with a 100x length spread (30 to 3000 bytes, log-normal) is scored by the
bundled tiny Llama (byte ids) on W local ranks (real processes), as one ring:

* ``packed``: this tree, under ``ring.max_tokens_per_rank=--budget``: consecutive documents
  packed into one sequence (``longdoc/compute/packing.py``);
* ``padded rows``: the commit before packing (``--padded-commit``, checked out in a temporary
  git worktree and run from there), under the same budget: rows right-padded to the batch's
  longest, each row zigzag-sharded;
* ``one at a time``: this tree without a budget: each document its own ring call;
* and the bundled windowed demo model (``bundled:demo-byte-llama``) packed and one at a time
  (padded rows never batched a windowed model).

Reported per run: the job's wall time (submit to end, model loading included, the same for
all) and its scoring time (the ranks' own seconds over the documents), tokens/s of scoring,
rows the forwards add to the tokens (padding: the packed layout's under P rows per pack, a
padded row's up to its batch's longest, a lone document's up to 2P), the work balance (the
busiest rank's visible query-key pairs over the mean, summed over the forwards: a forward
waits for its busiest rank), and the largest difference of any document's per-token
log-probabilities from one-at-a-time's (beyond 1e-5: WRONG, exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.longdoc_throughput import largest_difference, logprobs
from benchmarks.results_file import write_results
from ringattn import geometry

DEFAULT_OUT = Path("benchmarks/results/longdoc-packing.json")
PADDED_COMMIT = "f90f619"  # the last commit with padded-row batching (longdoc/compute/batching.py)
AGREE_TOL = 1e-5
MAX_ROWS = 64  # that commit's batching.MAX_ROWS


def make_corpus(root: Path, count: int, seed: int) -> tuple[Path, list[int]]:
    rng = random.Random(seed)
    docs = root / "corpus"
    docs.mkdir(parents=True)
    sizes = [min(3000, max(30, int(rng.lognormvariate(5.5, 1.1)))) for _ in range(count)]
    sizes[0], sizes[1] = 30, 3000  # the spread's two ends, always there
    for i, size in enumerate(sizes):
        (docs / f"doc{i:04d}.txt").write_bytes(bytes(rng.randrange(32, 127) for _ in range(size)))
    return docs, sizes


def run_job(job_dir: Path, corpus: Path, world: int, extra: list[str], tree: Path) -> dict:
    argv = [
        sys.executable,
        "-m",
        "ringctl.cli",
        "run",
        "longdoc",
        f"job_dir={job_dir}",
        f"task.inputs=[{corpus}]",
        "nodes=1",
        f"tasks_per_node={world}",
        "timeout=600",
        "task.chunk_size=1024",
        f"ring.size={world}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tree, env=env, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{job_dir.name}: the job failed:\n{proc.stderr[-3000:]}")
    seconds = 0.0
    for entry in (job_dir / "out" / "longdoc" / "shards").glob("*/rank-00000.json"):
        seconds += json.loads(entry.read_text())["seconds"]
    return {"wall_s": wall, "scoring_s": seconds}


def packed_forwards(job_dir: Path, world: int) -> list[tuple[list[int], int]]:
    """(per-rank work, rows) of each forward of a packed run, from its entries' packs."""
    packs, singles = set(), []
    for entry in (job_dir / "out" / "longdoc" / "shards").glob("*/rank-00000.json"):
        e = json.loads(entry.read_text())
        if "packing" in e:
            packs.add((tuple(e["packing"]["cu_seqlens"]), e["packing"]["balance_window"]))
        else:
            singles.append(e["n_tokens"])
    out = [_single(n, world) for n in singles]
    for cu, window in packs:
        lay = geometry.packed_layout(cu, world, "zigzag", 1, window)
        out.append(([lay.pairs(r, True, None) for r in range(world)], world * lay.rows))
    return out


def _single(n: int, world: int) -> tuple[list[int], int]:
    """A document alone: zigzag over its padded length (the padding rows are computed)."""
    padded = geometry.padded_length(n, world_size=world, layout="zigzag")
    lay = geometry.plain_layout(padded, world, "zigzag")
    return [lay.pairs(r, True, None) for r in range(world)], padded


def padded_forwards(sizes: list[int], world: int, budget: int) -> list[tuple[list[int], int]]:
    """The padded-row batches the earlier commit formed (its rule: consecutive documents while
    rows x padded longest / P stays within the budget, at most MAX_ROWS rows), as forwards."""
    out, run = [], []
    for n in [*sizes, None]:
        width = (
            None
            if n is None
            else geometry.padded_length(max([n, *run]), world_size=world, layout="zigzag")
        )
        full = n is None or (
            run and ((len(run) + 1) * width // world > budget or len(run) >= MAX_ROWS)
        )
        if full and run:
            w = geometry.padded_length(max(run), world_size=world, layout="zigzag")
            lay = geometry.plain_layout(w, world, "zigzag")
            out.append(([len(run) * lay.pairs(r, True, None) for r in range(world)], len(run) * w))
            run = []
        if n is not None:
            run.append(n)
    return out


def summary(forwards, tokens: int) -> tuple[float, float]:
    """(rows added as % of the tokens, busiest-rank work over the mean, over the forwards)."""
    rows = sum(r for _, r in forwards)
    busiest = sum(max(w) for w, _ in forwards)
    mean = sum(sum(w) / len(w) for w, _ in forwards)
    return 100.0 * (rows - tokens) / tokens, busiest / mean


def _worktree(commit: str, where: Path) -> Path:
    tree = where / "padded-tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True
    )
    return tree


def measure(args, tmp: Path) -> list[dict]:
    here = Path(__file__).resolve().parents[1]
    corpus, sizes = make_corpus(tmp, args.docs, args.seed)
    tokens, world, budget = sum(sizes), args.ranks, [f"ring.max_tokens_per_rank={args.budget}"]
    tree = _worktree(args.padded_commit, tmp)
    try:
        tiny = ["task.model_path=null"]
        DEMO = ["task.model_path=bundled:demo-byte-llama"]  # the byte model, not the job's default
        runs = [
            ("packed", "tiny Llama", budget + tiny, here),
            ("padded rows", "tiny Llama", budget + tiny, tree),
            ("one at a time", "tiny Llama", tiny, here),
            ("packed", "demo (window 2048)", budget + DEMO, here),
            ("one at a time", "demo (window 2048)", DEMO, here),
        ]
        rows, outputs = [], {}
        for name, model, extra, where in runs:
            job = tmp / f"{name}-{model}".replace(" ", "_").replace("(", "").replace(")", "")
            timing = run_job(job, corpus, world, extra, where)
            outputs[(name, model)] = logprobs(job)
            forwards = (
                padded_forwards(sizes, world, args.budget)
                if name == "padded rows"
                else packed_forwards(job, world)
            )
            added, balance = summary(forwards, tokens)
            rows.append(
                {
                    "run": name,
                    "model": model,
                    "documents": len(sizes),
                    "tokens": tokens,
                    "forwards": len(forwards),
                    **timing,
                    "tokens_per_s": tokens / timing["scoring_s"],
                    "rows_added_pct": added,
                    "work_balance": balance,
                }
            )
            print(_line(rows[-1]), flush=True)
        for row in rows:
            ref = outputs[("one at a time", row["model"])]
            row["max_rel_diff"] = largest_difference(outputs[(row["run"], row["model"])], ref)
            row["agrees"] = row["max_rel_diff"] <= AGREE_TOL
        return rows
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], capture_output=True)


HEADER = (
    "| model | run | forwards | job s | scoring s | tokens/s | rows added | work balance | "
    "max rel diff |\n|---|---|---|---|---|---|---|---|---|"
)


def _line(r: dict) -> str:
    diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "-"
    flag = "" if r.get("agrees", True) else " WRONG"
    return (
        f"| {r['model']} | {r['run']} | {r['forwards']} | {r['wall_s']:.1f} | "
        f"{r['scoring_s']:.2f} | {r['tokens_per_s']:.0f} | {r['rows_added_pct']:.1f}% | "
        f"{r['work_balance']:.3f} | {diff}{flag} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=80)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--budget", type=int, default=2048, help="ring.max_tokens_per_rank")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--padded-commit", default=PADDED_COMMIT)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, Path(tmp))
    print(HEADER)
    for r in rows:
        print(_line(r))
    argv_used = sys.argv[1:] if argv is None else argv
    write_results(args.out, "longdoc_packing", argv_used, rows)
    md = args.out.with_suffix(".md")
    md.write_text(
        f"{__doc__.splitlines()[0]}\n\n`python -m benchmarks.longdoc_packing "
        f"{' '.join(argv_used)}`\n\n{HEADER}\n" + "\n".join(map(_line, rows)) + "\n"
    )
    print(f"wrote {args.out} and {md}")
    return 0 if all(r["agrees"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
