"""`ringctl run train`: the whole job (real local processes, the worker, the job directory)
against training without the ring, across shapes, and through kills and resumes.

The reference is tests/train_reference.train: one process, the model's own attention (sdpa),
every piece of every packed sequence a forward of its own, on the same documents (listed by
the job's own reader, bytes as ids: the tiny random Llama's vocabulary) in the same order.
Per-step losses (logs/metrics.jsonl) within 1e-5 relative; the gathered model's weights
(``ringctl gather``: consolidated from the last checkpoint) within 1e-5 by relative norm per
tensor (tests/test_train_step.py says why not per element under AdamW). A run killed after a
checkpoint and resumed equals the uninterrupted run bitwise on the same shape, and within 1e-5
on another.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ringctl.cli import main
from ringctl.errors import UserError
from tests.local_jobs import local_state, wait_for

TOL = 1e-5
STEPS, SEQ, BATCH = 6, 128, 4
HP = dict(lr=3e-3, warmup_steps=2, max_steps=STEPS, min_lr_ratio=0.1, weight_decay=0.1, clip=1.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Documents of 1 to 400 random bytes (the tiny model's ids), in a directory."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(3)
    for i, n in enumerate([1, 300, 45, 7, 400, 90, 2, 160, 33, 250, 12, 64]):
        (root / f"doc{i:02d}.txt").write_bytes(bytes(rng.randrange(256) for _ in range(n)))
    return root


def _args(job_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        "jobs/train.yaml",
        f"job_dir={job_dir}",
        f"task.inputs=[{corpus}]",
        "task.model_path=null",
        f"task.seq_len={SEQ}",
        f"task.batch_sequences={BATCH}",
        f"task.max_steps={STEPS}",
        f"task.lr={HP['lr']}",
        f"task.warmup_steps={HP['warmup_steps']}",
        "task.checkpoint_every=2",
        "task.chunk_size=64",
        "timeout=60",
        *extra,
    ]


def write_state(path: Path, record: dict) -> None:
    """train_state.json as another run (another release) would have written it: with its
    checksum recorded again (checksums.json covers it)."""
    from ringctl.train.checkpoint import file_sha256

    path.write_text(json.dumps(record))
    sums_path = path.parent / "checksums.json"
    sums = json.loads(sums_path.read_text())
    sums_path.write_text(json.dumps(sums | {path.name: file_sha256(path)}))


def _losses(job_dir: Path) -> list[float]:
    rows = [
        json.loads(line)
        for line in (job_dir / "logs" / "metrics.jsonl").read_text().split("\n")
        if line
    ]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), rows
    return [r["loss"] for r in rows]


def _weights(job_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["gather", str(job_dir), "-o", str(out)]) == 0
    # (training review) the bundled model reads bytes: said, as no tokenizer is beside it
    assert "trained on UTF-8 bytes: no tokenizer is copied" in " ".join(said.getvalue().split())
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(corpus):
    """(losses, weights) of training without the ring on the job's documents."""
    from ringctl.longdoc.model.load import load_model
    from ringctl.train.data import Cursor, SequenceStream
    from ringctl.train.params import TrainParams
    from tests.train_reference import train

    params = TrainParams.from_any({"inputs": [str(corpus)]})
    docs = params.list_inputs().documents
    stream = SequenceStream(
        lambda i: torch.tensor(list(docs[i].read_bytes()), dtype=torch.long), len(docs), SEQ, 0
    )
    cursor, steps = Cursor(), []
    for _ in range(STEPS):
        seqs, cursor = stream.take(cursor, BATCH)
        steps.append(seqs)
    model = load_model(None, attn_implementation="sdpa").train()
    return train(model, steps, HP)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check(label: str, losses, weights, reference) -> None:
    want_losses, want_weights = reference
    assert len(losses) == STEPS, label
    for s, (a, b) in enumerate(zip(losses, want_losses, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"{label}: step {s + 1} loss {a} vs {b}"
    for name, want in want_weights.items():
        assert _rel(weights[name], want) <= TOL, f"{label}: {name}"


@pytest.mark.parametrize(
    "shape",
    [
        ("nodes=1", "tasks_per_node=1"),
        ("nodes=1", "tasks_per_node=4", "ring.size=2"),
        # FSDP2 over the job: its first weights check took the whole model's fingerprint of
        # DTensor shards and failed (AssertionError in DTensor dispatch) before this test
        ("nodes=1", "tasks_per_node=4", "ring.size=2", "model.shard=job"),
    ],
    ids=["1 rank", "2 rings of 2", "FSDP2 over 4, 2 rings"],
)
def test_the_job_trains_as_without_the_ring(tmp_path, corpus, reference, shape):
    job = tmp_path / "job"
    assert main(["run", *_args(job, corpus, *shape)]) == 0
    _check(" ".join(shape), _losses(job), _weights(job, tmp_path / "out"), reference)
    ckpts = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert ckpts == ["latest", "step-0000004", "step-0000006"]  # keep_checkpoints: 2


def test_a_killed_rank_then_resume_equals_the_uninterrupted_run(
    tmp_path, corpus, reference, capsys
):
    """kill -9 of one rank after the first checkpoint: FAILED; `ringctl resume` continues
    from checkpoints/latest; every step's loss and the weights equal the uninterrupted run's
    (the same shape: bitwise). A resume on one rank instead of two, from the checkpoint of
    step 4 of a finished run (``latest`` set back: a cancel could land after the end, and
    the resume then ran nothing), matches within 1e-5; with a document added to the inputs
    first, it is refused by name (the epochs' order would change under the saved cursor)."""
    whole = tmp_path / "whole"
    assert main(["run", *_args(whole, corpus)]) == 0
    job = tmp_path / "job"
    assert main(["submit", *_args(job, corpus, "task.checkpoint_every=2")]) == 0
    latest = job / "checkpoints" / "latest"
    wait_for(lambda: latest.exists(), 120, "the first checkpoint")
    os.kill(local_state(job)["ranks"]["1"]["pid"], signal.SIGKILL)
    final = wait_for(lambda: local_state(job).get("ended_at") and local_state(job), 60, "the end")
    if final["state"] == "COMPLETED":  # the run finished before the kill landed: nothing to test
        pytest.skip("the job ended before its rank was killed")
    assert final["state"] == "FAILED"
    capsys.readouterr()
    assert main(["resume", str(job), "--follow"]) == 0
    # from the checkpoint, not from step 0 (the same losses either way: resume moved
    # checkpoints/ away with the logs and restarted, and this test could not tell)
    assert "] resumed from step-" in capsys.readouterr().out
    assert _losses(job) == _losses(whole)
    ours, theirs = _weights(job, tmp_path / "a"), _weights(whole, tmp_path / "b")
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    one = tmp_path / "one"
    assert main(["run", *_args(one, corpus)]) == 0
    (one / "checkpoints" / "latest").write_text("step-0000004\n")
    added = corpus / "doc99.txt"
    added.write_bytes(b"a document added after the checkpoint")
    try:
        capsys.readouterr()
        # (training review) refused before anything runs: every rank loaded the model first,
        # then refused, and the job read FAILED
        assert main(["resume", str(one), "--force", "--follow"]) == 2
        err = capsys.readouterr().err
        assert "written by a run with the input documents" in err, err
        assert main(["status", "--json", str(one)]) == 0
        assert json.loads(capsys.readouterr().out)[0]["state"] == "COMPLETED"
    finally:
        added.unlink()
    # (training review) and sharded now: model.shard was refused as changing the results
    again = ["tasks_per_node=1", "model.shard=job"]
    assert main(["resume", str(one), "--force", *again, "--follow"]) == 0
    assert "resumed from step-0000004 (step 4)" in capsys.readouterr().out
    _check("resumed on one rank", _losses(one), _weights(one, tmp_path / "c"), reference)


def test_a_schedule_stretched_by_hand_applies_from_the_first_resumed_step(tmp_path, corpus):
    """task.max_steps raised in config.yaml (a resume's overrides refuse task.*; the run
    signature lets the cosine stretch) and the finished job resumed: its first step took the
    rate the old schedule gave that step (the optimizer's state brought it back), only the
    steps after it the new schedule's."""
    from ringctl.train.optim import lr_factor

    job = tmp_path / "job"
    assert main(["run", *_args(job, corpus, "task.max_steps=4", "tasks_per_node=1")]) == 0
    config = job / "config.yaml"
    assert config.read_text().count("  max_steps: 4\n") == 1
    config.write_text(config.read_text().replace("  max_steps: 4\n", "  max_steps: 6\n"))
    assert main(["resume", str(job), "--force", "--follow"]) == 0
    rows = [json.loads(line) for line in (job / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    schedule = dict(warmup_steps=HP["warmup_steps"], min_lr_ratio=HP["min_lr_ratio"])
    want = [
        HP["lr"] * lr_factor(s, max_steps=m, **schedule) for s, m in enumerate([4] * 4 + [6] * 2)
    ]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12, abs=0)


def test_submit_refuses_what_cannot_train(tmp_path, corpus, capsys):
    """One line naming the key: rings that cannot share a step's sequences, a sequence no
    ring holds under its budget, a dtype training does not take, a bad learning rate."""
    cases = {
        "task.batch_sequences": ["tasks_per_node=4", "ring.size=2", "task.batch_sequences=3"],
        "task.seq_len": ["ring.max_tokens_per_rank=50"],
        "task.dtype": ["task.dtype=float16"],
        "task.lr": ["task.lr=-1"],
        "model.shard": ["model.shard=ring"],
        # the schedule never reached task.lr, exit 0
        "task.warmup_steps": ["task.warmup_steps=100"],
    }
    for key, extra in cases.items():
        capsys.readouterr()
        assert main(["submit", *_args(tmp_path / key, corpus, *extra)]) == 2, key
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err, err


def test_a_resume_after_the_model_changed_at_the_same_path_is_refused(tmp_path, corpus, capsys):
    """The run signature held only the model_path string: a JSON config edited at the same
    path (rms_norm_eps, hidden_act: the same shapes) resumed silently, one run then training
    two models. The checkpoint now records the model's files (``model_identity``): the
    edited model is refused naming the path; the original bytes put back resume; a
    checkpoint from before the record is refused by name (nothing to check against)."""
    from ringctl.longdoc.model.directory import model_identity
    from ringctl.longdoc.model.names import bundled_config_path

    model = tmp_path / "model.json"
    original = bundled_config_path().read_bytes()
    model.write_bytes(original)
    job = tmp_path / "job"
    args = _args(job, corpus, f"task.model_path={model}", "tasks_per_node=1")
    args = [a for a in args if not a.startswith(("task.model_path=null", "task.max_steps"))]
    args += ["task.max_steps=2", "task.checkpoint_every=1"]
    assert main(["run", *args]) == 0
    edited = json.loads(original) | {"rms_norm_eps": 0.1, "hidden_act": "gelu"}
    model.write_text(json.dumps(edited))
    (job / "checkpoints" / "latest").write_text("step-0000001\n")
    capsys.readouterr()
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    err = capsys.readouterr().err
    assert f"task.model_path='{model}'" in err and "changed since this run trained it" in err, err
    model.write_bytes(original)
    state = json.loads((job / "checkpoints" / "step-0000001" / "train_state.json").read_text())
    assert state["run"]["model"] == model_identity(model)  # the sha256 of the file's bytes
    (job / "checkpoints" / "latest").write_text("step-0000001\n")
    assert main(["resume", str(job), "--force", "--follow"]) == 0
    assert "resumed from step-0000001 (step 1)" in capsys.readouterr().out

    from ringctl.train.checkpoint import CheckpointDir
    from ringctl.train.params import TrainParams
    from ringctl.train.run import resume_from

    found = CheckpointDir(job / "checkpoints").read("step-0000002", where="test")
    had = found.state["run"]
    old = found.state | {"run": {k: v for k, v in had.items() if k != "model"}}
    params = TrainParams.from_any({"model_path": str(model)})
    with pytest.raises(ValueError, match=r"step-0000002: written before checkpoints recorded"):
        resume_from(replace(found, state=old), None, None, None, None, had, params, None)


def test_a_diverged_step_stops_the_run_by_name_before_any_record_of_it(tmp_path, corpus, capsys):
    """task.lr=1e30 without clipping: the loss or gradient norm of a later step is not
    finite, and metrics.append raised ``Out of range float values are not JSON compliant``.
    Now every rank stops at that step with one line naming it; logs/metrics.jsonl holds the
    steps before it (finite, strict JSON) and the checkpoints end at the step before it."""
    job = tmp_path / "job"
    extra = ("task.lr=1e30", "task.clip=0", "task.warmup_steps=0", "task.checkpoint_every=1")
    assert main(["run", *_args(job, corpus, *extra)]) == 1
    err = capsys.readouterr().err
    said = re.search(r"ValueError: step (\d+): the (loss|gradient norm) is (nan|inf)", err)
    assert said and "Traceback" not in err.splitlines()[-1], err
    bad = int(said.group(1))
    assert "Out of range float" not in err and 2 <= bad <= STEPS, err
    lines = (job / "logs" / "metrics.jsonl").read_text().splitlines()

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in metrics"))

    assert [strict(line)["step"] for line in lines] == list(range(1, bad))
    ckpts = sorted(p.name for p in (job / "checkpoints").glob("step-*"))
    assert ckpts[-1] == f"step-{bad - 1:07d}", ckpts
    assert (job / "checkpoints" / "latest").read_text().strip() == ckpts[-1]


def _model_with_tokenizer(root: Path) -> Path:
    """The tiny random Llama saved with a tokenizer of its own, whose ids are not the bytes'
    (one id per character, shuffled)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ringctl.longdoc.model.load import load_model

    model_dir = root / "model"
    load_model(None).save_pretrained(model_dir)
    ids = list(range(1, 256))
    random.Random(7).shuffle(ids)
    vocab = {"<unk>": 0, **{chr(c): ids[c - 1] for c in range(1, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(model_dir)
    return model_dir


def test_a_model_directory_s_tokenizer_is_the_one_training_uses(tmp_path, capsys):
    """`task.tokenizer_path: null` is the model directory's tokenizer (as the scoring job
    reads it); training tokenized UTF-8 bytes instead, exit 0 (ids of another numbering:
    the gathered model, copied with the directory's tokenizer, then scored garbage), and a
    model of another vocabulary was refused with "the model directory has no tokenizer
    files". The losses are the reference's on the tokenizer's ids."""
    from ringctl.longdoc.model.load import load_model
    from ringctl.longdoc.model.tokenize import load_tokenizer
    from ringctl.train.data import Cursor, SequenceStream
    from ringctl.train.params import TrainParams
    from tests.train_reference import train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(["the tide goes out. " * 9, "a lamp, a keeper. " * 14, "oh"]):
        (corpus / f"doc{i}.txt").write_text(text)
    model_dir = _model_with_tokenizer(tmp_path)
    job = tmp_path / "job"
    args = _args(job, corpus, f"task.model_path={model_dir}", "task.max_steps=3")
    assert main(["run", *args]) == 0, capsys.readouterr().err
    assert f"tokenizer: {model_dir}" in capsys.readouterr().out

    tokenizer = load_tokenizer(str(model_dir))
    docs = TrainParams.from_any({"inputs": [str(corpus)]}).list_inputs().documents
    stream = SequenceStream(lambda i: tokenizer.encode(docs[i].read_bytes()), len(docs), SEQ, 0)
    cursor, steps = Cursor(), []
    for _ in range(3):
        seqs, cursor = stream.take(cursor, BATCH)
        steps.append(seqs)
    model = load_model(str(model_dir), attn_implementation="sdpa").train()
    want, _ = train(model, steps, {**HP, "max_steps": 3})
    got = _losses(job)
    assert len(got) == 3 and all(
        abs(a - b) <= TOL * abs(b) for a, b in zip(got, want, strict=True)
    ), got

    # gather copies the model directory's tokenizer, and refuses it edited since the run
    assert main(["gather", str(job), "-o", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model" / "tokenizer.json").is_file()
    tok = model_dir / "tokenizer.json"
    original = tok.read_text()
    tok.write_text(original.replace('"a":', '"A":', 1))
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "b")]) == 2
    assert "the tokenizer's files changed since the run" in capsys.readouterr().err
    tok.write_text(original)
    aside = tmp_path / "aside"  # the model directory's tokenizer files gone: not exported
    aside.mkdir()  # without them (scored on bytes later, exit 0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).rename(aside / name)
    assert main(["gather", str(job), "-o", str(tmp_path / "c")]) == 2
    assert "the run trained with a tokenizer (task.tokenizer_path=" in capsys.readouterr().err
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (aside / name).rename(model_dir / name)
    # a checkpoint of an earlier ringctl (no byte_tokens: it trained on bytes here) cannot
    # be resumed into the tokenizer's ids; said so, not as a changed task.tokenizer_path
    state = job / "checkpoints" / "step-0000002" / "train_state.json"
    record = json.loads(state.read_text())
    kept = dict(record["run"])
    for key in ("byte_tokens", "tokenizer"):
        del record["run"][key]
    write_state(state, record)
    (job / "checkpoints" / "latest").write_text("step-0000002\n")
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    err = capsys.readouterr().err
    assert "the run trained on UTF-8 bytes, this one would train on a tokenizer's ids" in err
    assert "an earlier ringctl trained on bytes" in err
    # one that trained on the model directory's tokenizer before its files had an identity
    # of their own resumes: they are in the model's identity, which is compared
    record["run"] = {k: v for k, v in kept.items() if k != "tokenizer"}
    write_state(state, record)
    (job / "checkpoints" / "latest").write_text("step-0000002\n")
    assert main(["resume", str(job), "--force", "--follow"]) == 0, capsys.readouterr().err


def test_gather_of_an_unfinished_run_says_so(tmp_path, corpus, capsys, monkeypatch):
    """A run stopped at step 4 of 6 gathered with exit 0 and a marker saying "partial":
    false, nothing saying 4 of 6: refused now without --partial, and marked partial with it
    (summary.json's max_steps and partial). A checkpoint pruned while gather read it (a
    running job with keep_checkpoints=1) ended the gather with a file "cannot be read": the
    newest is taken again. The exported weights follow the umask (transformers wrote 0600)."""
    from ringctl.atomic import default_file_mode
    from ringctl.config import load_resolved
    from ringctl.train import export

    job = tmp_path / "job"
    assert main(["run", *_args(job, corpus)]) == 0
    (job / "checkpoints" / "latest").write_text("step-0000004\n")
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "a")]) == 3  # as a scoring job's
    err = capsys.readouterr().err
    assert "step 4 of the run's 6 (task.max_steps)" in err and "--partial" in err, err
    assert main(["gather", str(job), "-o", str(tmp_path / "a"), "--format", "csv"]) == 2
    assert "--format csv: a table of per-token values is a scoring job's" in (
        capsys.readouterr().err
    )  # ignored before: exit 0, no table, nothing said
    # JOBDIR/out names its job (gather --help): "out/checkpoints: no checkpoint yet" before
    assert main(["gather", str(job / "out"), "-o", str(tmp_path / "a"), "--partial"]) == 0
    out = capsys.readouterr().out
    assert "step 4 (partial: the run has not finished)" in out, out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (summary["step"], summary["max_steps"], summary["partial"]) == (4, 6, True)
    weights = tmp_path / "a" / "model" / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == default_file_mode()  # 0644 under umask 022

    write, calls = export._write, []

    def pruned_under_it(tmp, job_dir, found, *args):
        calls.append(found.step)
        if len(calls) == 1:  # the job moved on and pruned what this gather was reading
            (job / "checkpoints" / "latest").write_text("step-0000006\n")
            found.path.rename(tmp_path / "pruned")  # as prune removes it
            raise UserError(f"{found.path}/config.json: cannot be read (No such file)")
        return write(tmp, job_dir, found, *args)

    monkeypatch.setattr(export, "_write", pruned_under_it)
    config = load_resolved(job / "config.yaml")
    got = export.gather(job, tmp_path / "b", partial=True, job_config=config)
    assert calls == [4, 6] and got.step == 6 and not got.partial
    monkeypatch.setattr(export, "_write", write)

    # the copy saved with the checkpoint damaged (covered by its checksums since: it was
    # read past, the log's steps taken, exit 0) or made a link: a damaged checkpoint, exit 3
    saved = job / "checkpoints" / "step-0000006" / "metrics.jsonl"
    kept = saved.read_bytes()
    saved.write_bytes(b"\x00garbage\n" * 3)
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "g")]) == 3
    assert f"{saved}: its sha256 is not the one" in capsys.readouterr().err
    saved.unlink()
    saved.symlink_to(job / "logs" / "metrics.jsonl")
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "h")]) == 3
    saved.unlink()
    saved.write_bytes(kept)

    # A resume moves logs/ to attempts/<n>/ and restores the history only once it loads the
    # checkpoint: stopped before that, a gather wrote an empty metrics.jsonl, loss null, and
    # blamed a missing matplotlib for the plot, exit 0. The checkpoint's own copy is read.
    whole = (tmp_path / "b" / "metrics.jsonl").read_text()
    assert len(whole.splitlines()) == 6
    (job / "attempts" / "1").mkdir(parents=True)
    (job / "logs").rename(job / "attempts" / "1" / "logs")
    got = export.gather(job, tmp_path / "c", job_config=config)
    assert (tmp_path / "c" / "metrics.jsonl").read_text() == whole
    assert got.loss == json.loads(whole.splitlines()[-1])["loss"]
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["loss"] == got.loss


