"""A job config + templates/slurm.sh.j2 -> the text of a Slurm batch script.

Two readers, two rules. The `#SBATCH` header is read by sbatch, whose word splitting is not the
shell's (a backslash escapes inside single quotes): its lines come from `ringctl.sbatch`
(`sbatch_lines` in the template), where every value has passed a strict check for its option.
The body is read by bash: every config value there goes through the `quote` filter
(shlex.quote), so a value stays one word: a module named `x; rm -rf ~` is a name, never a
command. Values that would break the line structure (newlines) are refused when the config is
loaded.

The script expects to run with the job directory as its working directory: either rendered
with `job_dir=` (absolute, as seen on the cluster: `#SBATCH --chdir` points there), or submitted
with `sbatch` from inside the job directory (the default: paths are relative).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import jinja2

from .backends import files_here
from .config import probe_minutes, to_plain, world_size
from .errors import UserError
from .jobdir import script_names
from .resources import template_dir as bundled_template_dir
from .sbatch import header_lines

DEFAULT_TEMPLATE = "slurm.sh.j2"


def quote(value) -> str:
    """shlex.quote for any config value (None -> '', bools -> true/false)."""
    if value is None:
        return "''"
    if isinstance(value, bool):
        value = "true" if value else "false"
    text = str(value)
    if "\n" in text or "\r" in text or "\x00" in text:
        raise ValueError(f"refusing to put a multi-line value in a script: {text!r}")
    return shlex.quote(text)


def quote_args(line) -> str:
    """An option line (e.g. `--mail-type END`) for a shell command: split like the shell would,
    quote each word. Not for `#SBATCH` lines (sbatch splits words by other rules)."""
    try:
        words = shlex.split(str(line))
    except ValueError as err:  # "No closing quotation"
        raise UserError(f"{line!r}: {err}") from None
    return " ".join(quote(word) for word in words)


def quote_path(value) -> str:
    """Like quote, but a leading `~/` still means the home directory."""
    text = str(value)
    if text == "~":
        return '"$HOME"'
    if text.startswith("~/"):
        return '"$HOME"/' + quote(text[2:])
    return quote(text)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def identifier(value) -> str:
    """An environment variable name, checked (it cannot be quoted)."""
    text = str(value)
    if not _IDENTIFIER.fullmatch(text):
        raise ValueError(f"not a valid environment variable name: {text!r}")
    return text


def _environment(template_dir: Path | None = None) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir or bundled_template_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        # `{#` is common in shell (`${#array[@]}`): Jinja comments are `{##...##}` here
        comment_start_string="{##",
        comment_end_string="##}",
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["quote"] = quote
    env.filters["quote_args"] = quote_args
    env.filters["quote_path"] = quote_path
    env.filters["identifier"] = identifier
    return env


def default_python(cfg) -> str:
    """The interpreter the job runs: as configured, the activated env's, or this one."""
    if cfg.env.python:
        return str(cfg.env.python)
    if cfg.env.venv or cfg.env.conda or cfg.env.container_image:
        return "python3"
    if not files_here(cfg):
        return "python3"
    return sys.executable or "python3"


def render_script(
    cfg,
    *,
    job_dir: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    template_dir: Path | None = None,
) -> str:
    where = template_dir or bundled_template_dir()
    env = _environment(where)
    try:
        tmpl = env.get_template(template)
    except jinja2.TemplateNotFound:
        raise UserError(f"template {template} not found in {where}") from None
    plain = to_plain(cfg)
    return tmpl.render(
        cfg=plain,
        sbatch_lines=header_lines(cfg, job_dir),
        job_dir=job_dir,
        python=default_python(cfg),
        world_size=world_size(cfg),
        use_gpus=cfg.gpus_per_node > 0,
        names=script_names(),
        probe_minutes=probe_minutes(cfg),
    )
