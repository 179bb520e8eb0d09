"""Training checkpoints (ringctl/train/checkpoint.py): DCP saves that reshard, published only
when complete, read back as hostile input.

A run interrupted after a checkpoint and continued, on the same shape and on another (FSDP2
over 4 ranks -> the whole model on each of 2 ranks, and back), equals the uninterrupted run:
bitwise on the same shape (the same kernels in the same order), within the shapes' own 1e-5
otherwise (tests/test_train_step.py). A save killed before it is published leaves ``latest`` at
the previous checkpoint, which loads; the next save removes the half-written folder.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train_step import BATCH, HP, TOL, _rel, _steps
from tests.train_reference import tiny_model


def _run(rank: int, world: int, ckroot: str, shard: bool, start: int, stop: int, save: bool):
    """Steps [start, stop) on ``world`` ranks (one ring), from the checkpoint of ``start``
    when start > 0; saves one at ``stop`` when asked. Rank 0 returns losses and weights."""
    from pathlib import Path

    from ringctl.longdoc.compute.fsdp import shard_model
    from ringctl.train.checkpoint import CheckpointDir, load, train_state
    from ringctl.train.checkpoint import save as save_ckpt
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    model = tiny_model("ringattn").train()
    if shard:
        shard_model(model, mode="job")
    opt = make_optimizer(model, lr=HP["lr"], weight_decay=HP["weight_decay"])
    sched = make_scheduler(
        opt,
        warmup_steps=HP["warmup_steps"],
        max_steps=HP["max_steps"],
        min_lr_ratio=HP["min_lr_ratio"],
    )
    ckdir = CheckpointDir(Path(ckroot))
    if start:
        found = ckdir.latest()
        assert found is not None and found.step == start
        load(model, opt, found)
        sched.load_state_dict(found.state["scheduler"])
    seat = RingSeat(None, world, rank, 0, 1, None)
    opts = StepOptions("zigzag", None, 64, HP["clip"], None)
    losses = [
        train_step(model, opt, sched, seqs, range(BATCH), seat, opts, shard).loss
        for seqs in _steps()[start:stop]
    ]
    if save:
        state = train_state(
            stop, {"epoch": 0, "index": 0, "offset": 0, "held": ""}, sched.state_dict(), {}
        )
        save_ckpt(model, opt, ckdir, stop, state, keep=2, metrics=Path(ckroot) / "none.jsonl")
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "weights": weights} if rank == 0 else {}


@pytest.mark.parametrize(
    "first,second",
    [((2, False), (2, False)), ((4, True), (2, False))],
    ids=["same shape", "FSDP2 over 4 -> whole on 2"],
)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, first, second):
    whole = run_distributed(_run, first[0], str(tmp_path / "whole"), first[1], 0, 8, False)[0]
    root = str(tmp_path / "ck")
    a = run_distributed(_run, first[0], root, first[1], 0, 3, True)[0]
    b = run_distributed(_run, second[0], root, second[1], 3, 8, False)[0]
    same = first == second
    for s, (got, want) in enumerate(zip(a["losses"] + b["losses"], whole["losses"], strict=True)):
        assert got == want if same else abs(got - want) <= TOL * abs(want), (s, got, want)
    for name, want in whole["weights"].items():
        got = b["weights"][name]
        assert torch.equal(got, want) if same else _rel(got, want) <= TOL, name


def test_a_killed_save_leaves_latest_at_the_last_complete_one(tmp_path):
    from ringctl.train.checkpoint import CheckpointDir

    root = tmp_path / "ck"
    run_distributed(_run, 2, str(root), False, 0, 3, True)
    ckdir = CheckpointDir(root)
    half = ckdir.staging(5, "deadbeef")  # a save killed while the ranks wrote it
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert ckdir.latest().step == 3
    b = run_distributed(_run, 2, str(root), False, 3, 5, True)[0]
    assert len(b["losses"]) == 2 and not half.exists() and ckdir.latest().step == 5
    assert [p.name for p in ckdir.complete()] == ["step-0000003", "step-0000005"]


@pytest.mark.parametrize(
    "pointer", ["../../etc", "step-0000003/../../x", "/tmp/step-0000003", "step-9", "x" * 5000]
)
def test_latest_cannot_point_outside_or_at_garbage(tmp_path, pointer):
    from ringctl.train.checkpoint import CheckpointDir

    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ValueError, match="latest"):
        CheckpointDir(tmp_path).latest()


def test_a_hostile_train_state_is_one_line(tmp_path):
    from ringctl.train.checkpoint import CheckpointDir

    step = tmp_path / "step-0000003"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "latest").write_text("step-0000003")
    for bad in (
        "[" * 100000,
        json.dumps({"step": -1, "cursor": {}, "scheduler": {}, "run": {}}),
        json.dumps({"step": 4, "cursor": {}, "scheduler": {}, "run": {}}),
    ):
        (step / "train_state.json").write_text(bad)
        with pytest.raises(ValueError, match="train_state.json"):
            CheckpointDir(tmp_path).latest()


class _RunsCode:
    """Pickles as a call of os.system: what a crafted checkpoint file would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _saved(folder, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_a_checkpoints_metadata_runs_no_code(tmp_path):
    """DCP unpickles ``.metadata`` with plain pickle: a crafted one ran os.system when a
    resume or `ringctl gather` loaded the checkpoint. It is refused by name, nothing run."""
    import pickle

    from ringctl.train import dcp_reader

    folder, marker = tmp_path / "step-0000001", tmp_path / "ran"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: not a checkpoint's metadata.*system"):
        dcp_reader.load({"w": torch.zeros(2)}, folder, no_dist=True)
    assert not marker.exists()


def test_a_checkpoints_values_run_no_code(tmp_path):
    """A non-tensor value (an optimizer's step count, its betas) DCP loads with
    torch.load(weights_only=False): one that pickles a call is refused, nothing run; plain
    values still load."""
    from ringctl.train import dcp_reader

    marker = tmp_path / "ran"
    _saved(tmp_path / "bad", {"w": torch.ones(2), "extra": _RunsCode(marker)})
    with pytest.raises(ValueError, match=r"bad: extra: not a plain value"):
        dcp_reader.load({"w": torch.zeros(2), "extra": None}, tmp_path / "bad", no_dist=True)
    assert not marker.exists()
    _saved(tmp_path / "good", {"w": torch.ones(2), "step": 3, "name": "adamw"})
    state = {"w": torch.zeros(2), "step": 0, "name": ""}
    dcp_reader.load(state, tmp_path / "good", no_dist=True)
    assert (state["step"], state["name"], state["w"].sum()) == (3, "adamw", 2)


def test_a_checkpoint_reads_no_file_outside_its_folder(tmp_path):
    """Each storage entry of the metadata names the file it is in: one naming ../x, or a
    link, is refused before anything is read."""
    import pickle

    from ringctl.train import dcp_reader

    folder = tmp_path / "ck"
    _saved(folder, {"w": torch.ones(2)})
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    (entry,) = metadata.storage_data.values()
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((folder / entry.relative_path).read_bytes())
    for name in ("../outside.distcp", str(outside)):
        entry.relative_path = name
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(ValueError, match="a storage entry names .*not a file here"):
            dcp_reader.load({"w": torch.zeros(2)}, folder, no_dist=True)
    (folder / "linked.distcp").symlink_to(outside)
    entry.relative_path = "linked.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="linked.distcp: not a regular file"):
        dcp_reader.load({"w": torch.zeros(2)}, folder, no_dist=True)


def _complete(folder, step: int) -> None:
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    cursor = {"epoch": 0, "index": 0, "offset": 0, "held": ""}
    (folder / "train_state.json").write_text(
        json.dumps({"step": step, "cursor": cursor, "scheduler": {}, "run": {}})
    )


def test_latest_is_read_as_hostile(tmp_path):
    """``latest`` a link to /dev/zero hung the resume; a folder that is a link pointed it
    outside checkpoints/; Unicode digits passed for a step."""
    from ringctl.train.checkpoint import CheckpointDir

    _complete(tmp_path / "elsewhere", 3)
    (tmp_path / "step-0000003").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "latest").write_text("step-0000003")
    with pytest.raises(ValueError, match="a link"):
        CheckpointDir(tmp_path).latest()
    assert CheckpointDir(tmp_path).complete() == []
    (tmp_path / "latest").write_text("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0663")
    with pytest.raises(ValueError, match="not a checkpoint name"):
        CheckpointDir(tmp_path).latest()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="latest: a link, not followed"):
        CheckpointDir(tmp_path).latest()


