"""gather hands out only finite outputs, or says why not (issue 26, "High"): embed's hidden
states and pooled vectors, grad's norms and written gradients, as it does for scores.

Each output is written by the ShardStore a job uses (one rank, contiguous layout) and gathered by
the real verb; before, gather exited 0 with NaN in the hidden states, pooled vectors, norms and
gradient files, and a +inf log-probability gave a perplexity of 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ringctl.atomic import atomic_write_json
from ringctl.cli import main
from ringctl.longdoc.inputs.documents import doc_key
from ringctl.longdoc.output.names import FORMAT
from ringctl.longdoc.output.store import ShardStore

N, HIDDEN = 6, 4
DOC = "doc.txt"


def _output(base: Path, task: str, tensors: dict, stats: dict, grads=None) -> Path:
    """A long-document output of one document of N tokens, as a job of one rank writes it."""
    store = ShardStore(base)
    run = {"format": FORMAT, "world_size": 1, "task": task, "layout": "contiguous"}
    atomic_write_json(store.run_file, run)
    doc = {"id": DOC, "key": doc_key(DOC), "source": "in.txt"}
    atomic_write_json(store.documents_file, {"documents": [doc], "missing_inputs": []})
    n = int(tensors.pop("n", N))
    store.write_shard(
        doc=doc,
        rank=0,
        world_size=1,
        layout="contiguous",
        task=task,
        n_tokens=n,
        padded_tokens=n,
        stats=stats,
        seconds=0.1,
        tensors={"positions": torch.arange(n), "input_ids": torch.arange(n) + 3, **tensors},
        grads=grads,
    )
    return base


def _gather(base: Path, capsys) -> tuple[int, str]:
    code = main(["gather", str(base), "-o", str(base / "gathered")])
    err = capsys.readouterr().err
    return code, err


def _hidden(bad_token: int | None = None) -> torch.Tensor:
    hidden = torch.randn(N, HIDDEN)
    if bad_token is not None:
        hidden[bad_token, 1] = math.nan
    return hidden


GRAD_STATS = {"loss": 1.5, "grad_norm": 2.0, "grad_norms": {"w": 2.0}}
SCORES = -torch.rand(N)


@pytest.mark.parametrize(
    ("task", "tensors", "stats", "grads", "why"),
    [
        (
            "embed",
            {"hidden": _hidden(3), "pooled": torch.zeros(HIDDEN)},
            {},
            None,
            "non-finite hidden states at token 3",
        ),
        (
            "embed",
            {"hidden": _hidden(), "pooled": torch.tensor([0.0, math.inf, 0.0, 0.0])},
            {},
            None,
            "a non-finite pooled vector",
        ),
        (
            "grad",
            {"token_logprob": SCORES},
            {**GRAD_STATS, "grad_norm": math.nan},
            {"w": torch.ones(2)},
            "grad_norm=None in rank 0's entry is not a finite number",
        ),
        (
            "grad",
            {"token_logprob": SCORES},
            {**GRAD_STATS, "grad_norms": {"w": math.inf}},
            {"w": torch.ones(2)},
            "grad_norms['w']=None in rank 0's entry is not a finite number",
        ),
        (
            "grad",
            {"token_logprob": SCORES},
            GRAD_STATS,
            {"w": torch.tensor([1.0, math.nan])},
            "w holds values that are NaN or inf",
        ),
        (
            "score",
            {"token_logprob": torch.tensor([-1.0, math.inf, -2.0, -1.0, -1.0, math.nan])},
            {},
            None,
            "log-probability inf at scored position 1 (no probability)",
        ),
    ],
)
def test_an_output_that_is_not_finite_is_refused_by_name(
    tmp_path, capsys, task, tensors, stats, grads, why
) -> None:
    base = _output(tmp_path, task, dict(tensors), stats, grads)
    code, err = _gather(base, capsys)
    assert code == 3, err
    assert f"document {DOC!r}: " in err and why in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "gathered").exists()


def test_finite_outputs_and_an_empty_documents_pooled_nan_are_gathered(tmp_path, capsys) -> None:
    """The controls: finite gradients pass; an empty document's pooled vector is NaN by
    definition (the mean of nothing) and is handed out as such."""
    grad = _output(
        tmp_path / "grad", "grad", {"token_logprob": SCORES}, GRAD_STATS, {"w": torch.ones(2)}
    )
    assert _gather(grad, capsys)[0] == 0
    empty = {
        "n": 0,
        "hidden": torch.zeros(0, HIDDEN),
        "pooled": torch.full((HIDDEN,), math.nan),
    }
    embed = _output(tmp_path / "embed", "embed", empty, {})
    assert _gather(embed, capsys)[0] == 0
