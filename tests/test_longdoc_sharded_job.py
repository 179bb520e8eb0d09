"""model.shard in a real job: `ringctl run longdoc model.shard=ring` on 4 local ranks (rings
of 2, each holding its model as FSDP2 shards over its 2 ranks) scores and takes gradients
exactly as the unsharded job; impossible combinations are refused at submit by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.cli import main

SHAPE = ["nodes=1", "tasks_per_node=4", "ring.size=2", "timeout=120"]


def _outputs(gathered: Path, kind: str) -> dict[str, torch.Tensor]:
    found = {}
    for path in (gathered / kind).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        found[meta.get("doc_id", path.name)] = load_file(str(path))
    return found


@pytest.mark.parametrize("mode", ["score", "grad"])
def test_sharded_job_equals_the_unsharded_job(mode, tmp_path, capsys):
    extra = [f"task.mode={mode}"] + (["task.write_grads=true"] if mode == "grad" else [])
    for shard in ("none", "ring"):
        job = tmp_path / shard
        assert main(["run", "longdoc", f"job_dir={job}", f"model.shard={shard}", *SHAPE,
                     *extra]) == 0, capsys.readouterr().err  # fmt: skip
        assert main(["gather", str(job)]) == 0
    log = (tmp_path / "ring" / "logs" / "rank-0.out").read_text()
    assert "probe:" in log  # the probe ran on the sharded model too
    plain, sharded = (_outputs(tmp_path / s / "gathered", "docs") for s in ("none", "ring"))
    assert sorted(plain) == sorted(sharded) and len(plain) == 4
    for doc in plain:
        torch.testing.assert_close(sharded[doc]["token_logprob"], plain[doc]["token_logprob"],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    if mode == "grad":
        a, b = (_outputs(tmp_path / s / "gathered", "grads") for s in ("none", "ring"))
        assert sorted(a) == sorted(b) and a
        for doc in a:
            for name, g in a[doc].items():
                scale = g.abs().max().clamp_min(1e-30)
                assert (b[doc][name] - g).abs().max() <= 1e-4 * scale, (doc, name)


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["model.shard=ring", "ring.size=auto", "ring.max_tokens_per_rank=100"], "ring.size=auto"),
        (["model.shard=job", "ring.size=2"], "job with several rings"),
        (["model.shard=job", "task.mode=grad"], "job cannot run mode=grad"),
        (["model.shard=half"], "expected one of none, ring, job"),
    ],
)
def test_impossible_sharding_is_refused_at_submit(overrides, why, capsys):
    assert main(["config", "longdoc", "nodes=1", "tasks_per_node=4", *overrides]) == 2
    assert why in capsys.readouterr().err
