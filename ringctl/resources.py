"""The files ringctl ships beside its code: the batch-script templates and the ready job configs.

In the repository they live at the top (`templates/`, `jobs/`); a wheel carries the same files
as the packages `ringctl.templates` and `ringctl.jobs` (pyproject's package-dir mapping), so one
lookup of the installed package serves a wheel, an editable install and a source checkout
run with PYTHONPATH (where the checkout's folders are used directly).
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from .errors import UserError
from .jobdir import JobDir

_CHECKOUT = Path(__file__).resolve().parents[1]


def _bundled_dir(package: str, checkout_name: str) -> Path | None:
    # A data-only package (no __init__.py) is a namespace package: its folder is its one
    # search location (importlib.resources.files would give a MultiplexedPath instead).
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    local = _CHECKOUT / checkout_name
    return local if local.is_dir() else None


def template_dir() -> Path:
    """The folder holding slurm.sh.j2."""
    found = _bundled_dir("ringctl.templates", "templates")
    if found is None:
        raise UserError("this installation of ringctl has no templates (reinstall it)")
    return found


def bundled_jobs() -> dict[str, Path]:
    """Ready job configs by name (`smoke` -> .../smoke.yaml), sorted."""
    found = _bundled_dir("ringctl.jobs", "jobs")
    if found is None:
        return {}
    return {p.stem: p for p in sorted(found.glob("*.yaml"))}


def describe_job(path: Path) -> str:
    """A job file's first sentence (of its leading comment), for listings: a whole sentence,
    not its first line cut where the line ends."""
    words: list[str] = []
    try:
        for line in path.read_text().splitlines():
            text = line.strip()
            if not text.startswith("#") or not text.lstrip("#").strip():
                break
            words += text.lstrip("#").split()
            if words[-1].endswith("."):
                break
    except OSError:
        pass
    sentence = " ".join(words)
    end = sentence.find(". ")
    return sentence[: end + 1] if end >= 0 else sentence


def find_job(name_or_path: str | Path) -> Path:
    """A job file: the path when it exists, else a bundled job of that name (`smoke`,
    `smoke.yaml`). A `UserError` lists the bundled names when neither exists."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and JobDir(path).config.is_file():  # a job directory
        raise UserError(
            f"{path} is a job directory, not a job file: ringctl status/logs/resume {path}"
        )
    if path.exists():
        raise UserError(f"job file {path} is not a file")
    jobs = bundled_jobs()
    stem = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    if len(path.parts) == 1 and stem in jobs:
        return jobs[stem]
    known = ", ".join(jobs) or "none"
    close = difflib.get_close_matches(stem, list(jobs), n=1) if len(path.parts) == 1 else []
    meant = f"did you mean {close[0]}? " if close else ""
    raise UserError(f"job file {path} not found ({meant}bundled jobs, usable by name: {known})")
