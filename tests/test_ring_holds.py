"""One answer to "does a ring of P ranks hold n tokens" (ringattn.geometry.ring_holds), asked
by submit, the scheduler and its messages alike.

Issue 27's case: P = 4, 1001 tokens per rank, zigzag (a unit of 2P = 8 tokens): a ring holds
4000 tokens (4004 would pad to 4008 = 1002 per rank). Before, submit accepted up to 4004
(n <= budget x P), the scheduler up to 4000, and the refusal said the ring "holds 3997" and that
a 4004-token document "needs a ring of at least 4 ranks" on a job whose ring had 4: a
4001-4004-token document passed submit and was refused by the job after loading the model.
"""

from __future__ import annotations

import pytest

from ringattn.geometry import ranks_needed, ring_capacity, ring_holds
from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.scheduler import DocLength, DocumentTooLong, ring_for, schedule_documents
from ringctl.sizing import Sizing
from ringctl.submission import check_documents
from tests.test_longdoc_inputs import JOB


def test_the_rule_and_its_capacity_agree():
    for layout in ("zigzag", "contiguous"):
        for size in (1, 2, 3, 4, 8):
            for budget in (1, 7, 1001, 4096):
                cap = ring_capacity(size, budget, layout)
                if cap == 0:  # less than one unit of the layout per ring: holds no token
                    assert not ring_holds(1, size, budget, layout)
                    continue
                assert ring_holds(cap, size, budget, layout)
                assert not ring_holds(cap + 1, size, budget, layout)
                need = ranks_needed(cap + 1, budget, layout)
                assert ring_holds(cap + 1, need, budget, layout) and need > size


def test_the_issues_case():
    assert ring_capacity(4, 1001, "zigzag") == 4000
    assert ring_for(4000, [1, 2, 4], 1001, "zigzag") == 4
    assert ring_for(4001, [1, 2, 4], 1001, "zigzag") is None
    with pytest.raises(DocumentTooLong) as err:
        schedule_documents([DocLength(0, "d", 4004)], world=4, size=4, budget=1001, layout="zigzag")
    said = str(err.value)
    assert "holds 4,000" in said and "at least 5 ranks" in said, said


@pytest.mark.parametrize("tokens", [4000, 4001, 4004])
def test_submit_answers_as_the_job_would(tmp_path, tokens):
    (tmp_path / "doc.txt").write_bytes(b"x" * tokens)  # bytes: the byte tokenizer's count
    cfg = load_job(
        JOB,
        [
            f"task.inputs=[{tmp_path}]",
            "nodes=1",
            "tasks_per_node=4",
            "ring.max_tokens_per_rank=1001",
            "task.model_path=null",
        ],
    )
    if tokens <= 4000:
        check_documents(Sizing(cfg))
        return
    with pytest.raises(UserError, match="holds 4,000"):
        check_documents(Sizing(cfg))
