"""Whether a demo run's gathered summary has the bits per byte scripts/demo-expected.json
records (scripts/demo on its defaults, and tests/test_smollm2.py): a demo whose ring went wrong
printed its numbers and exited 0.

    python3 scripts/demo_check.py JOBDIR/gathered/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXPECTED = Path(__file__).with_name("demo-expected.json")


def problems(summary_path: Path) -> list[str]:
    """One line per sample missing or off by more than the recorded relative tolerance."""
    want = json.loads(EXPECTED.read_text())
    tol = float(want["relative_tolerance"])
    summary = json.loads(Path(summary_path).read_text())
    got = {row["document"]: row.get("bits_per_byte") for row in summary["documents"]}
    out = []
    for name, expected in want["bits_per_byte"].items():
        value = got.get(name)
        if value is None:
            out.append(f"{name}: no bits per byte (expected {expected})")
        elif abs(value - expected) > tol * expected:
            out.append(f"{name}: {value:.4f} bits per byte, expected {expected} (+-{tol:.1%})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    found = problems(Path(argv[0]))
    for line in found:
        print(f"demo check: {line}", file=sys.stderr)
    if not found:
        print(f"demo check: bits per byte as {EXPECTED.name} records")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
