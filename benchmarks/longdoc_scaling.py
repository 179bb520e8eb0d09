"""Cost that grows as it should: the long-document job over N, measured beside the planner.

    python -m benchmarks.longdoc_scaling --max-n 32k --ranks 2      # a quick check (minutes)
    python -m benchmarks.longdoc_scaling --windowed-only            # the window, 32k..1M
    python -m benchmarks.longdoc_scaling --headline                 # 1M tokens on 4 ranks
    python -m benchmarks.longdoc_scaling --dry-run                  # the rows and predictions

Ring attention promises context limited only by the ring's memory: per rank, memory O(N/P)
and time O(N^2/P) for full causal attention, O(N W/P) under a sliding window W. Each row here
runs the long-document job itself (`ringctl run longdoc`, the local backend: P CPU ranks over
gloo, the probe included) on one document of N random bytes, which is N tokens for a tiny
Mistral-type model of 256 byte ids (random weights), with the window in the ring
(`sliding_window: W`, default 4096) or with full causal attention (`sliding_window: null`).

Measured per row: the job's wall time (supervisor start to end: loading, probe, scoring,
writing), the scoring time (the document's seconds as its slowest rank recorded them), tokens/s
of scoring, the busiest rank's CPU seconds from the start of scoring (less disturbed than wall
time by other load), and per rank the peak RSS (whole life) and the growth of RSS while scoring
(peak during scoring minus the RSS when scoring began): `benchmarks/rank_memory.py` runs each
rank as its interpreter and measures it from outside. Beside it, the planner's prediction for
the same ring with this machine's calibration: the forward's seconds (the whole model: ring
attention from the block tables at the model's head dim, projections, MLP and head at the
measured matmul rate; attention alone with an entry calibrated before matmuls were timed) and
memory per rank. Then the fitted exponents, least squares on log-log:
scoring time against N per (attention, P) -- about 1 with the window, 2 without -- and RSS
growth against N/P per attention -- about 1.

Default rows: windowed N = 32k, 128k, 512k, 1M and full N = 32k, 64k, 128k, 256k, on P = 2
and 4. `--headline`: 1M tokens on 4 ranks, windowed and full causal (exact: about half an
hour of attention on 2 cores). Rows are merged into the JSON by (attention, P, N), so rows
from separate runs combine into one table; the markdown and PNG are redrawn from all of them.
A row whose job fails or whose scores are not those of an N-token document is reported and
the run exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from benchmarks.rank_memory import write_shim
from benchmarks.results_file import write_results

DEFAULT_OUT = Path("benchmarks/results/longdoc-scaling.json")
PLAN_CHECK = Path(__file__).resolve().parent / "results" / "plan-check.json"
WINDOWED_N = ("32k", "128k", "512k", "1M")
FULL_N = ("32k", "64k", "128k", "256k")
HEADLINE = (("window", 4, "1M"), ("full", 4, "1M"))
TINY = dict(
    model_type="mistral",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1 << 21,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
KIB_PER_MIB = 1024


@dataclass
class Row:
    """One job: what ran, what it measured, and what the planner predicted for it."""

    attention: str  # "window" or "full"
    window: int | None
    ranks: int
    tokens: int
    job_s: float = 0.0  # supervisor start to end
    scoring_s: float = 0.0  # the slowest rank's seconds for the document
    scoring_s_by_rank: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0  # N / scoring_s
    scoring_cpu_s: float | None = None  # the busiest rank's CPU seconds after scoring began
    peak_rss_mib: list[float] = field(default_factory=list)  # per rank, whole life
    scoring_base_mib: list[float | None] = field(default_factory=list)  # RSS as scoring began
    scoring_growth_mib: list[float | None] = field(default_factory=list)  # peak - base
    predicted_s: float | None = None  # the forward (whole model where the entry can)
    predicted_memory_mib: float | None = None
    planner_device: str | None = None
    perplexity: float | None = None
    load_before: float = 0.0  # 1-minute load average
    load_after: float = 0.0
    host: str = ""
    cpus: int = 0
    measured_at: str = ""
    command: str = ""
    problem: str | None = None  # set: the row is not to be trusted, and says why

    @property
    def key(self) -> tuple[str, int, int]:
        return self.attention, self.ranks, self.tokens


def parse_size(text: str) -> int:
    """'32k' -> 32768, '1M' -> 1048576, '5000' -> 5000."""
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a token count such as 32k or 1M")
    return int(digits) * scale


def size_name(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("k", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def model_config(root: Path, window: int | None) -> Path:
    path = root / f"mistral-{'w' + str(window) if window else 'full'}.json"
    path.write_text(json.dumps(dict(TINY, sliding_window=window), indent=1) + "\n")
    return path


def make_document(root: Path, tokens: int, seed: int) -> Path:
    """N random bytes (N byte tokens) in a directory of their own (the job's input), made
    once per N: the windowed and the full causal rows score the same document."""
    folder = root / f"doc-{tokens}"
    if not folder.exists():
        folder.mkdir()
        path = folder / f"random-{size_name(tokens)}.txt"
        path.write_bytes(random.Random(seed + tokens).randbytes(tokens))
    return folder


def job_argv(job_dir: Path, docs: Path, config: Path, ranks: int, shim: Path, timeout: int):
    return [
        sys.executable,
        "-m",
        "ringctl.cli",
        "run",
        "longdoc",
        f"job_dir={job_dir}",
        f"task.inputs=[{docs}]",
        f"task.model_path={config}",
        "nodes=1",
        f"tasks_per_node={ranks}",
        f"timeout={timeout}",
        f"env.python={shim}",
    ]


def read_scoring(job_dir: Path, tokens: int, ranks: int) -> tuple[list[float], dict, str | None]:
    """(seconds per rank, the document's stats, a problem or None) from the written shards."""
    entries = sorted((job_dir / "out" / "longdoc" / "shards").glob("*/rank-*.json"))
    if len(entries) != ranks:
        return [], {}, f"{len(entries)} shard entries for {ranks} ranks"
    records = [json.loads(p.read_text()) for p in entries]
    stats = records[0]["stats"]
    if stats.get("n_scored") != tokens - 1 or not math.isfinite(stats.get("log_likelihood", 0)):
        return [], stats, f"scored {stats.get('n_scored')} of {tokens - 1} tokens"
    if any(r["n_tokens"] != tokens for r in records):
        return [], stats, "a shard records another document length"
    return [float(r["seconds"]) for r in records], stats, None


def read_ranks(job_dir: Path, ranks: int) -> list[dict] | None:
    """Each rank's logs/rank-<R>.memory.json (benchmarks/rank_memory.py), or None."""
    paths = [job_dir / "logs" / f"rank-{rank}.memory.json" for rank in range(ranks)]
    if not all(p.exists() for p in paths):
        return None
    return [json.loads(p.read_text()) for p in paths]


def scoring_cpu_s(records: list[dict]) -> float | None:
    """The busiest rank's CPU seconds from the start of scoring to its exit (load on other
    cores stretches wall time, much less CPU time)."""
    spent = [r["cpu_s"] - r["cpu_at_mark_s"] for r in records if r.get("cpu_at_mark_s")]
    return max(spent) if len(spent) == len(records) else None


def read_memory(records: list[dict]) -> tuple[list, list, list, str | None]:
    """(peak MiB, base MiB, growth MiB) per rank."""
    peaks, bases, growth = [], [], []
    for rec in records:
        peaks.append(rec["peak_kib"] / KIB_PER_MIB)
        marked = rec.get("scoring_peak_kib") is not None
        bases.append(rec["at_mark_kib"] / KIB_PER_MIB if marked else None)
        growth.append(
            (rec["scoring_peak_kib"] - rec["at_mark_kib"]) / KIB_PER_MIB if marked else None
        )
    if None in growth:
        return peaks, bases, growth, "the start of scoring was not seen: no scoring memory"
    return peaks, bases, growth, None


def planner_device(name: str | None, devices: Path | None, scratch: Path):
    """(Device, where its calibration came from) or (None, why not): the named entry, else
    this host's calibrated entry (cpu-<host>), else the one benchmarks/plan_check recorded
    if it is this host's (copied to ``scratch`` as a device file). Another machine's
    calibration is not used."""
    from ringctl.errors import UserError
    from ringctl.planner.devices import get_device, load_devices

    host = f"cpu-{socket.gethostname().split('.')[0]}"
    wanted = name or host
    try:
        if name or wanted in load_devices(devices):
            return get_device(wanted, devices), wanted
    except UserError as err:
        return None, str(err)
    if PLAN_CHECK.exists():
        recorded = json.loads(PLAN_CHECK.read_text())
        if recorded.get("device") == host:
            extra = scratch / "devices.json"
            extra.write_text(json.dumps({host: recorded["calibration"]}))
            return get_device(host, extra), f"{host} ({PLAN_CHECK.name})"
    return None, f"no calibration for {host}: run `ringctl plan --calibrate` first"


def predict(config: Path, tokens: int, ranks: int, device) -> tuple[float, float]:
    """The planner's seconds of the forward and memory per rank (MiB) for this job's ring:
    the whole model where the entry has a matmul rate (calibrated with head dims and matmuls),
    else ring attention alone."""
    from ringattn.geometry import padded_length
    from ringctl.longdoc.model.compat import model_shape
    from ringctl.planner.cost import GIB, Workload, estimate, nominal_link

    m = model_shape(config)
    w = Workload(
        seq_len=tokens,
        heads=m.heads,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        dtype="float32",
        model=m,
        mode="score",
        backward=False,
        lm_head_chunk=4096,
    )
    # as the job pads it
    w = replace(w, seq_len=padded_length(tokens, world_size=ranks, layout=w.layout))
    est = estimate(
        w, ranks, device, nominal_link(device), ranks_on_host=ranks, overlap_threshold=False
    )
    seconds = est.model_total_s if est.model_total_s is not None else est.total_s["forward"]
    return seconds, est.memory_total_gib * GIB / 2**20


def run_row(spec: tuple[str, int, int], root: Path, args, device) -> Row:
    attention, ranks, tokens = spec
    window = args.window if attention == "window" else None
    row = Row(
        attention,
        window,
        ranks,
        tokens,
        host=socket.gethostname(),
        cpus=os.cpu_count() or 0,
        measured_at=time.strftime("%Y-%m-%d %H:%M"),
        command="python -m benchmarks.longdoc_scaling " + " ".join(args.argv),
    )
    config = model_config(root, window)
    if device[0] is not None:
        row.predicted_s, row.predicted_memory_mib = predict(config, tokens, ranks, device[0])
        row.planner_device = device[1]
    if args.dry_run:
        return row
    docs = make_document(root, tokens, args.seed)
    job = root / f"job-{attention}-{ranks}-{tokens}"
    argv = job_argv(job, docs, config, ranks, write_shim(root / "rank-python"), args.timeout)
    row.load_before = os.getloadavg()[0]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    row.load_after = os.getloadavg()[0]
    if proc.returncode != 0:
        row.problem = "the job failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return row
    state = json.loads((job / "state.json").read_text())
    row.job_s = state["ended_at"] - state["started_at"]
    seconds, stats, problem = read_scoring(job, tokens, ranks)
    records = read_ranks(job, ranks)
    if records is None:
        row.problem = problem or "a rank left no memory record"
        return row
    peaks, bases, growth, mem_problem = read_memory(records)
    row.scoring_cpu_s = scoring_cpu_s(records)
    row.scoring_s_by_rank, row.peak_rss_mib = seconds, peaks
    row.scoring_base_mib, row.scoring_growth_mib = bases, growth
    row.scoring_s = max(seconds) if seconds else 0.0
    row.tokens_per_s = tokens / row.scoring_s if row.scoring_s else 0.0
    row.perplexity = stats.get("perplexity")
    row.problem = problem or mem_problem
    return row


def selected(args) -> list[tuple[str, int, int]]:
    """The (attention, P, N) rows the flags ask for, in the order they run (cheapest first)."""
    if args.headline:
        rows = [(a, p, parse_size(n)) for a, p, n in HEADLINE]
    else:
        rows = [("window", p, n) for n in args.windowed_n for p in args.ranks]
        rows += [("full", p, n) for n in args.full_n for p in args.ranks]
    keep = []
    for attention, ranks, n in rows:
        if (attention == "full" and args.windowed_only) or (
            attention == "window" and args.full_only
        ):
            continue
        if ranks not in args.ranks or (args.max_n and n > args.max_n):
            continue
        if attention == "full" and args.full_max_n and n > args.full_max_n:
            continue
        keep.append((attention, ranks, n))
    return sorted(keep, key=lambda r: (_work(r, args.window), r[1]))


def _work(spec: tuple[str, int, int], window: int) -> float:
    """Scores to compute, roughly: N W under the window, N^2 / 2 without."""
    attention, _, n = spec
    return n * min(n, window) if attention == "window" else n * n / 2


# ----------------------------------------------------------------------------- results
def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """The slope of log y against log x (least squares); None below two distinct x."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def _fit(what: str, attention: str, ranks, rows: list[Row], x, measured, predicted) -> dict:
    xs = [x(r) for r in rows]
    return {
        "what": what,
        "attention": attention,
        "ranks": ranks,
        "rows": len(rows),
        "measured": fit_exponent(xs, [measured(r) or 0 for r in rows]),
        "predicted": fit_exponent(xs, [predicted(r) or 0 for r in rows]) if predicted else None,
    }


def fits(rows: list[Row]) -> list[dict]:
    """Exponents of the trusted rows: scoring time (wall and CPU) vs N per (attention, P),
    RSS growth vs N/P per attention; the planner's predictions fitted alike."""
    good = [r for r in rows if r.problem is None and r.scoring_s > 0]
    out = []
    for attention in ("window", "full"):
        mine = [r for r in good if r.attention == attention]
        for ranks in sorted({r.ranks for r in mine}):
            rs = [r for r in mine if r.ranks == ranks]
            out.append(
                _fit(
                    "scoring time vs N",
                    attention,
                    ranks,
                    rs,
                    lambda r: r.tokens,
                    lambda r: r.scoring_s,
                    lambda r: r.predicted_s,
                )
            )
            out.append(
                _fit(
                    "scoring CPU time vs N",
                    attention,
                    ranks,
                    rs,
                    lambda r: r.tokens,
                    lambda r: r.scoring_cpu_s,
                    None,
                )
            )
        if mine:
            out.append(
                _fit(
                    "RSS growth per rank vs N/P",
                    attention,
                    None,
                    mine,
                    lambda r: r.tokens / r.ranks,
                    lambda r: max(r.scoring_growth_mib),
                    lambda r: r.predicted_memory_mib,
                )
            )
    return out


def merge(path: Path, new: list[Row]) -> list[Row]:
    """The rows already in ``path`` with ``new`` put in by (attention, P, N)."""
    rows: dict = {}
    if path.exists():
        names = {f.name for f in fields(Row)}
        for item in json.loads(path.read_text()).get("results", []):
            item = {"predicted_s": item.get("predicted_attention_s")} | item  # older rows
            row = Row(**{k: v for k, v in item.items() if k in names})
            rows[row.key] = row
    for row in new:
        rows[row.key] = row
    return sorted(rows.values(), key=lambda r: (r.attention != "window", r.ranks, r.tokens))


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[Row]) -> str:
    lines = [
        "# Long documents: cost against N",
        "",
        "`python -m benchmarks.longdoc_scaling`: the long-document job (`ringctl run longdoc`, "
        "local CPU ranks over gloo) on one document of N random bytes, a tiny Mistral-type "
        "model (2 layers, 4 heads of 16, 256 byte ids). Job: supervisor start to end; scoring: "
        "the document's seconds on its slowest rank; RSS: the largest over the ranks, peak over "
        "the rank's life and growth while scoring. Predicted: `ringctl plan`'s forward seconds "
        "for the same ring with this host's calibration (`ringctl plan --calibrate`: block "
        "tables at head dims 16, 64 and 128, the job's 16 read from its own, and the measured "
        "matmul rate for projections, MLP and head, and the measured elementwise rate for "
        "norms, RoPE and activations) and memory per rank; `--repredict` prices every row "
        "again with the calibration as it is, `--repredict-memory` only the memory (it does not "
        "depend on a calibration). Scoring CPU: the busiest rank's CPU seconds from "
        "the start of scoring to its exit (less disturbed by other load than wall time). Load: "
        "1-minute load average before/after the job. Rows keep the day they were measured "
        "(host column): this virtual machine's speed changes from day to day (the full causal "
        "64k row on 2 ranks took 13.65 s on 2026-12-02 and 6.09 s on 2026-12-03), so compare "
        "a row with predictions from a calibration of the same day.",
        "",
        "| attention | P | N | N/P | job s | scoring s | scoring CPU s | tokens/s | peak RSS MiB "
        "| scoring growth MiB | predicted attn s | scoring / predicted | predicted MiB | load | "
        "host |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        name = f"window {r.window}" if r.attention == "window" else "full causal"
        growth = (
            max(r.scoring_growth_mib)
            if r.scoring_growth_mib and None not in r.scoring_growth_mib
            else None
        )
        ratio = r.scoring_s / r.predicted_s if r.predicted_s and r.scoring_s else None
        flag = f" **{r.problem}**" if r.problem else ""
        lines.append(
            f"| {name}{flag} | {r.ranks} | {size_name(r.tokens)} | {size_name(r.tokens // r.ranks)}"
            f" | {r.job_s:.1f} | {r.scoring_s:.2f} | {_num(r.scoring_cpu_s, '.2f')} | "
            f"{r.tokens_per_s:.0f} | "
            f"{_num(max(r.peak_rss_mib, default=None), '.0f')} | {_num(growth, '.0f')} | "
            f"{_num(r.predicted_s, '.2f')} | {_num(ratio, '.2f')} | "
            f"{_num(r.predicted_memory_mib, '.0f')} | {r.load_before:.1f}/{r.load_after:.1f} | "
            f"{r.host} {r.measured_at} |"
        )
    lines += [
        "",
        "## Fitted exponents (least squares on log-log)",
        "",
        "| what | attention | P | rows | measured | predicted |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for f in fits(rows):
        lines.append(
            f"| {f['what']} | {f['attention']} | {f['ranks'] or 'all'} | {f['rows']} | "
            f"{_num(f['measured'], '.2f')} | {_num(f['predicted'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is missing (pip install 'ringctl[bench]')")
        return
    good = [r for r in rows if r.problem is None and r.scoring_s > 0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for attention, ranks in sorted({(r.attention, r.ranks) for r in good}):
        rs = sorted(
            (r for r in good if (r.attention, r.ranks) == (attention, ranks)),
            key=lambda r: r.tokens,
        )
        label = f"{'window' if attention == 'window' else 'full'} P={ranks}"
        xs = [r.tokens for r in rs]
        line = left.loglog(xs, [r.scoring_s for r in rs], "o-", label=label)[0]
        predicted = [r.predicted_s for r in rs]
        if None not in predicted:
            left.loglog(xs, predicted, "--", color=line.get_color())
        per_rank = [r.tokens / r.ranks for r in rs]
        growth = [max(r.scoring_growth_mib) for r in rs]
        right.loglog(per_rank, growth, "o-", color=line.get_color(), label=label)
        memory = [r.predicted_memory_mib for r in rs]
        if None not in memory:
            right.loglog(per_rank, memory, "--", color=line.get_color())
    left.set(
        xlabel="N (tokens)",
        ylabel="scoring s (dashed: planner)",
        title="time: O(N W / P) windowed, O(N^2 / P) full",
    )
    right.set(
        xlabel="N / P (tokens per rank)",
        ylabel="RSS growth while scoring, MiB (dashed: planner)",
        title="memory per rank: O(N / P)",
    )
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part]


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected rank counts such as 2,4") from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected rank counts such as 2,4")
    return ranks


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.longdoc_scaling",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ranks", type=_ranks, default=[2, 4], help="P values (default 2,4)")
    ap.add_argument("--windowed-n", type=_sizes, default=[parse_size(n) for n in WINDOWED_N])
    ap.add_argument("--full-n", type=_sizes, default=[parse_size(n) for n in FULL_N])
    ap.add_argument("--max-n", type=parse_size, help="leave out rows with more tokens")
    ap.add_argument("--full-max-n", type=parse_size, help="the same, full causal rows only")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--windowed-only", action="store_true")
    only.add_argument("--full-only", action="store_true")
    ap.add_argument(
        "--headline",
        action="store_true",
        help="1M tokens on 4 ranks, windowed and full (the flags above still filter)",
    )
    ap.add_argument("--window", type=int, default=4096, help="sliding window (default 4096)")
    ap.add_argument(
        "--timeout",
        type=int,
        default=3600,
        help="the job's collective timeout, seconds (default 3600)",
    )
    ap.add_argument("--device", help="planner device (default: this host's calibration)")
    ap.add_argument("--devices", type=Path, help="a device file to read it from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="list the rows with the planner's predictions; run nothing",
    )
    ap.add_argument("--keep", type=Path, help="keep the job directories under this folder")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="price the rows of --json again with the planner as it is; run nothing",
    )
    ap.add_argument(
        "--repredict-memory",
        action="store_true",
        help="price only the memory per rank of the rows of --json again (it does not depend "
        "on a calibration; the seconds keep their day's); run nothing",
    )
    args = ap.parse_args(argv)
    args.argv = argv
    if args.window < 1:
        ap.error("--window must be at least 1")
    return args


