"""What the ring costs a training step: the training job's own step on P ranks against one process.

    python -m benchmarks.train_step                          # N = 8k..64k, table + JSON + PNG
    python -m benchmarks.train_step --seq 8k,16k --pairings 1
    python -m benchmarks.train_step --headline               # 1M tokens, windowed, 4 ranks

Both sides run ``ringctl.train.step.train_step`` -- forward and backward of a packed sequence
(documents end to end, each attending only to itself), the gradients summed over the job,
gradient clipping, AdamW -- on the same packed sequence of N tokens, the same model and
weights:

* ring: P ranks x 1 thread over gloo (shared memory between neighbours where the engine's
  transport chooses it), the sequence in the packed zigzag layout;
* one process: a world of one rank with P threads: the same kernel over the whole sequence,
  no transfers, no merges, nothing split.

So the ratio is the ring's own cost (transfers, merges, the layout's pieces, the per-rank
split of the projections), not a kernel's. Pairings: one process, then the ring, repeated, the
median of each side's timed steps (after a warm-up step) kept; both sides see the same noise.
Reported per N: seconds per step, tokens/s, the ring's cost (ring step / one-process step - 1)
and each side's peak RSS per rank (ru_maxrss: the process's whole life, model included).

The model: a Llama of 4 layers, hidden 256, 4 heads of 64 (2 key/value heads), 256 byte
ids, random weights; documents of heavy-tailed lengths (log-normal, median 1,500 tokens, at
most 16k), the same stream for every N. ``--headline``: one optimizer step on a 1M-token
packed sequence of a windowed model (Mistral-type, 2 layers, 4 heads of 16, window 4096,
documents of 128k-384k tokens) on 4 ranks: time and peak memory per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from benchmarks.results_file import write_results

DEFAULT_OUT = Path("benchmarks/results/train-step.json")
DEFAULT_SEQS = ("8k", "16k", "32k", "64k")

LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1 << 20,
    rope_theta=10000.0,
)
WINDOWED = dict(
    model_type="mistral",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1 << 21,
    sliding_window=4096,
    rope_theta=10000.0,
)
COMMON = dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass
class Side:
    """One side's run of one N: ``steps`` timed after a warm-up step."""

    name: str  # "ring" or "one process"
    ranks: int
    threads: int
    step_s: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)  # per rank
    loss: float | None = None


