"""What `ringctl submit` costs before anything runs, as the corpus grows: time and memory.

    python -m benchmarks.submit_cost                          # 25k, 100k, 400k records
    python -m benchmarks.submit_cost --records 1000000 --formats jsonl   # the issue's case

Submit reads a long-document job's inputs twice (the task's check lists them, then the sizing
lists them again for their lengths), and every rank lists them once more when it starts. For
each format and size, a corpus of one-line records is written (``{"text": "record i ..."}``);
a fresh process (its peak memory is its own) submits a corpus of one record first (the
imports are not the corpus's cost), then does with the corpus what submit does up to the
backend: ``load_job`` (the task's check: the first listing) and ``check_documents`` (the
sizing: the second), with ``ring.max_tokens_per_rank`` set so the documents are checked.

It reports wall and CPU seconds, the peak RSS it grew by (VmHWM against VmRSS before), both
per record, the exponent between neighbouring sizes (log cost / log records: 1.0 is linear),
and the CPU other jobs used meanwhile (``OutsideLoad``). The machine is shared: read the CPU
seconds, and a row taken under load (``!``) as noisy. A table is printed and JSON written
(default benchmarks/results/submit-cost.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.outside_load import OutsideLoad
from benchmarks.results_file import write_results

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "longdoc.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "submit-cost.json"
FORMATS = ("jsonl", "json", "jsonl.gz", "parquet")

# What submit does before the backend, in a process of its own; prints one JSON line.
SUBMIT = """
import json, sys, time
from ringctl.config import load_job
from ringctl.sizing import Sizing
from ringctl.submission import check_documents
import ringctl.tasks.longdoc

def kib(field):
    return int(next(x for x in open("/proc/self/status") if x.startswith(field + ":")).split()[1])

def submit(corpus):
    cfg = load_job(sys.argv[1], [f"task.inputs=[{corpus}]", "ring.max_tokens_per_rank=1000000",
                                 "task.model_path=bundled:demo-byte-llama"])
    check_documents(Sizing(cfg))

submit(sys.argv[3])  # a corpus of one record first: the imports are not the corpus's cost
before, wall, cpu = kib("VmRSS"), time.perf_counter(), time.process_time()
submit(sys.argv[2])
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "peak_grown_mib": (kib("VmHWM") - before) / 1024}))
"""


@dataclass
class Row:
    format: str
    records: int
    file_mib: float
    wall_s: float
    cpu_s: float
    peak_grown_mib: float
    us_per_record: float  # CPU
    bytes_per_record: float  # peak growth
    time_exponent: float | None  # against the previous size of the same format
    memory_exponent: float | None
    outside_cores: float | None  # other jobs' CPU use meanwhile


def write_corpus(folder: Path, fmt: str, records: int) -> Path:
    """``records`` one-line records in the format, each ``{"text": "record i of the corpus"}``."""
    path = folder / f"corpus-{records}.{fmt}"
    texts = (f"record {i} of the corpus" for i in range(records))
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": list(texts)}), path)
    elif fmt == "json":
        with open(path, "w") as f:
            f.write("[\n" + ",\n".join(json.dumps({"text": t}) for t in texts) + "\n]\n")
    else:
        opener = gzip.open if fmt == "jsonl.gz" else open
        with opener(path, "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


def measure(path: Path, warm: Path) -> tuple[dict, float | None]:
    """(what the submit process printed, the outside load meanwhile); ``warm``: the corpus of
    one record it submits first."""
    with OutsideLoad() as load:
        proc = subprocess.run(
            [sys.executable, "-c", SUBMIT, str(JOB), str(path), str(warm)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if proc.returncode != 0:
        raise SystemExit(f"submit of {path} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1]), load.reading.outside_cores


def _exponent(now: float, then: float, n_now: int, n_then: int) -> float | None:
    if now <= 0 or then <= 0:
        return None
    return math.log(now / then) / math.log(n_now / n_then)


def run(formats: list[str], sizes: list[int]) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="submit-cost-") as tmp:
        for fmt in formats:
            previous: Row | None = None
            warm = write_corpus(Path(tmp), fmt, 1)
            for n in sorted(sizes):
                path = write_corpus(Path(tmp), fmt, n)
                got, outside = measure(path, warm)
                rows.append(_row(fmt, n, path.stat().st_size, got, outside, previous))
                previous = rows[-1]
                path.unlink()
    return rows


def _row(fmt: str, n: int, size: int, got: dict, outside, previous: Row | None) -> Row:
    cpu, peak = got["cpu_s"], got["peak_grown_mib"]
    then = previous.records if previous else n
    return Row(
        format=fmt,
        records=n,
        file_mib=size / 2**20,
        wall_s=got["wall_s"],
        cpu_s=cpu,
        peak_grown_mib=peak,
        us_per_record=cpu / n * 1e6,
        bytes_per_record=peak * 2**20 / n,
        time_exponent=_exponent(cpu, previous.cpu_s, n, then) if previous else None,
        memory_exponent=_exponent(peak, previous.peak_grown_mib, n, then) if previous else None,
        outside_cores=outside,
    )


def table(rows: list[Row], threshold: float) -> str:
    head = (
        f"{'format':9} {'records':>9} {'file MiB':>9} {'wall s':>7} {'CPU s':>7} "
        f"{'peak+ MiB':>9} {'us/rec':>7} {'B/rec':>6} {'t exp':>6} {'m exp':>6} {'outside':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        busy = r.outside_cores is not None and r.outside_cores > threshold
        out = f"{r.outside_cores:.2f}{'!' if busy else ' '}" if r.outside_cores is not None else ""
        lines.append(
            f"{r.format:9} {r.records:9,} {r.file_mib:9.1f} {r.wall_s:7.2f} {r.cpu_s:7.2f} "
            f"{r.peak_grown_mib:9.1f} {r.us_per_record:7.1f} {r.bytes_per_record:6.0f} "
            f"{_exp(r.time_exponent)} {_exp(r.memory_exponent)} {out:>8}"
        )
    return "\n".join(lines)


def _exp(value: float | None) -> str:
    return f"{value:6.2f}" if value is not None else " " * 6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--json", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--load-threshold", type=float, default=0.5, help="outside cores that flag a row (!)"
    )
    args = parser.parse_args(argv)
    rows = run(args.formats, args.records)
    print(table(rows, args.load_threshold))
    write_results(args.json, "submit_cost", sys.argv[1:] if argv is None else argv, rows)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
