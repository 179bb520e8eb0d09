"""`ringctl example [NAME [DIR]]`: list the bundled job configs, or copy one out to edit.

    ringctl example                  the bundled jobs, one line each
    ringctl example longdoc          writes ./longdoc.yaml (refuses to overwrite)
    ringctl example smoke configs/   writes configs/smoke.yaml

Bundled jobs also run by name without copying: `ringctl run smoke`.
"""

from __future__ import annotations

import argparse
import errno
import os
import textwrap
from pathlib import Path

from ..errors import UserError, with_filename, write_failure
from ..resources import bundled_jobs, describe_job


def cmd_example(args) -> int:
    jobs = bundled_jobs()
    if not args.name:
        width = max((len(n) for n in jobs), default=0)
        for name, path in jobs.items():
            lines = textwrap.wrap(describe_job(path), 96 - width) or [""]
            print(f"{name:<{width}}  {lines[0]}")
            for more in lines[1:]:
                print(f"{'':<{width}}  {more}")
        print("\nrun one by name (`ringctl run smoke`), or copy one to edit: ringctl example smoke")
        return 0
    stem = args.name[: -len(".yaml")] if args.name.endswith(".yaml") else args.name
    if stem not in jobs:
        raise UserError(f"no bundled job {args.name!r} (bundled: {', '.join(jobs) or 'none'})")
    target = _directory(Path(args.dir).expanduser()) / f"{stem}.yaml"
    write_new(target, jobs[stem].read_text(), replace=args.force)
    print(f"wrote {target}: edit it, then `ringctl run {target}`")
    return 0


def _directory(path: Path) -> Path:
    """DIR, made if it is not there; one line when it cannot be a directory (a file there, a
    file on the way), or the disk refuses (exit 1, as every write)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path} exists and is not a directory; DIR must be one") from None
    except OSError as err:
        if write_failure(err) is not None:
            raise with_filename(err, path) from None
        raise UserError(f"{path}: cannot be made a directory ({err.strerror or err})") from None
    return path


def write_new(target: Path, text: str, *, replace: bool) -> None:
    """Create target (replace: or truncate a regular file there) without following a symlink:
    a link, even a dangling one, would send the write wherever it points. The checks are the
    open's own flags (O_EXCL, O_NOFOLLOW), so nothing can change between check and write."""
    if target.is_symlink():
        raise UserError(f"{target} is a symbolic link; refused (remove it, or choose another DIR)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(target, flags, 0o666)
    except FileExistsError:
        raise UserError(f"{target} exists; pass --force to overwrite it") from None
    except IsADirectoryError:
        raise UserError(f"{target} is a directory; refused") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{target} is a symbolic link; refused") from None
        if write_failure(err) is not None:
            raise with_filename(err, target) from None
        raise UserError(f"{target}: cannot be written ({err.strerror or err})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:  # a full disk: the line names the file, no half copy is left
        if not replace:
            target.unlink(missing_ok=True)  # created above (O_EXCL): ours to remove
        raise with_filename(err, target) from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "example",
        help="List the bundled job configs, or write one out to edit.",
        description=__doc__.split("\n\n", 1)[0].split(": ", 1)[1],
        epilog=(
            "examples:\n  ringctl example\n  ringctl example longdoc\n"
            "  ringctl example smoke configs/\n  ringctl run smoke        # by name, no copy"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="a bundled job (see the list)")
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="where to write NAME.yaml")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_example)
