"""Long documents at scale: one ring of the whole job against many rings, side by side.

    python -m benchmarks.longdoc_throughput                 # W = 4 local CPU ranks
    python -m benchmarks.longdoc_throughput --short 60 --long 2 --json out.json

A seeded, heavy-tailed corpus (a few long documents, many short ones, lengths log-normal)
is scored by the bundled tiny Llama on W local ranks (real processes, gloo), once per
`ring.size` setting, in one run: W (one ring: the behaviour of 0.1), W/2, 1 and auto (each
document on the smallest ring that holds it under `--budget` tokens per rank). Reported per
setting: run time of the job (state.json's start to end: model loading included, the
submit before it not; the same for all), tokens/s, the schedule's phases, and the largest
difference of any document's per-token log-probabilities from the single ring's (every
setting computes the same numbers; one that
differs beyond float32 rounding is reported WRONG and the run exits 1). Then the same question
on paper for a GPU cluster: the planner's predicted makespan for 64 H100s, a Llama-3-8B shape
and 10,000 documents (log-normal, 4k to 1M tokens), one ring against auto.

Writes a markdown table, JSON and a PNG (with matplotlib) next to --json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results/longdoc-throughput.json")
AGREE_TOL = 1e-5
WORDS = (
    "the keeper writes the tide down and the ring of ranks passes blocks along while "
    "each shard of every long document keeps its own queries"
).split()


def make_corpus(root: Path, *, short: int, long: int, seed: int) -> tuple[Path, list[int]]:
    """`long` documents of 5-8k bytes and `short` ones of 60-1500 (log-normal), as .txt."""
    rng = random.Random(seed)
    docs = root / "corpus"
    docs.mkdir(parents=True)
    sizes = [rng.randint(5000, 8000) for _ in range(long)]
    sizes += [min(1500, max(60, int(rng.lognormvariate(5.6, 0.8)))) for _ in range(short)]
    rng.shuffle(sizes)
    for i, size in enumerate(sizes):
        text = ""
        while len(text) < size:
            text += rng.choice(WORDS) + " "
        (docs / f"doc{i:04d}.txt").write_text(text[:size])
    return docs, sizes


def run_job(job_dir: Path, corpus: Path, world: int, ring: list[str]) -> dict:
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
        "task.model_path=bundled:demo-byte-llama",  # the bundled byte model, no package needed
        *ring,
    ]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(ring) or 'one ring'}: the job failed:\n{proc.stderr[-3000:]}")
    state = json.loads((job_dir / "state.json").read_text())
    schedule = json.loads((job_dir / "schedule.json").read_text())
    return {
        "wall_s": wall,
        "job_s": state["ended_at"] - state["started_at"],
        "phases": schedule["phases"],
    }


def logprobs(job_dir: Path) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ringctl.longdoc.output.gather import gather

    out = gather(job_dir, job_dir.parent / f"{job_dir.name}-gathered", force=True).out
    found = {}
    for path in (out / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            found[fh.metadata()["doc_id"]] = load_file(str(path))["token_logprob"]
    return found


def largest_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for doc, ref in b.items():
        if ref.numel():
            scale = ref.abs().max().clamp_min(1e-30)
            worst = max(worst, ((a[doc].double() - ref.double()).abs().max() / scale).item())
    return worst


def paper_comparison() -> dict:
    """The planner's makespan for the issue's GPU cluster, one ring against auto."""
    argv = [
        sys.executable,
        "-m",
        "ringctl.cli",
        "plan",
        "--model",
        "llama3-8b",
        "--ranks",
        "64",
        "--nodes",
        "8",
        "--device",
        "H100-SXM",
        "--mode",
        "score",
        "--corpus",
        "lognormal:10000:4096:1048576",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return {
        "command": " ".join(["ringctl", *argv[3:]]),
        "output": proc.stdout.strip(),
        "exit": proc.returncode,
    }


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is missing (pip install 'ringctl[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["setting"] for r in rows], [r["tokens_per_s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("tokens/s (job wall time)")
    ax.set_title("long documents on 4 CPU ranks: one ring vs many")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Long documents: one ring against many",
        "",
        f"`{meta['command']}` on {meta['host']}: {meta['documents']} documents, "
        f"{meta['tokens']} tokens, W = {meta['world']} ranks, budget {meta['budget']} "
        "tokens per rank for auto. Wall time of each job, model loading included.",
        "",
        "| ring.size | phases (documents on rings of N) | job s | tokens/s | vs one ring | "
        "max diff vs one ring |",
        "|---|---|---:|---:|---:|---:|",
    ]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        phases = ", ".join(f"{p['documents']}x{p['ring_size']}" for p in r["phases"])
        flag = " WRONG" if r["max_diff"] > AGREE_TOL else ""
        lines.append(
            f"| {r['setting']} | {phases} | {r['job_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['max_diff']:.1e}{flag} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[1])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--short", type=int, default=48, help="short documents (default 48)")
    ap.add_argument("--long", type=int, default=3, help="long documents (default 3)")
    ap.add_argument("--budget", type=int, default=2048, help="auto's tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-paper", action="store_true", help="skip the planner's GPU comparison")
    args = ap.parse_args(argv)
    world = args.ranks
    auto = ["ring.size=auto", f"ring.max_tokens_per_rank={args.budget}"]
    settings = [
        (f"{world} (one ring)", []),
        (str(world // 2), [f"ring.size={world // 2}"]),
        ("1", ["ring.size=1"]),
        ("auto", auto),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        corpus, sizes = make_corpus(Path(tmp), short=args.short, long=args.long, seed=args.seed)
        rows, first = [], None
        for name, ring in settings:
            job = Path(tmp) / f"job-{len(rows)}"
            got = run_job(job, corpus, world, ring)
            lp = logprobs(job)
            first = first or lp
            rows.append(
                {
                    "setting": name,
                    **got,
                    "tokens": sum(sizes),
                    "tokens_per_s": sum(sizes) / got["job_s"],
                    "max_diff": largest_difference(lp, first),
                }
            )
            print(
                f"{name:>14}: {got['job_s']:.1f} s, {rows[-1]['tokens_per_s']:.0f} tokens/s, "
                f"max diff {rows[-1]['max_diff']:.1e}",
                flush=True,
            )
    meta = {
        "command": "python -m benchmarks.longdoc_throughput " + " ".join(argv or sys.argv[1:]),
        "host": __import__("socket").gethostname(),
        "documents": len(sizes),
        "tokens": sum(sizes),
        "world": world,
        "budget": args.budget,
    }
    text = table(rows, meta)
    if not args.no_paper:
        paper = paper_comparison()
        meta["paper"] = paper
        text += "\n## On paper: 64 H100s\n\n```text\n"
        text += f"$ {paper['command']}\n{paper['output']}\n```\n"
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.json.with_suffix(".md").write_text(text)
    plot(rows, args.json.with_suffix(".png"))
    return 1 if any(r["max_diff"] > AGREE_TOL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
