"""The `ringctl` command: verbs only.

Each verb lives in its own module, which registers its argparse sub-parser and the function it
calls; this file wires them and maps errors to exit codes: 2 for a user error (`UserError`,
or an OSError naming a path: a name too long, a file where a folder must be: `path_failure`),
1 for a write the machine refused (disk full, quota, read-only: `errors.write_failure`), 130
for ^C, 141 when stdout's reader went away (`| head`); each with one line on stderr at most.
`ringctl --help` lists them (`EPILOG`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .errors import WRITE_FAILED_EXIT, UserError, write_failure

# Each module has `register(subparsers)`; the order here is the order of `ringctl --help`.
VERB_MODULES = [
    "ringctl.commands.jobs",  # config, render, submit, run, status, logs, cancel
    "ringctl.commands.gather",  # gather
    "ringctl.commands.topo",  # topo (and topo probe)
    "ringctl.commands.plan",  # plan
    "ringctl.commands.example",  # example
]


# What `ringctl --help` says of exit statuses: each is what `_run` and `main` return (a verb may
# add its own, e.g. gather's 3; its --help says so).
EPILOG = """\
Run `ringctl VERB --help` for the options of each verb. A first job: `ringctl run smoke`
(4 processes on this machine, seconds); `ringctl example` lists the bundled jobs.

exit status:
  0    done (`run`: the job COMPLETED)
  1    not done: the job did not complete (`run`, `resume -f`), no job found or a state
       unknown (`status`), the job does not fit (`plan`), a running job pruned every
       checkpoint `gather` took while it read it (run it again), or a write the machine
       refused (disk full, quota, read-only file system)
  2    a usage error: a bad argument, job file, key or path (one line says which)
  3    `gather` refused: outputs or a checkpoint missing, damaged or changed (each named)
  130  interrupted (^C)
  141  the reader of the output went away (`ringctl ... | head`)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringctl",
        description=(
            "Run exact ring attention over very long sequences: on this machine, on the Slurm "
            "cluster you are logged into, or on a cluster reached over SSH."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ringctl {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERB_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb; its exit status. Output goes through sys.stdout, which is flushed here so
    that a reader gone away (`ringctl ... | head`) is noticed inside the handler below."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The verb's arguments, its options anywhere among its words (`resume JOB --force
    nodes=2` as `resume --force JOB nodes=2`). argparse stops a `KEY=VALUE ...` list at the
    first option and calls what follows it unrecognized; a verb's own parser reads them mixed
    (`parse_intermixed_args`) unless it has sub-verbs of its own (`topo probe`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    verb = getattr(args, "verb", None)
    sub = _verb_parsers(parser).get(verb)
    if not extra or sub is None or sub._subparsers is not None:
        return parser.parse_args(argv)  # as before: argparse's own error names the extras
    rest = argv[argv.index(verb) + 1 :]
    return sub.parse_intermixed_args(rest, namespace=argparse.Namespace(verb=verb))


def _verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
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
    except OSError as err:
        line = write_failure(err)  # disk full, quota, read-only: one line naming the file
        if line is not None:
            print(f"ringctl {args.verb}: error: {line}", file=sys.stderr)
            return WRITE_FAILED_EXIT
        line = path_failure(err)
        if line is None:
            raise
        print(f"ringctl {args.verb}: error: {line}", file=sys.stderr)
        return UserError.exit_code
    return int(code or 0)


def path_failure(err: OSError) -> str | None:
    """One line (`PATH: strerror`) for an OSError about a path the user gave or a job holds: a
    name over 255 bytes, a file where a folder must be, a folder missing. A usage error
    (exit 2), not a bug: these made tracebacks. None when it names no file (a bug keeps its
    traceback)."""
    from .errors import path_error
    from .terminal import visible

    line = path_error(err)
    return None if line is None else visible(line)


# 128 + SIGPIPE: what the shell reports for any program stopped by a closed pipe (`yes | head`).
# Not 0: the output was cut short, so `ringctl run JOB | head` cannot claim the job was followed
# to its end, and a `set -o pipefail` script sees what it sees from other tools.
READER_GONE_EXIT = 141


def _reader_gone() -> int:
    """stdout's reader left: say nothing more (Python ignores SIGPIPE, so the write raised
    instead of ending the process), and point stdout at /dev/null so that the interpreter's
    own flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return READER_GONE_EXIT


if __name__ == "__main__":
    sys.exit(main())