def _report(row: Row) -> None:
    if row.problem:
        print(f"  {row.attention} P={row.ranks} N={size_name(row.tokens)}: {row.problem}")
        return
    predicted = _num(row.predicted_s, ".1f")
    print(
        f"  {row.attention} P={row.ranks} N={size_name(row.tokens)}: job {row.job_s:.1f} s, "
        f"scoring {row.scoring_s:.2f} s (planner: {predicted} s), "
        f"{row.tokens_per_s:.0f} tokens/s, RSS growth {max(row.scoring_growth_mib):.0f} MiB "
        f"per rank",
        flush=True,
    )


def save(path: Path, rows: list[Row], argv: list[str]) -> list[Row]:
    """Merge ``rows`` into the JSON and redraw the markdown from every row (after each job, so
    a long run that is stopped keeps what it measured)."""
    merged = merge(path, rows)
    write_results(
        path, "longdoc_scaling", ["python", "-m", "benchmarks.longdoc_scaling", *argv], merged
    )
    path.with_suffix(".md").write_text(table(merged))
    return merged


def _dry_run(row: Row) -> None:
    print(
        f"  {row.attention} P={row.ranks} N={size_name(row.tokens)}: planner "
        f"{_num(row.predicted_s, '.1f')} s, "
        f"{_num(row.predicted_memory_mib, '.0f')} MiB per rank"
    )