def test_gather_copies_the_tokenizer_the_run_trained_with(tmp_path, capsys):
    """gather found the tokenizer again from the config and copied it beside the weights
    whatever the run had used: a run that tokenized bytes (an earlier ringctl, with the
    model directory's tokenizer unread) got the directory's tokenizer, and a tokenizer
    directory edited since the run was copied as it is now; both exit 0, the exported model
    then scoring other ids than it was trained on."""
    import shutil

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("the tide goes out. " * 20)
    model_dir = _model_with_tokenizer(tmp_path)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(model_dir, tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    job = tmp_path / "job"
    extra = (f"task.model_path={model_dir}", f"task.tokenizer_path={tokenizer}")
    assert main(["run", *_args(job, corpus, *extra, "task.max_steps=2")]) == 0
    assert main(["gather", str(job), "-o", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model" / "tokenizer.json").is_file()

    state = job / "checkpoints" / "step-0000002" / "train_state.json"
    record = json.loads(state.read_text())
    record["run"]["byte_tokens"] = True  # what a run of bytes recorded
    write_state(state, record)
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "b")]) == 0
    said = capsys.readouterr()
    assert "the run trained on UTF-8 bytes: no tokenizer is copied" in " ".join(said.out.split())
    assert "Writing model shards" not in said.out + said.err  # transformers' bar
    assert not (tmp_path / "b" / "model" / "tokenizer.json").exists()

    moved = tmp_path / "elsewhere"  # a checkpoints/ made a link out of the job directory
    (job / "checkpoints").rename(moved)
    (job / "checkpoints").symlink_to(moved)
    assert main(["gather", str(job), "-o", str(tmp_path / "d")]) == 2
    assert "checkpoints: a link (to " in capsys.readouterr().err
    (job / "checkpoints").unlink()
    moved.rename(job / "checkpoints")

    record["run"]["byte_tokens"] = False
    write_state(state, record)
    tok = tokenizer / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"a":', '"A":', 1))
    assert main(["gather", str(job), "-o", str(tmp_path / "c")]) == 2
    assert "the tokenizer's files changed since the run" in capsys.readouterr().err
    shutil.rmtree(tokenizer)  # gone: refused where the job's config is read
    assert main(["gather", str(job), "-o", str(tmp_path / "e")]) == 2
    assert f"task.tokenizer_path: {tokenizer} does not exist" in capsys.readouterr().err


