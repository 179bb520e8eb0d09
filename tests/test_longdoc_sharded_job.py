"""model.shard in a real job: `ringctl run longdoc model.shard=ring` on 4 local ranks (rings
of 2, each holding its model as FSDP2 shards over its 2 ranks) scores and takes gradients
exactly as the unsharded job; impossible combinations are refused at submit by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.cli import main
from ringctl.longdoc.model.names import samples_dir

# The random tiny Llama (model_path null), not the job's trained default: sharding, not the
# model, is under test, and the bundled samples' 30 kB document runs in seconds with it.
SHAPE = ["nodes=1", "tasks_per_node=4", "ring.size=2", "timeout=120", "task.model_path=null"]


def _outputs(gathered: Path, kind: str) -> dict[str, torch.Tensor]:
    found = {}
    for path in (gathered / kind).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        found[meta.get("doc_id", path.name)] = load_file(str(path))
    return found


def _short_samples(root: Path) -> Path:
    """The bundled samples with the 30 kB one cut to its first 6000 characters: four
    documents from 80 to 6000 bytes (UTF-8, latin-1, ASCII), each still spread over its ring's
    two ranks; the whole 30 kB one was most of this test's minute in grad mode, for nothing
    sharding needs."""
    docs = root / "samples"
    docs.mkdir()
    for src in samples_dir().iterdir():
        data = src.read_bytes()
        if len(data) > 6000:
            data = data.decode("utf-8")[:6000].encode("utf-8")
        (docs / src.name).write_bytes(data)
    return docs


@pytest.mark.parametrize("mode", ["score", "grad"])
def test_sharded_job_equals_the_unsharded_job(mode, tmp_path, capsys):
    extra = [f"task.mode={mode}", f"task.inputs=[{_short_samples(tmp_path)}]"]
    extra += ["task.write_grads=true"] if mode == "grad" else []
    for shard in ("none", "ring"):
        job = tmp_path / shard
        assert (
            main(["run", "longdoc", f"job_dir={job}", f"model.shard={shard}", *SHAPE, *extra]) == 0
        ), capsys.readouterr().err
        assert main(["gather", str(job)]) == 0
    log = (tmp_path / "ring" / "logs" / "rank-0.out").read_text()
    assert "probe:" in log  # the probe ran on the sharded model too
    plain, sharded = (_outputs(tmp_path / s / "gathered", "docs") for s in ("none", "ring"))
    assert sorted(plain) == sorted(sharded) and len(plain) == 4
    for doc in plain:
        torch.testing.assert_close(
            sharded[doc]["token_logprob"], plain[doc]["token_logprob"], rtol=1e-5, atol=1e-6
        )
    if mode == "grad":
        a, b = (_outputs(tmp_path / s / "gathered", "grads") for s in ("none", "ring"))
        assert sorted(a) == sorted(b) and a
        for doc in a:
            for name, g in a[doc].items():
                scale = g.abs().max().clamp_min(1e-30)
                assert (b[doc][name] - g).abs().max() <= 1e-4 * scale, (doc, name)


def _uneven_corpus(root: Path) -> Path:
    """Five documents for two rings of 2: one ring gets three, the other two (it idles a
    round), and one document is empty (its ring idles inside the document)."""
    docs = root / "docs"
    docs.mkdir()
    words = "weights sharded over the whole job gather layer by layer in every ring".split()
    for i, n in enumerate([700, 0, 380, 150, 45]):
        text = " ".join(words[(i + j) % len(words)] for j in range(n // 6))
        (docs / f"doc{i}.txt").write_text(text)
    return docs


@pytest.mark.parametrize("mode, kind", [("score", "token_logprob"), ("embed", "hidden")])
def test_job_sharding_over_several_rings_equals_the_unsharded_job(mode, kind, tmp_path, capsys):
    """model.shard=job, 4 ranks in rings of 2: each rank holds 1/4 of the weights while the two
    rings run different documents in lockstep; outputs equal the unsharded job's."""
    docs = _uneven_corpus(tmp_path)
    common = [*SHAPE, f"task.mode={mode}", f"task.inputs=[{docs}]"]
    for shard in ("none", "job"):
        job = tmp_path / shard
        assert main(["run", "longdoc", f"job_dir={job}", f"model.shard={shard}", *common]) == 0, (
            capsys.readouterr().err
        )
        assert main(["gather", str(job)]) == 0
    schedule = (tmp_path / "job" / "schedule.json").read_text()
    assert '"rings": 2' in schedule  # two rings ran, not one ring of the job
    plain, sharded = (_outputs(tmp_path / s / "gathered", "docs") for s in ("none", "job"))
    assert sorted(plain) == sorted(sharded) and len(plain) == 5
    for doc in plain:
        assert plain[doc].keys() == sharded[doc].keys()
        torch.testing.assert_close(sharded[doc][kind], plain[doc][kind], rtol=1e-5, atol=1e-5)
    for rank in (0, 2):  # each ring's lead: the probe ran, and it holds a quarter
        log = (tmp_path / "job" / "logs" / f"rank-{rank}.out").read_text()
        assert "probe:" in log
        held = re.search(r"sharded over 4 ranks; this rank holds ([\d.]+) of ([\d.]+) MiB", log)
        assert held, log
        assert float(held[1]) <= float(held[2]) / 4 * 1.05


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["model.shard=ring", "ring.size=auto", "ring.max_tokens_per_rank=100"], "ring.size=auto"),
        (["model.shard=job", "task.mode=grad"], "job cannot run mode=grad"),
        (["model.shard=half"], "expected one of none, ring, job"),
    ],
)
def test_impossible_sharding_is_refused_at_submit(overrides, why, capsys):
    byte_model = "task.model_path=bundled:demo-byte-llama"
    assert main(["config", "longdoc", "nodes=1", "tasks_per_node=4", byte_model, *overrides]) == 2
    assert why in capsys.readouterr().err