def parse_size(text: str) -> int:
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def size_name(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def document_lengths(total: int, seed: int, headline: bool) -> list[int]:
    """Lengths covering ``total`` tokens: heavy-tailed (log-normal, median 1,500, at most 16k),
    or, for the headline, long documents of 128k-384k tokens the window cuts."""
    rng = random.Random(seed)
    lengths, left = [], total
    while left > 0:
        n = rng.randint(128 << 10, 384 << 10) if headline else int(rng.lognormvariate(7.31, 1.0))
        n = max(2, min(n, 16 << 10) if not headline else n)
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def _sequence(total: int, seed: int, headline: bool):
    """The packed sequence of ``total`` tokens both sides train on (the job's own packing)."""
    import torch

    from ringctl.train.data import Cursor, SequenceStream

    lengths = document_lengths(total, seed, headline)
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    stream = SequenceStream(lambda i: docs[i], len(docs), total, seed)
    return stream.take(Cursor(), 1)[0][0]


def _model(fields: dict):
    import torch
    from transformers import AutoConfig

    from ringattn.hf import register
    from ringctl.longdoc.model.load import build_random

    register()
    config = AutoConfig.for_model(**fields, **COMMON)
    return build_random(config, seed=3, dtype=torch.float32, attn_implementation="ringattn")


def _rank(rank, world, store, threads, total, steps, headline, out_dir):
    """One rank: the training job's step, timed; writes its times and peak RSS."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist

    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=3600),
    )
    fields = WINDOWED if headline else LLAMA
    model = _model(fields)
    model.train()
    optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.1)
    scheduler = make_scheduler(optimizer, warmup_steps=0, max_steps=100, min_lr_ratio=0.1)
    seq = _sequence(total, seed=11, headline=headline)
    seat = RingSeat(None, world, rank, 0, 1, None)
    window = fields.get("sliding_window")
    opts = StepOptions("zigzag", window, chunk_size=1024, clip=1.0, autocast=None)
    seconds, loss = [], None
    for i in range(steps + (0 if headline else 1)):  # a warm-up step, except the headline's
        dist.barrier()
        result = train_step(model, optimizer, scheduler, [seq], range(1), seat, opts, False)
        if headline or i:
            seconds.append(result.seconds)
        loss = result.loss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "peak_rss_mib": peak, "loss": loss}, f)
    dist.destroy_process_group()


def run_side(name: str, ranks: int, threads: int, total: int, steps: int, headline: bool) -> Side:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args = (ranks, f"{tmp}/store", threads, total, steps, headline, tmp)
        mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        found = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(ranks)]
    side = Side(name, ranks, threads, peak_rss_mib=[f["peak_rss_mib"] for f in found])
    side.step_s = [max(times) for times in zip(*(f["seconds"] for f in found), strict=True)]
    side.loss = found[0]["loss"]
    return side


def measure(total: int, ranks: int, steps: int, pairings: int) -> dict:
    """One N: ``pairings`` x (one process, then the ring); the medians and their ratio."""
    ring_s, one_s, losses, row = [], [], [], {}
    for _ in range(pairings):
        one = run_side("one process", 1, ranks, total, steps, False)
        ring = run_side("ring", ranks, 1, total, steps, False)
        one_s += one.step_s
        ring_s += ring.step_s
        losses += [one.loss, ring.loss]
        row = {"one_rss_mib": max(one.peak_rss_mib), "ring_rss_mib": max(ring.peak_rss_mib)}
    ring_med, one_med = statistics.median(ring_s), statistics.median(one_s)
    return {
        "tokens": total,
        "ranks": ranks,
        "ring_step_s": ring_med,
        "one_step_s": one_med,
        "ring_tokens_per_s": total / ring_med,
        "one_tokens_per_s": total / one_med,
        "ring_cost": ring_med / one_med - 1,
        "ring_samples_s": ring_s,
        "one_samples_s": one_s,
        "losses": losses,
        # the same steps on the same sequence: float32 sums in another order, nothing more
        "losses_agree": max(losses) - min(losses) <= 1e-4 * abs(losses[0]),
        **row,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| N | ring s/step | one process s/step | ring tokens/s | one process tokens/s | "
        "ring cost | peak RSS per rank, ring / one MiB | losses agree |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {size_name(r['tokens'])} | {r['ring_step_s']:.2f} | {r['one_step_s']:.2f} | "
            f"{r['ring_tokens_per_s']:.0f} | {r['one_tokens_per_s']:.0f} | "
            f"{100 * r['ring_cost']:+.1f}% | {r['ring_rss_mib']:.0f} / {r['one_rss_mib']:.0f} | "
            f"{'yes' if r['losses_agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is missing (pip install 'ringctl[bench]')")
        return
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogx(xs, [r["ring_tokens_per_s"] for r in rows], "o-", label="ring (2 ranks x 1)")
    ax.semilogx(xs, [r["one_tokens_per_s"] for r in rows], "s--", label="one process (x 2)")
    ax.set(xlabel="tokens per packed sequence", ylabel="training tokens/s", title="train step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def headline(ranks: int) -> dict:
    side = run_side("ring", ranks, 1, 1 << 20, 1, True)
    return {
        "tokens": 1 << 20,
        "ranks": ranks,
        "step_s": side.step_s[0],
        "tokens_per_s": (1 << 20) / side.step_s[0],
        "peak_rss_mib": side.peak_rss_mib,
        "loss": side.loss,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seq", default=",".join(DEFAULT_SEQS), help="N values (8k,16k,...)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (after a warm-up)")
    ap.add_argument("--pairings", type=int, default=2)
    ap.add_argument("--headline", action="store_true", help="1M tokens, windowed, 4 ranks")
    ap.add_argument("--json", type=Path, default=DEFAULT_OUT)
    argv = list(argv) if argv is not None else sys.argv[1:]  # recorded in the JSON
    args = ap.parse_args(argv)
    if args.headline:
        result = headline(4)
        print(
            f"1M-token packed sequence, windowed model, 4 ranks: one optimizer step in "
            f"{result['step_s']:.1f} s ({result['tokens_per_s']:.0f} tokens/s); peak RSS per "
            f"rank {', '.join(f'{m:.0f}' for m in result['peak_rss_mib'])} MiB"
        )
        path = args.json.with_name("train-step-headline.json")
        write_results(path, "train_step --headline", argv or [], [result])
        return 0
    rows = []
    for n in [parse_size(s) for s in args.seq.split(",") if s]:
        rows.append(measure(n, args.ranks, args.steps, args.pairings))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    write_results(args.json, "train_step", argv or [], rows)
    args.json.with_suffix(".md").write_text(
        "# Train step: the ring against one process\n\n`python -m benchmarks.train_step`: "
        + __doc__.split("\n\n")[2].replace("\n", " ")
        + "\n\n"
        + table(rows)
        + "\n"
    )
    plot(rows, args.json.with_suffix(".png"))
    return 0 if all(r["losses_agree"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
