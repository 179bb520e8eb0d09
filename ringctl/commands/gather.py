"""`ringctl gather JOBDIR [-o OUT]`: verify a long-document job's shards and reassemble them.

Exit status: 0 when every document verified and OUT was written; 2 for a usage error (no such
job directory, OUT exists without --force); 3 when shards are missing or corrupt (each one is
named on stderr, and nothing is written).
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gather",
        help="verify a long-document job's output shards and reassemble each document",
        description=(
            "Check that every token position of every document is covered exactly once by "
            "shards with valid checksums, undo the sequence layout, and write one file per "
            "document plus summary.json / summary.csv. Missing or corrupt shards are named and "
            "gather exits with status 3 without writing anything."
        ),
    )
    p.add_argument("job_dir", metavar="JOBDIR", help="the job directory (or its out/ directory)")
    p.add_argument(
        "-o", "--out", metavar="OUT", help="where to write the results (default JOBDIR/gathered)"
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..gather import gather, summary_table

    result = gather(args.job_dir, args.out, force=args.force)
    console = Console()
    console.print(summary_table(result))
    if result.missing_inputs:
        console.print(
            f"[yellow]warning:[/] {len(result.missing_inputs)} input(s) were missing when the "
            f"job ran and are not in the results: {', '.join(result.missing_inputs)}"
        )
    console.print(f"wrote {result.out} (summary.json, summary.csv, docs/)")
    return 0
