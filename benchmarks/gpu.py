"""The GPU check's benchmark: block kernels and the one-GPU ring against SDPA, and a 1M-token
document scored on one GPU. scripts/gpu-check runs it after tests/gpu.

    python -m benchmarks.gpu OUTDIR               # on one GPU: table + OUTDIR/gpu-check.{json,md}
    python -m benchmarks.gpu --cpu-smoke OUTDIR   # tiny sizes on the CPU: proves it runs

Three parts, each side by side with PyTorch's SDPA in the same process:

* block kernels (what ``select_kernel`` picks: torch's fused CUDA kernels without flash-attn)
  on the blocks a ring of 8 ranks computes at N = 128k (full, causal diagonal, zigzag half),
  forward and backward TFLOP/s against SDPA on the same shapes (target: >= 90%);
* ``LocalRing`` forward+backward, 8 virtual ranks, causal zigzag, bf16, 32 heads / 8 kv heads /
  head_dim 128, at N = 128k and 1M, against SDPA on the whole sequence: time, TFLOP/s, peak
  memory (target at 128k: >= 85% of SDPA's throughput; the ranks run one after another, so
  this is the ring's compute, merge and bookkeeping, not overlap);
* the same ring at 128k with a sliding window of 4096 (Mistral's): its time against the
  causal ring's and the K/V hops it makes;
* scoring one 1M-token document with the bundled tiny Llama through ``ringattn.hf`` on a
  one-rank NCCL group.

Times are CUDA events (medians); FLOPs are FlashAttention's accounting (forward 4*B*H*Sq*Sk*D,
halved when causal; backward 2.5x forward). The 1M-token rows are skipped, with the reason
printed, when the 128k timings say they would not finish inside ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

GPU = dict(
    heads=32,
    kv_heads=8,
    head_dim=128,
    block=16384,
    ring_seqs=(131072, 1048576),
    doc_tokens=1 << 20,
    dtype="bfloat16",
    ranks=8,
    repeats=3,
    targets=True,
    window=4096,
)
# Tiny sizes on a CPU: proves every part runs; its timings are overhead and judge nothing.
SMOKE = dict(
    heads=4,
    kv_heads=2,
    head_dim=32,
    block=128,
    ring_seqs=(256, 1024),
    doc_tokens=4096,
    dtype="float32",
    ranks=8,
    repeats=1,
    targets=False,
    window=64,
)
KERNEL_TARGET, RING_TARGET = 0.90, 0.85


@dataclass
class Row:
    part: str
    name: str
    shape: str
    ours_s: float | None = None
    sdpa_s: float | None = None
    flops: float = 0.0
    ours_peak_gib: float | None = None
    sdpa_peak_gib: float | None = None
    target: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:  # our throughput / SDPA's
        if self.ours_s and self.sdpa_s:
            return self.sdpa_s / self.ours_s
        return None


class Timer:
    """Median seconds of fn(): CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def once(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def median(self, fn, repeats: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeats))


def _peak_gib(device: torch.device, fn) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _flops(b, h, sq, sk, d, causal) -> float:
    return 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)


# ----------------------------------------------------------------------------- kernels
def kernel_rows(cfg: dict, device: torch.device, timer: Timer) -> list[Row]:
    n = cfg["block"]
    kinds = {"full": (n, n, False), "diag": (n, n, True), "half": (n // 2, n, False)}
    dtypes = [cfg["dtype"]] + (["float16", "float32"] if device.type == "cuda" else [])
    rows = []
    for dtype_name in dtypes:
        for kind, (sq, sk, causal) in kinds.items():
            if dtype_name == cfg["dtype"] or kind == "full":  # other dtypes: full block only
                rows += _kernel_pair(cfg, device, timer, dtype_name, kind, sq, sk, causal)
    if device.type == "cuda":  # the op cuDNN replaced, side by side on the same block
        from ringattn.kernels import TorchCUDAKernel

        flash = TorchCUDAKernel(ops=("flash",))
        sq, sk, causal = kinds["full"]
        rows += _kernel_pair(cfg, device, timer, cfg["dtype"], "full", sq, sk, causal, flash)
    return rows


def _kernel_pair(
    cfg, device, timer: Timer, dtype_name, kind, sq, sk, causal, kernel=None
) -> list[Row]:
    """Forward and backward rows of a kernel (the selected one by default) and SDPA on one
    block shape."""
    from ringattn.kernels import select_kernel

    h, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    dtype = getattr(torch, dtype_name)
    q = torch.randn(1, sq, h, d, device=device, dtype=dtype)
    k = torch.randn(1, sk, hkv, d, device=device, dtype=dtype)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    kernel, scale = kernel or select_kernel(q), d**-0.5
    out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)

    def fwd():
        kernel.forward(q, k, v, scale=scale, causal=causal)

    def bwd():
        kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)

    t_fwd, t_bwd = timer.median(fwd, cfg["repeats"]), timer.median(bwd, cfg["repeats"])
    s_fwd, s_bwd = _sdpa_block_times(q, k, v, dout, causal, timer, cfg["repeats"])
    flops = _flops(1, h, sq, sk, d, causal)
    shape = f"{dtype_name} {kind} q{sq} kv{sk} h{h}/{hkv} d{d}"
    name = getattr(kernel, "name", type(kernel).__name__)
    if hasattr(kernel, "op_for"):  # TorchCUDAKernel: which of its ops ran
        name = f"{name}[{kernel.op_for(q, k)}]"
    target = KERNEL_TARGET if cfg["targets"] else None
    return [
        Row("kernel", f"{name} fwd", shape, t_fwd, s_fwd, flops, target=target),
        Row("kernel", f"{name} bwd", shape, t_bwd, s_bwd, 2.5 * flops, target=target),
    ]