def repredict(path: Path, root: Path, device) -> list[Row]:
    """Every stored row priced again by the planner as it is now (the measurements kept)."""
    rows = merge(path, [])
    for row in rows:
        config = model_config(root, row.window)
        row.predicted_s, row.predicted_memory_mib = predict(
            config, row.tokens, row.ranks, device[0]
        )
        row.planner_device = device[1]
    return rows


def repredict_memory(path: Path, root: Path) -> list[Row]:
    """Every stored row's memory per rank priced again by the planner as it is now. Memory
    does not depend on a device's rates, so the recorded calibration serves any host; the
    seconds stay as priced by the calibration of their own day."""
    from ringctl.planner.devices import get_device

    recorded = json.loads(PLAN_CHECK.read_text())
    extra = root / "devices.json"
    extra.write_text(json.dumps({recorded["device"]: recorded["calibration"]}))
    device = get_device(recorded["device"], extra)
    rows = merge(path, [])
    for row in rows:
        config = model_config(root, row.window)
        row.predicted_memory_mib = predict(config, row.tokens, row.ranks, device)[1]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.repredict_memory:
        with tempfile.TemporaryDirectory(prefix="longdoc-scaling-") as root:
            merged = save(args.json, repredict_memory(args.json, Path(root)), args.argv)
        print(table(merged))
        plot(merged, args.json.with_suffix(".png"))
        return 0
    specs = [] if args.repredict else selected(args)
    if not specs and not args.repredict:
        print("no rows: the flags leave none")
        return 2
    root = Path(tempfile.mkdtemp(prefix="longdoc-scaling-", dir=args.keep))
    device = planner_device(args.device, args.devices, root)
    if device[0] is None:
        print(f"no predictions: {device[1]}")
        if args.repredict:
            return 2
    rows: list[Row] = []
    merged = repredict(args.json, root, device) if args.repredict else []
    try:
        for spec in specs:
            rows.append(run_row(spec, root, args, device))
            if args.dry_run:
                _dry_run(rows[-1])
                continue
            _report(rows[-1])
            merged = save(args.json, rows, args.argv)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.dry_run:
        return 0
    if args.repredict:
        merged = save(args.json, merged, args.argv)
    print(table(merged))
    plot(merged, args.json.with_suffix(".png"))
    return 1 if any(r.problem for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