def test_a_train_states_schedule_and_cursor_are_checked_against_the_job():
    """A schedule read back with NaN rates, another step, missing keys or state for the
    factor was loaded as it came (a NaN learning rate, a restarted warmup, a traceback);
    a cursor past the documents raised IndexError mid-run. Each is named instead."""
    from ringctl.train.data import Cursor, SequenceStream, token_digest
    from ringctl.train.optim import make_optimizer, make_scheduler, scheduler_state_problem

    opt = make_optimizer(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.1)
    sched = make_scheduler(opt, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    live = sched.state_dict()
    for _ in range(3):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    assert scheduler_state_problem(saved, live, 3) is None
    for change, said in [
        ({"base_lrs": [float("nan"), 1e-3]}, "base_lrs must be 2 finite numbers"),
        ({"_last_lr": [1e-3]}, "_last_lr must be 2 finite numbers"),
        ({"last_epoch": 0}, "last_epoch / _step_count 0 / 4, not 3 / 4"),
        ({"lr_lambdas": [{"optimizer": 1}, None]}, "lr_lambdas must be empty"),
        ({"_is_initial": "no"}, "_is_initial must be true or false"),
    ]:
        assert said in scheduler_state_problem(saved | change, live, 3), change
    assert "keys" in scheduler_state_problem({"base_lrs": [1, 1]}, live, 3)

    docs = [torch.arange(5), torch.arange(3)]
    stream = SequenceStream(lambda i: docs[i], count=2, seq_len=4, seed=0)
    held = token_digest(docs[stream._order(0)[1]])
    assert stream.check(Cursor(0, 1, 2, held)) is None
    assert stream.check(Cursor(0, 2, 0)) == "document 2 of an epoch of 2"
    length = len(docs[stream._order(0)[1]])
    assert stream.check(Cursor(0, 1, length, held)) == f"token {length} of a document of {length}"


def test_a_train_states_base_rates_must_be_the_jobs():
    """base_lrs edited to 1000 (finite) was loaded as it came: every later step ran at
    lr 1000 x the factor. The fields the config fixes must equal a fresh scheduler's, and
    the last rate lie within [0, the base rate]; a state the job's own schedule wrote (the
    rates of tests/train_reference.lr, also after max_steps grew) passes at every step."""
    from ringctl.train.optim import make_optimizer, make_scheduler, scheduler_state_problem
    from tests.train_reference import lr as reference_lr

    def scheduler(max_steps: int):
        opt = make_optimizer(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.1)
        return opt, make_scheduler(opt, warmup_steps=2, max_steps=max_steps, min_lr_ratio=0.1)

    opt, sched = scheduler(6)
    for step in range(1, 10):
        opt.step()
        sched.step()
        saved = json.loads(json.dumps(sched.state_dict()))  # as train_state.json has it
        want = reference_lr(step, 1e-3, 2, 6, 0.1)
        assert saved["_last_lr"] == pytest.approx([want, want], rel=1e-12)
        for max_steps in (6, 12):  # a resume may stretch the cosine
            live = scheduler(max_steps)[1].state_dict()
            assert scheduler_state_problem(saved, live, step) is None, (step, max_steps)
    live = scheduler(6)[1].state_dict()
    for change, said in [
        ({"base_lrs": [1000.0, 1000.0]}, "base_lrs [1000.0, 1000.0], not the job's [0.001"),
        ({"base_lrs": [1e-3, 2e-3]}, "base_lrs [0.001, 0.002], not the job's"),
        ({"_get_lr_called_within_step": True}, "_get_lr_called_within_step True, not"),
        ({"_last_lr": [5.0, 1e-4]}, "_last_lr [5.0, 0.0001] outside [0, base_lrs"),
        ({"_last_lr": [-1e-4, 1e-4]}, "_last_lr [-0.0001, 0.0001] outside"),
    ]:
        assert said in (scheduler_state_problem(saved | change, live, 9) or ""), change


def test_gather_reads_the_checkpoints_model_config_as_hostile(tmp_path):
    """config.json beside a checkpoint builds the exported model: `[]`, broken JSON or a link
    gave tracebacks, and an ``auto_map`` reached transformers, which offered to run the named
    directory's code. Now: one line naming the file; auto_map dropped before transformers."""
    from ringctl.errors import UserError
    from ringctl.train.export import saved_model_config

    path = tmp_path / "config.json"
    for text, said in [("[]", "a JSON object with a model_type"), ("{", "config.json: ")]:
        path.write_text(text)
        with pytest.raises(UserError, match=said):
            saved_model_config(path)
    path.write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}}))
    assert saved_model_config(path) == {"model_type": "llama"}
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(UserError, match="config.json: a link, not followed"):
        saved_model_config(path)