def _sdpa_block_times(q, k, v, dout, causal, timer: Timer, repeats: int) -> tuple[float, float]:
    """SDPA's forward and backward on the block. Grouped heads natively where SDPA can (its
    flash backend, fp16/bf16); else (fp32: only the math backend takes grouped heads) K/V are
    repeated first, so SDPA runs its memory-efficient kernel as ours does."""
    groups = q.shape[2] // k.shape[2]
    gqa = groups > 1 and q.dtype in (torch.float16, torch.bfloat16)
    if groups > 1 and not gqa:
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

    t_fwd = timer.median(fwd, repeats)
    out = fwd()
    t_bwd = timer.median(
        lambda: torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True), repeats
    )
    return t_fwd, t_bwd


# ----------------------------------------------------------------------------- ring
def _ring_inputs(cfg, n, device):
    dtype = getattr(torch, cfg["dtype"])
    q = torch.randn(1, n, cfg["heads"], cfg["head_dim"], device=device, dtype=dtype)
    k = torch.randn(1, n, cfg["kv_heads"], cfg["head_dim"], device=device, dtype=dtype)
    return q, k, torch.randn_like(k), torch.randn_like(q)


def _ring_step(q, k, v, dout, ranks, window=None):
    from ringattn import ring_attention
    from ringattn.local_ring import LocalRing

    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(
        qq, kk, vv, causal=True, layout="zigzag", comm=LocalRing(ranks), window=window
    )
    out.backward(dout)


def _sdpa_step(q, k, v, dout):
    qq, kk, vv = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    out.backward(dout.transpose(1, 2))


