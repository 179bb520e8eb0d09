"""How a job's YAML text (a job file, a job directory's config.yaml, an override's value)
becomes values: YAML 1.2's core types, never YAML 1.1's guesses.

PyYAML, and OmegaConf's loader on top of it, follow YAML 1.1, where an unquoted ``1:30:00``
is the integer 5400 (base 60), ``0123`` is 83 (octal), ``0x1F`` is 31, ``yes`` and ``off`` are
booleans and ``2026-12-04`` is a date: ``slurm.time: 1:30:00`` reached sbatch as
``--time=5400`` (minutes: 3.75 days), ``slurm.account: 0123`` as ``--account=83``. Here a
plain scalar is a boolean only as true/false, an integer only as ``str(int)`` writes it
(decimal, no leading zero, no ``+``, not ``-0``: a text field took ``-0`` as "0", and
``slurm.mem: -0`` reached sbatch as ``--mem=0``, all of a node's memory), a float only in
decimal notation (or .inf/.nan), null as null, ~ or nothing; anything else is text, as
written. An explicit tag other than ``!!str``, ``!!seq`` and ``!!map`` (which say what the
value is read as anyway) is refused with its line: PyYAML constructs a tagged value by YAML
1.1's rules (``!!int 1:30:00`` was 5400, ``!!int 0123`` 83), and ``!!set``, ``!!timestamp``
or ``!!binary`` make values no job key holds. OmegaConf's own checks (duplicate keys,
recursive aliases, alias expansion past 10,000 nodes) stay: the loader is its loader with
these rules for scalars.

A boolean or number field given text (quoted, or from ``${oc.env:NAME}``) takes it only in
YAML 1.2's core form for its type (``typed_text_problem``): OmegaConf converts with Python's
``int()`` and ``float()``, which read ``'٤'`` as 4 and ``'1_0'`` as 10, and reads any nonzero
integer or digit text as true.

A file is read as a regular file of at most ``MAX_JOB_FILE_BYTES``, and nesting is capped at
``MAX_DEPTH`` before libyaml composes anything (its composer recurses in C: 30,000 nested
brackets crashed the process, and a job directory holding such a config.yaml took
``ringctl status`` down with it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf._yaml import get_yaml_loader

from .bounded_read import read_regular
from .errors import UserError
from .text import echo

MAX_JOB_FILE_BYTES = 4 << 20  # a job's config: kilobytes; its resolved copy with model overrides
MAX_DEPTH = 64  # a job nests 4 levels; model config overrides a few more

_RESOLVERS = (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:0|-?[1-9][0-9]*)$", "-0123456789"),  # as str(int) writes it
    (
        "tag:yaml.org,2002:float",
        r"""^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9]+[eE][-+]?[0-9]+
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        "-+0123456789.",
    ),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", "<"),
)


# Explicit tags that mean what the value is read as without them (YAML 1.2's failsafe
# schema); "!" is the non-specific tag (text).
_KEPT_TAGS = ("!", "tag:yaml.org,2002:str", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map")

# YAML 1.2's core schema forms (ASCII) of the text a boolean or number field takes.
_TYPED_TEXT = {
    bool: ("true or false", r"true|True|TRUE|false|False|FALSE"),
    int: ("an integer", r"[-+]?[0-9]+"),
    float: ("a number", r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"),
}


def typed_text_problem(value: Any, kind: type) -> str | None:
    """Why a ``kind`` (bool, int or float) field cannot take ``value``, or None: a value of
    its type (an integer for a float; never a bool for a number), None, or text in YAML 1.2's
    core form for it (module docstring). An integer for a boolean is refused (``-1``: true)."""
    what, pattern = _TYPED_TEXT[kind]
    if value is None or type(value) is kind or (kind is float and type(value) is int):
        return None
    if isinstance(value, str) and re.fullmatch(pattern, value):
        return None
    shown = f"the text {value!r}" if isinstance(value, str) else repr(value)
    return f"expected {what}, got {shown}"


def _loader_class() -> type:
    """OmegaConf's loader (its duplicate-key and alias checks) with YAML 1.2's core scalars."""

    class JobLoader(get_yaml_loader()):  # type: ignore[misc]
        yaml_implicit_resolvers: dict = {}

    for tag, pattern, first in _RESOLVERS:
        JobLoader.add_implicit_resolver(tag, re.compile(pattern, re.X), list(first))
    return JobLoader


_LOADER = _loader_class()


_EVENTS = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser, if built with it


def _structure_problem(text: str) -> str | None:
    """Nesting deeper than MAX_DEPTH, or a refused explicit tag (module docstring), found from
    the parser's events (libyaml's parser is a state machine, as is PyYAML's: no recursion;
    0.2 ms for a job's config in C, 4 ms in Python), before the composer, which recurses once
    per level, sees the text; the composed nodes no longer tell a tag written from one
    resolved."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_EVENTS):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"nested more than {MAX_DEPTH} levels deep"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            tag = getattr(event, "tag", None)
            if tag is not None and tag not in _KEPT_TAGS:
                return _tag_problem(tag, event.start_mark)
    except yaml.YAMLError:
        return None  # the loader reports it, with its line
    return None


def _tag_problem(tag: str, mark) -> str:
    shown = tag.replace("tag:yaml.org,2002:", "!!")
    return (
        f"line {mark.line + 1}, column {mark.column + 1}: the tag {echo(shown, 40)} is not "
        "read (values follow YAML 1.2's core rules); write the value without it, quoted for text"
    )


def load_text(text: str, source: str, what: str = "not valid YAML") -> Any:
    """The values of YAML ``text`` (module docstring): a job file's, or an override's value
    (``key=VALUE``, a scalar or a flow collection); a UserError naming ``source``."""
    problem = _structure_problem(text)
    if problem:
        raise UserError(f"{source}: {what}: {problem}")
    try:
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader's subclass
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        detail = " ".join(s.strip() for s in str(err).strip().splitlines())
        raise UserError(f"{source}: {what}: {detail or type(err).__name__}") from None


def load_file(path: Path) -> Any:
    """A job file's values: a regular file (a link is followed to one, never to a device or
    a pipe) of at most MAX_JOB_FILE_BYTES, UTF-8, read by ``load_text``."""
    try:
        raw = read_regular(Path(path).resolve(), MAX_JOB_FILE_BYTES)
    except ValueError as err:
        raise UserError(str(err)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return load_text(text, str(path))