def test_a_resume_on_other_documents_or_hyperparameters_is_refused(tmp_path):
    """The run signature a checkpoint keeps now holds the documents' listing signature (a
    file added to an input folder reshuffled every epoch: the saved cursor then pointed into
    other data) and the optimizer's hyperparameters (a resume loads the optimizer's groups
    from the checkpoint: a changed lr was silently ignored)."""
    from types import SimpleNamespace

    from ringctl.longdoc.inputs.documents import listing_signature
    from ringctl.train.params import TrainParams
    from ringctl.train.run import resume_from

    root = tmp_path / "docs"
    root.mkdir()
    for name, text in (("a.txt", "first"), ("b.txt", "second")):
        (root / name).write_text(text)
    docs = [SimpleNamespace(key=p.name, nbytes=p.stat().st_size) for p in sorted(root.iterdir())]
    two = listing_signature(docs)
    assert two.startswith("2:") and listing_signature(docs) == two
    assert listing_signature(docs[::-1]) != two
    assert listing_signature(docs + [SimpleNamespace(key="c.txt", nbytes=1)]) != two
    assert listing_signature([docs[0], SimpleNamespace(key="b.txt", nbytes=7)]) != two

    params = TrainParams()
    saved = params.run_signature() | {"documents": two}
    assert {"lr", "weight_decay", "warmup_steps", "min_lr_ratio"} <= set(saved)
    ckroot = tmp_path / "checkpoints"
    ckroot.mkdir()
    _complete(ckroot / "step-0000003", 3)
    state = json.loads((ckroot / "step-0000003" / "train_state.json").read_text())
    (ckroot / "step-0000003" / "train_state.json").write_text(json.dumps(state | {"run": saved}))
    (ckroot / "latest").write_text("step-0000003")
    from ringctl.train.checkpoint import CheckpointDir

    for change, said in [
        ({"documents": "3:abc"}, "with the input documents (listed: count and digest)="),
        ({"lr": 1.0}, "with task.lr=0.0003; this one has 1.0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)):
            found = CheckpointDir(ckroot).latest()
            resume_from(found, None, None, None, None, saved | change, params, None)


def test_a_model_that_trains_with_dropout_is_refused_naming_its_fields():
    """Dropout draws masks from each rank's generator, which no checkpoint keeps: the losses
    would depend on the ranks and a resume would not repeat the run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringctl.train.run import refuse_random_training

    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    neox = AutoConfig.for_model("gpt_neox", intermediate_size=64, hidden_dropout=0.1, **shape)
    with pytest.raises(
        ValueError, match=r"dropout \(hidden_dropout=0.1\).*overrides.hidden_dropout=0"
    ):
        refuse_random_training(AutoModelForCausalLM.from_config(neox))
    neox.hidden_dropout = 0.0  # classifier_dropout stays 0.1: no such head in a causal LM
    refuse_random_training(AutoModelForCausalLM.from_config(neox))


def _random_in_training(model) -> bool:
    """The truth the refusal must tell: whether train-mode forwards of the same ids under
    different generator seeds differ (dropout, whatever applies it; layerdrop's coin can
    fall alike for two seeds, so eight)."""
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    model.train()
    outputs = []
    with torch.no_grad():
        for seed in range(8):
            torch.manual_seed(seed)
            outputs.append(model(ids).logits)
    return any(not torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize(
    "model_type, fields, refused",
    [
        ("opt", {"dropout": 0.1}, "dropout=0.1"),
        ("opt", {"dropout": 0.0, "layerdrop": 0.5}, "layerdrop=0.5"),
        ("opt", {"dropout": 0.0}, None),
        (
            "biogpt",
            {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0},
            "hidden_dropout_prob=0.1",
        ),
        ("biogpt", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, None),
    ],
)
def test_dropout_applied_without_a_dropout_module_is_refused(model_type, fields, refused):
    """OPT and BioGPT apply their config's dropout with nn.functional.dropout: no nn.Dropout
    module to find, so an OPT config (dropout 0.1 by default) trained, its losses depending
    on the ranks. The config's dropout fields are refused as well; the verdict is checked
    against the model itself (two train-mode forwards under other seeds differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringctl.train.run import refuse_random_training

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    if model_type == "opt":
        shape |= dict(ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64)
    else:
        shape |= dict(intermediate_size=64, max_position_embeddings=64)
    config = AutoConfig.for_model(model_type, **shape, **fields)
    model = AutoModelForCausalLM.from_config(config)
    assert _random_in_training(model) == (refused is not None)
    if refused is None:
        refuse_random_training(model)
        return
    key = refused.split("=")[0]
    with pytest.raises(ValueError, match=rf"\({re.escape(refused)}\).*overrides\.{key}=0$"):
        refuse_random_training(model)


def _agreed(rank: int, world: int, roots: list[str]):
    from pathlib import Path

    from ringctl.train.checkpoint import CheckpointDir
    from ringctl.train.run import agreed_latest

    try:
        return agreed_latest(CheckpointDir(Path(roots[rank]))).step
    except ValueError as err:
        return str(err)


def test_every_rank_resumes_from_the_checkpoint_rank_0s_latest_names(tmp_path):
    """Ranks that read ``latest`` each on their own could load different steps (a shared
    filesystem's cached entries): here rank 1's pointer says step 5, rank 0's step 3, and
    both load step 3. A pointer rank 0 refuses is refused on both (none left waiting)."""
    roots = [tmp_path / "seen-by-0", tmp_path / "seen-by-1"]
    for root, latest in zip(roots, ("step-0000003", "step-0000005"), strict=True):
        root.mkdir()
        _complete(root / "step-0000003", 3)
        _complete(root / "step-0000005", 5)
        (root / "latest").write_text(latest)
    assert run_distributed(_agreed, 2, [str(r) for r in roots]) == [3, 3]
    (roots[0] / "latest").write_text("../../etc")
    said = run_distributed(_agreed, 2, [str(r) for r in roots])
    assert said[0] == said[1] and "is not a checkpoint name" in said[0], said


def _weights_verdict(rank: int, world: int, poisoned: int | None):
    from ringctl.train.run import _agree_not_finite

    model = torch.nn.Linear(3, 2)
    if rank == poisoned:
        with torch.no_grad():
            model.bias[1] = float("inf")
    return _agree_not_finite(model)


def test_weights_that_overflowed_on_one_rank_stop_every_ranks_save():
    """A step whose loss and norm were finite can still leave weights that are not (a huge
    lr): the save refuses them, every rank alike when one rank's shard holds them."""
    assert run_distributed(_weights_verdict, 2, None) == [False, False]
    assert run_distributed(_weights_verdict, 2, 1) == [True, True]
