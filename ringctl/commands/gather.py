"""`ringctl gather JOBDIR [-o OUT]`: verify a long-document job's shards and reassemble them.

Exit status: 0 when every document verified and OUT was written; 2 for a usage error (no such
job directory, OUT exists without --force); 3 when shards are missing or corrupt (each one is
named on stderr, and nothing is written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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


def fetch_remote_outputs(job_dir: Path, console) -> None:
    """A job submitted over SSH ran on the remote login node's filesystem: bring its files
    (shards, manifests, logs) into the local job directory by SFTP before verifying them."""
    try:
        backend_name = json.loads((job_dir / "job.json").read_text()).get("backend")
    except (OSError, ValueError):
        return
    if backend_name != "ssh":
        return
    from .jobs import open_job_dir

    job_dir, _cfg, backend = open_job_dir(job_dir)
    try:
        fetched = backend.fetch(job_dir)
    finally:
        backend.close()
    console.print(f"fetched {len(fetched)} file(s) of the remote job over SFTP")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..gather import gather, summary_table

    console = Console()
    fetch_remote_outputs(Path(args.job_dir), console)
    result = gather(args.job_dir, args.out, force=args.force)
    console.print(summary_table(result))
    if result.missing_inputs:
        console.print(
            f"[yellow]warning:[/] {len(result.missing_inputs)} input(s) were missing when the "
            f"job ran and are not in the results: {', '.join(result.missing_inputs)}"
        )
    console.print(f"wrote {result.out} (summary.json, summary.csv, docs/)")
    return 0
