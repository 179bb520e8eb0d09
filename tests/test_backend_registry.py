"""The backends' registry (``ringctl.backends``) is all the rest of ringctl knows of them: each
name's class, which callers ask what they need (``files_here``, ``ranks_here``) instead of
testing a name, and the config sections the backends declare, which the config reader adds to
every job's schema and checks without knowing their keys."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from ringctl.backends import BACKENDS, backend_class, config_sections
from ringctl.backends.base import Backend
from ringctl.config import BackendName, job_schema, load_job
from ringctl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_each_name_is_its_backend_s_class():
    for name in BACKENDS:
        cls = backend_class(name)
        assert issubclass(cls, Backend) and cls.name == name
    assert [member.value for member in BackendName] == list(BACKENDS)
    assert backend_class("local").ranks_here and not backend_class("slurm").ranks_here
    assert not backend_class("ssh").files_here and backend_class("slurm").files_here
    with pytest.raises(KeyError, match="known: local, slurm, ssh"):
        backend_class("pbs")


def test_the_config_reads_the_sections_the_backends_declare():
    types = {f.name: f.type for f in dataclasses.fields(job_schema("attention"))}
    assert {name: types[name] for name in config_sections()} == config_sections()
    with pytest.raises(UserError, match="ssh.connect_timeout: must be a number of seconds from 1"):
        load_job("smoke", ["ssh.connect_timeout=0"])  # a key the section says holds seconds
    with pytest.raises(UserError, match="ssh.host: is required with backend=ssh"):
        load_job("smoke", ["backend=ssh"])  # the section's own check


def _name_tests(path: Path) -> list[str]:
    """`x.backend... == "ssh"` and the like: a backend's name compared outside the backends."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [s for s in sides if isinstance(s, ast.Constant) and s.value in BACKENDS]
        if names and any("backend" in ast.unparse(s) for s in sides if s not in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_backends_tests_a_backend_s_name():
    paths = sorted((ROOT / "ringctl").rglob("*.py"))
    found = [hit for p in paths if "backends" not in p.parts for hit in _name_tests(p)]
    assert found == []
    assert _name_tests(ROOT / "ringctl" / "backends" / "ssh_config.py")  # the checker sees one
