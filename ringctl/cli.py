"""The `ringctl` command: verbs only.

Each verb lives in its own module, which registers its argparse sub-parser and the function it
calls; this file wires them and maps errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import UserError

# Each module has `register(subparsers)`; the order here is the order of `ringctl --help`.
VERB_MODULES = [
    "ringctl.commands.jobs",  # config, render, submit, run, status, logs, cancel
    "ringctl.commands.gather",  # gather
    "ringctl.commands.topo",  # topo (and topo probe)
    "ringctl.commands.plan",  # plan
    "ringctl.commands.example",  # example
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringctl",
        description=(
            "Run exact ring attention over very long sequences: on this machine, on the Slurm "
            "cluster you are logged into, or on a cluster reached over SSH."
        ),
        epilog="Run `ringctl VERB --help` for the options of each verb.",
    )
    parser.add_argument("--version", action="version", version=f"ringctl {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERB_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except UserError as err:
        print(f"ringctl {args.verb}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"ringctl {args.verb}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