def ring_rows(cfg, device, timer: Timer, deadline: float) -> list[Row]:
    rows, per_token2, measured = [], None, None  # measured: (N, row) of the first ring timed
    for n in cfg["ring_seqs"]:
        shape = (
            f"{cfg['dtype']} N={n} P={cfg['ranks']} causal zigzag "
            f"h{cfg['heads']}/{cfg['kv_heads']} d{cfg['head_dim']}"
        )
        if per_token2 is not None:  # time grows as N^2
            estimate, left = per_token2 * n * n * 1.2, deadline - time.monotonic()
            if estimate > left:
                note = f"skipped: needs ~{estimate:.0f} s, {left:.0f} s of the budget left"
                print(f"# {shape}: {note}", flush=True)
                rows.append(Row("ring", "LocalRing fwd+bwd", shape, note=note))
                continue
        too_big = _past_memory(cfg, device, measured, n)
        if too_big:
            print(f"# {shape}: {too_big}", flush=True)
            rows.append(Row("ring", "LocalRing fwd+bwd", shape, note=too_big))
            continue
        try:
            rows.append(_ring_row(cfg, n, shape, device, timer, first=per_token2 is None))
        except torch.OutOfMemoryError:  # the rows before it stand; say where memory ran out
            rows.append(Row("ring", "LocalRing fwd+bwd", shape, note="out of GPU memory"))
            torch.cuda.empty_cache()
            continue
        per_token2 = (rows[-1].ours_s + rows[-1].sdpa_s) / (n * n)
        measured = measured or (n, rows[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if len(rows) == 1:
            rows.append(_windowed_row(cfg, n, device, timer, rows[0]))
    return rows


def _past_memory(cfg, device, measured: tuple[int, Row] | None, n: int) -> str:
    """Why a ring of N tokens would not fit this GPU, or "": LocalRing holds every rank's
    blocks on the one device, so its peak grows as N; priced from the first measured ring, plus
    the inputs (q, k, v, dout: the peaks are measured above them). An H100's 80 GB holds the 128k
    ring, not the 1M one an H200's 141 GB holds (it ran out at 76 GiB)."""
    if device.type != "cuda" or measured is None:
        return ""
    n0, first = measured
    peak = max(first.ours_peak_gib or 0.0, first.sdpa_peak_gib or 0.0) * n / n0 * 1.1
    width = 2 * (cfg["heads"] + cfg["kv_heads"]) * cfg["head_dim"]
    inputs = n * width * torch.finfo(getattr(torch, cfg["dtype"])).bits / 8 / 2**30
    free = torch.cuda.mem_get_info(device)[0] / 2**30
    if peak + inputs <= 0.95 * free:
        return ""
    return f"skipped: needs ~{peak + inputs:.0f} GiB of GPU memory, {free:.0f} GiB free"


def _windowed_row(cfg, n, device, timer: Timer, causal: Row) -> Row:
    """The same ring with a sliding window (Mistral's 4096 on the GPU): banded boundary blocks,
    blocks behind the window skipped, the ring cut short (ringattn.geometry.ring_reach). No
    SDPA column: SDPA would need the N x N window as a mask. FLOPs: the visible pairs."""
    from ringattn.geometry import ring_reach

    w, ranks = cfg["window"], cfg["ranks"]
    shape = (
        f"{cfg['dtype']} N={n} P={ranks} causal zigzag window {w} "
        f"h{cfg['heads']}/{cfg['kv_heads']} d{cfg['head_dim']}"
    )
    pairs = n * w - w * (w - 1) / 2
    flops = 3.5 * 4.0 * cfg["heads"] * pairs * cfg["head_dim"]
    row = Row("ring", "LocalRing fwd+bwd, windowed", shape, flops=flops)
    q, k, v, dout = _ring_inputs(cfg, n, device)
    row.ours_s = timer.median(lambda: _ring_step(q, k, v, dout, ranks, w), cfg["repeats"], 1)
    row.ours_peak_gib = _peak_gib(device, lambda: _ring_step(q, k, v, dout, ranks, w))
    hops = sum(ring_reach(ranks, n // ranks, True, "zigzag", w))
    ratio = row.ours_s / causal.ours_s if causal.ours_s else float("nan")
    row.note = f"{ratio:.2f}x the causal ring's time; K/V hops {hops} of {ranks - 1}"
    return row


def _ring_row(cfg, n, shape, device, timer: Timer, first: bool) -> Row:
    flops = 3.5 * _flops(1, cfg["heads"], n, n, cfg["head_dim"], True)
    target = RING_TARGET if cfg["targets"] and first else None  # the target is at 128k
    row = Row("ring", "LocalRing fwd+bwd", shape, flops=flops, target=target)
    q, k, v, dout = _ring_inputs(cfg, n, device)

    def ring():
        _ring_step(q, k, v, dout, cfg["ranks"])

    def sdpa():
        _sdpa_step(q, k, v, dout)

    repeats, warmup = (cfg["repeats"], 1) if first else (1, 0)
    if first or device.type != "cuda":
        row.ours_s = timer.median(ring, repeats, warmup)
        row.sdpa_s = timer.median(sdpa, repeats, warmup)
        row.ours_peak_gib, row.sdpa_peak_gib = _peak_gib(device, ring), _peak_gib(device, sdpa)
    else:  # one run each, timed and measured at once (a second run would double the cost)
        row.ours_peak_gib = _peak_gib(device, lambda: setattr(row, "ours_s", timer.once(ring)))
        row.sdpa_peak_gib = _peak_gib(device, lambda: setattr(row, "sdpa_s", timer.once(sdpa)))
    return row


# ----------------------------------------------------------------------------- document
def document_row(cfg, device, timer: Timer, deadline: float) -> Row:
    n = cfg["doc_tokens"]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    row = Row("document", "score 1 document, tiny Llama", f"{n} tokens, 1 rank, {dtype}")
    try:
        import torch.distributed as dist

        from ringctl.longdoc.compute.scoring import run_task
        from ringctl.longdoc.model.load import load_model
    except ImportError as err:  # e.g. a dependency of the long-document code is missing
        row.note = f"skipped: {err}"
        print(f"# document: {row.note}", flush=True)
        return row
    if deadline - time.monotonic() < 60:
        row.note = "skipped: the time budget is spent"
        return row
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            model = load_model(None, dtype=dtype, device=device)
            ids = torch.randint(
                0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)
            )
            result = {}

            def score():
                result["r"] = run_task(
                    "score", model, ids, group=None, layout="zigzag", chunk_size=65536
                )

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row.ours_s = timer.once(score)
            stats = result["r"].stats
            row.extra = {
                "tokens_per_s": n / row.ours_s,
                "perplexity": stats["perplexity"],
                "n_scored": stats["n_scored"],
            }
            if device.type == "cuda":
                row.ours_peak_gib = torch.cuda.max_memory_allocated() / 2**30
            ok = stats["n_scored"] == n - 1 and math.isfinite(stats["log_likelihood"])
            row.note = f"perplexity {stats['perplexity']:.2f}" + ("" if ok else " NOT FINITE")
        finally:
            dist.destroy_process_group()
    return row


# ----------------------------------------------------------------------------- report
def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def _tflops(flops: float, seconds: float | None) -> float | None:
    return flops / seconds / 1e12 if seconds and flops else None


def table(rows: list[Row]) -> list[str]:
    head = (
        "| part | what | shape | ours ms | SDPA ms | ours TFLOP/s | SDPA TFLOP/s | "
        "throughput vs SDPA | target | ours peak GiB | SDPA peak GiB | note |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        verdict = ""
        if r.target is not None and r.ratio is not None:
            verdict = f"{r.target:.0%} " + ("met" if r.ratio >= r.target else "MISSED")
        lines.append(
            "| "
            + " | ".join(
                [
                    r.part,
                    r.name,
                    r.shape,
                    _fmt(r.ours_s and 1e3 * r.ours_s, ".1f"),
                    _fmt(r.sdpa_s and 1e3 * r.sdpa_s, ".1f"),
                    _fmt(_tflops(r.flops, r.ours_s), ".1f"),
                    _fmt(_tflops(r.flops, r.sdpa_s), ".1f"),
                    _fmt(r.ratio, ".2f"),
                    verdict,
                    _fmt(r.ours_peak_gib, ".2f"),
                    _fmt(r.sdpa_peak_gib, ".2f"),
                    r.note,
                ]
            )
            + " |"
        )
    return lines


def environment(device: torch.device) -> dict:
    import importlib.util

    flash = importlib.util.find_spec("flash_attn") is not None  # not imported: CUDA-only
    env = {"torch": torch.__version__, "device": str(device), "flash_attn": flash}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("outdir", type=Path, help="where gpu-check.json and gpu-check.md go")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="seconds this benchmark may take; rows that would run past it are skipped",
    )
    args = p.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here (use --cpu-smoke for the CPU run)")
        return 2
    cfg = SMOKE if args.cpu_smoke else GPU
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    deadline = time.monotonic() + args.budget_s
    timer = Timer(device)
    rows: list[Row] = []
    errors: list[str] = []
    lines: list[str] = []
    parts = [
        ("kernels", lambda: kernel_rows(cfg, device, timer)),
        ("ring", lambda: ring_rows(cfg, device, timer, deadline)),
        ("document", lambda: [document_row(cfg, device, timer, deadline)]),
    ]
    for name, run in parts:
        print(f"# {name} ...", flush=True)
        try:
            rows += run()
        except Exception:  # report and go on: the other parts still say something
            errors.append(f"{name}: {traceback.format_exc()}")
            print(errors[-1], file=sys.stderr, flush=True)
        lines = write_report(args.outdir, rows, errors, device, args.cpu_smoke)  # after each part
    print("\n".join(lines))
    print(f"wrote {args.outdir / 'gpu-check.json'}, {args.outdir / 'gpu-check.md'}")
    return 1 if errors else 0


def write_report(outdir: Path, rows: list[Row], errors: list[str], device, smoke: bool):
    """The table so far, as OUTDIR/gpu-check.{json,md}: a run cut short still leaves them."""
    lines = table(rows)
    outdir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    payload = {
        "benchmark": "gpu-check",
        "smoke": smoke,
        "environment": env,
        "rows": [{**r.__dict__, "ratio": r.ratio} for r in rows],
        "errors": errors,
    }
    (outdir / "gpu-check.json").write_text(json.dumps(payload, indent=2) + "\n")
    flag = "--cpu-smoke " if smoke else ""
    when = time.strftime("%Y-%m-%d %H:%M")
    md = [
        "# GPU check",
        "",
        f"`python -m benchmarks.gpu {flag}` on {env.get('gpu', 'CPU')}, torch {env['torch']}, "
        f"{when}.",
        "",
        *lines,
        *(["", "Errors:", "```", *errors, "```"] if errors else []),
    ]
    (outdir / "gpu-check.md").write_text("\n".join(md) + "\n")
    return lines


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