def test_a_checkpoint_file_changed_on_disk_is_neither_resumed_from_nor_exported(
    tmp_path, corpus, capsys
):
    """DCP keeps no checksums: one byte flipped in a .distcp (a disk or copy error) was
    exported as a weight by gather and loaded by a resume, exit 0. checksums.json (every
    rank hashing its share at the save) is checked before either reads the files."""
    job = tmp_path / "job"
    assert main(["run", *_args(job, corpus, "tasks_per_node=2")]) == 0
    folder = job / "checkpoints" / "step-0000004"
    sums = json.loads((folder / "checksums.json").read_text())
    shards = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
    covered = [
        ".metadata",
        *shards,
        "config.json",
        "generation_config.json",
        "metrics.jsonl",
        "train_state.json",
    ]
    assert sorted(sums) == covered and len(shards) >= 1
    (job / "checkpoints" / "latest").write_text("step-0000004\n")
    assert main(["gather", str(job), "-o", str(tmp_path / "a"), "--partial"]) == 0
    shard = folder / shards[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "b"), "--partial"]) == 3
    said = f"{shard}: its sha256 is not the one checksums.json recorded at the save"
    assert said in capsys.readouterr().err
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    assert "its sha256 is not the one checksums.json recorded" in capsys.readouterr().err
    # the model's config is covered too (gather builds the export from it), and removing
    # checksums.json does not turn the check off
    later = job / "checkpoints" / "step-0000006"
    config = later / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0.1'))
    (job / "checkpoints" / "latest").write_text("step-0000006\n")
    assert main(["gather", str(job), "-o", str(tmp_path / "c")]) == 3
    assert f"{config}: its sha256 is not the one" in capsys.readouterr().err
    (later / "checksums.json").unlink()
    assert main(["gather", str(job), "-o", str(tmp_path / "d")]) == 3
    assert (
        "checksums.json: missing (this checkpoint was written with one)" in capsys.readouterr().err
    )


