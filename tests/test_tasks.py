"""Tasks are `Task` subclasses in one registry, and nothing outside them asks a task's name.

Before, three registries keyed by name (TASKS, TASK_PACKAGES, TASK_GATHERERS) and hooks read
off each task module with getattr made up a task, and submission checked documents only for a
task named "longdoc". A task is now a class (ringctl.tasks.base.Task) that every verb asks.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from ringctl import tasks
from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.task_params import TaskParams
from ringctl.tasks.attention import AttentionTask
from ringctl.tasks.base import Gatherer, Task

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "jobs" / "smoke.yaml"


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_each_registered_name_is_a_task_class(name):
    task = tasks.get_task(name)
    assert isinstance(task, Task) and task.name == name
    assert issubclass(task.params, TaskParams)
    gatherer = task.gatherer()
    assert gatherer is None or isinstance(gatherer, Gatherer)


def test_only_the_long_document_task_gathers_and_needs_transformers():
    longdoc, attention = tasks.get_task("longdoc"), tasks.get_task("attention")
    assert {module for module, _ in longdoc.packages} == {"transformers", "tokenizers"}
    assert attention.packages == () and attention.gatherer() is None
    assert longdoc.gatherer().recognises(REPO) is False  # the repository is no gather output
    with pytest.raises(KeyError, match="unknown task 'nope'; known: attention, longdoc"):
        tasks.get_task("nope")


NAME_TEST = re.compile(r"""[!=]=\s*["'](?:%s)["']|["'](?:%s)["']\s*[!=]=""")


def test_no_code_outside_the_tasks_tests_a_task_name():
    names = "|".join(map(re.escape, tasks.TASKS))
    pattern = re.compile(NAME_TEST.pattern % (names, names))
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "ringctl").rglob("*.py"))
        if "tasks" not in path.relative_to(REPO / "ringctl").parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_a_new_task_with_documents_has_them_checked_at_submit(monkeypatch):
    """Submission asks any task for its documents (before: only one named "longdoc")."""
    from ringctl.sizing import Sizing
    from ringctl.submission import check_documents

    class DemoTask(AttentionTask):
        name = "demo"

        def document_lengths(self, cfg, *, fits=None):
            return [("short", 10), ("huge", 1_000_000)]

        @staticmethod
        def check_ring_keys(cfg, bad):  # its documents go on rings under the budget
            return None

    module = types.ModuleType("ringctl_test_documents_task")
    module.DemoTask = DemoTask
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(tasks.TASKS, "demo", f"{module.__name__}:DemoTask")
    cfg = load_job(SMOKE, ["task.name=demo", "ring.max_tokens_per_rank=1000"])
    with pytest.raises(UserError, match=r"'huge' has 1,000,000 tokens: .* at least 1000 ranks"):
        check_documents(Sizing(cfg))
