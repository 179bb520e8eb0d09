"""The attention job checks its own result: the ranks' out, dq, dk, dv against float64
attention over the whole sequence (`attention.reference`), by rank 0 once every rank wrote
its shards.

Without it the smoke job, which "checks that a machine, a cluster or a set-up works end to
end", wrote shards and timings only: a ring made 1% wrong (a broken kernel or transport on a
new cluster) ended COMPLETED, exit 0. The reference holds a few B x H x N x N float64
matrices in one process, so a job larger than `MAX_SCORES` is not checked, and says so.

Tolerances are on the largest error relative to the largest reference value, per dtype. The
reference rounds the inputs to the job's dtype first, so what is left is the kernels'
arithmetic: float32 rounding (1.2e-7 per operation) summed over N keys stays near 1e-6 (the
tests' bound is 1e-5; measured 1.7e-7 to 1.2e-6 over layouts, GQA, Ulysses degrees); half
precision rounds every output to 8 (bfloat16) or 11 (float16) bits, 3.9e-3 and 4.9e-4
relative, and gradients add a few such roundings (the bfloat16 ring measured 2.2e-3 to
1.1e-2). A 1% error passes none of the float32 or float64 bounds.

The largest error alone let a 3% error through in half precision (every output scaled by
1.03 passed bfloat16's 5e-2): a systematic error moves every element, rounding a few. So the
root-mean-square error relative to the reference's is bounded too (``RMS_TOLERANCE``):
measured (CPU, N 512-2048, GQA, Ulysses 1-4) bfloat16 2.0e-3 to 6.0e-3 and float16 2.5e-4 to
7.3e-4, where 3% too large reads 3.0e-2 in both.
"""

from __future__ import annotations

# The largest B x H x N x N the float64 reference may hold (8 bytes each; the autograd graph
# keeps about four of them: 2 GiB at the cap).
MAX_SCORES = 1 << 26
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
RMS_TOLERANCE = {"float64": 1e-11, "float32": 1e-5, "float16": 3e-3, "bfloat16": 1.5e-2}


def reference_size(cfg) -> int:
    """B x H x N x N: the elements of one of the reference's score matrices."""
    t = cfg.task
    return int(t.batch) * int(t.heads) * int(t.seq_len) ** 2


def too_large(cfg) -> str | None:
    """Why the job is not checked (its reference too large for one process), or None."""
    size = reference_size(cfg)
    if size <= MAX_SCORES:
        return None
    gib = 4 * 8 * size / (1 << 30)
    return (
        f"not checked against float64 attention: its reference would hold about {gib:,.0f} "
        f"GiB in one process (checked up to B x H x N^2 = {MAX_SCORES:,})"
    )


def compare(want: dict, got: dict, dtype: str) -> tuple[bool, str]:
    """(passed, a line saying how far apart): the ranks' reassembled out, dq, dk, dv
    (``got``) against the float64 reference (``want``): the largest error within
    ``TOLERANCE[dtype]`` and the root-mean-square one within ``RMS_TOLERANCE[dtype]``."""
    tol, rms_tol = TOLERANCE[dtype], RMS_TOLERANCE[dtype]
    errors, rms = {}, {}
    for name in ("out", "dq", "dk", "dv"):
        diff = got[name].double() - want[name]
        scale = float(want[name].abs().max()) or 1.0
        errors[name] = float(diff.abs().max()) / scale
        rms[name] = float(diff.pow(2).mean().sqrt()) / (
            float(want[name].pow(2).mean().sqrt()) or 1.0
        )
    worst = max(errors, key=errors.get)
    passed = all(e <= tol for e in errors.values())  # a NaN error is no pass either
    shown = ", ".join(f"{n} {e:.2g}" for n, e in errors.items())
    spread = max(rms, key=rms.get)
    spread_ok = all(e <= rms_tol for e in rms.values())  # every element off: systematic
    line = (
        f"checked against float64 attention: max |ring - reference| / max |reference| = "
        f"{shown}; {worst} {'within' if passed else 'OVER'} the {dtype} tolerance {tol:g}; "
        f"root-mean-square error at most {spread} {rms[spread]:.2g}, "
        f"{'within' if spread_ok else 'OVER'} its tolerance {rms_tol:g}"
    )
    return passed and spread_ok, line