def test_each_rank_hashes_the_files_it_wrote(tmp_path):
    """At the save every rank hashed every world-th file by name, which for DCP's names
    (".metadata" first, "__10_0" before "__2_0") was never its own: every save read the
    others' shards back over the network. Each hashes its own now, rank 0 the rest."""
    from ringctl.train.checkpoint import written_sums

    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "x.distcp"):
        (tmp_path / name).write_bytes(name.encode())
    got = [sorted(written_sums(tmp_path, rank, 3)) for rank in range(3)]
    assert got == [[".metadata", "__0_0.distcp", "x.distcp"], ["__1_0.distcp"], ["__2_0.distcp"]]


def test_a_gguf_model_s_tokenizer_changed_since_the_run_is_refused_at_gather(
    tmp_path, capsys, monkeypatch
):
    """A GGUF file's tokenizer is the file's own, so the run records no tokenizer identity
    of its own: gather checked nothing and exported the rewritten file's tokenizer (its
    add_bos_token gone), exit 0. The file's "model" identity stands for it now."""
    pytest.importorskip("gguf")
    from tests.gguf_models import write_tiny_gguf

    monkeypatch.setenv("RINGCTL_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("the tide goes out. " * 9)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    job = tmp_path / "job"
    args = _args(job, corpus, f"task.model_path={gguf}", "task.max_steps=2", "tasks_per_node=1")
    assert main(["run", *args]) == 0
    assert main(["gather", str(job), "-o", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model" / "tokenizer.json").is_file()
    write_tiny_gguf(gguf, add_bos=False)
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "b")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{gguf}: the GGUF file (its tokenizer's source): the tokenizer's files changed" in err


def _resummed(folder: Path) -> None:
    """checksums.json recorded again over the folder's files (as a writer who can edit them)."""
    from ringctl.train.checkpoint import covered_files, file_sha256

    sums = {p.name: file_sha256(p) for p in covered_files(folder)}
    (folder / "checksums.json").write_text(json.dumps(sums))


def _edited_metadata(folder: Path, kind: str) -> None:
    """.metadata with lm_head's entry dropped, or its storage pointed at config.json."""
    import pickle

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()  # the test's own file: trusted here
    name = "model.lm_head.weight"
    for key in [k for k in md.storage_data if k.fqn == name]:
        if kind == "drop":
            del md.storage_data[key]
        else:
            entry = md.storage_data[key]
            md.storage_data[key] = replace(entry, relative_path="config.json", offset=0, length=10)
    if kind == "drop":
        del md.state_dict_metadata[name]
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    _resummed(folder)


def test_a_lost_latest_resumes_from_the_newest_published_checkpoint(tmp_path, corpus, capsys):
    """checkpoints/latest gone (a kill between a folder's publish and the pointer's write, or
    lost since) with step-0000004 complete: resume started again from step 0, saying nothing
    (its saves then replaced the folders), and gather said "no checkpoint yet". Both take the
    newest published folder, said; the resumed run equals the first bitwise. (review: a
    checkpoint whose .metadata disagrees with its config.json was exit 2, a usage error, and
    torch's weights-only refusal was relayed with its advice to load the file unsafely)"""
    job = tmp_path / "job"
    assert main(["run", *_args(job, corpus)]) == 0
    first = _losses(job)
    import shutil

    shutil.rmtree(job / "checkpoints" / "step-0000006")
    (job / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    assert main(["gather", str(job), "-o", str(tmp_path / "a"), "--partial"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "is missing: gathered step-0000004, the newest published checkpoint" in said, said
    assert main(["resume", str(job), "--force", "--follow"]) == 0
    said = "resumed from step-0000004 (step 4); checkpoints/latest is missing"
    assert said in capsys.readouterr().out
    assert _losses(job) == first
    folder = job / "checkpoints" / "step-0000006"
    for kind, why in (
        ("point", "not data torch.load reads with weights_only=True"),
        ("drop", "has lm_head.weight, which the checkpoint beside it does not hold"),
    ):
        _edited_metadata(folder, kind)
        capsys.readouterr()
        assert main(["gather", str(job), "-o", str(tmp_path / kind)]) == 3, kind
        err = capsys.readouterr().err
        assert why in err and "weights_only` set to `False" not in err, err
