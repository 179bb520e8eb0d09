"""The training job, third review: what it accepted and should not have.

* Randomness in training mode that is not called dropout (a router's jitter noise, PhiMoE's
  sampled routing) is refused by name, as dropout is: each rank's generator would decide the
  losses and a resume would not repeat the run. Each verdict is checked against the model
  itself (train-mode forwards under other seeds differ).
* Ranks that listed different input documents (a file arriving while the job starts) are
  refused on every rank, naming both counts (real gloo processes, each rank its own view).
* A model that windows through its mask alone (PhiMoE, Qwen2-MoE) is refused by the training
  step as scoring refuses it: it trained with full attention, its loss not the model's own.
* ``gather`` checks the checkpoint's config.json against the checkpoint's tensors before it
  builds the model (a vocab of 2**40 was a traceback; 20000 layers took 44 s and 4 GB; one
  layer fewer exported a truncated model).
* A config asking for the router's load-balancing loss is refused (the step does not add it).
* ``task.clip`` is part of the run a checkpoint records; checkpoints written before it was
  resume with a notice. ``publish`` syncs config.json and metrics.jsonl before ``latest``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train_checkpoint import _random_in_training
from tests.train_reference import documents, tiny_model, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
DBRX_SHAPE = dict(
    d_model=32,
    n_heads=4,
    n_layers=2,
    max_seq_len=64,
    vocab_size=64,
    attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
)


def _dbrx(jitter):
    from transformers import AutoConfig, AutoModelForCausalLM

    ffn = {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": jitter}
    config = AutoConfig.for_model("dbrx", ffn_config=ffn, **DBRX_SHAPE)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "build, refused",
    [
        (lambda: tiny_model("sdpa", model_type="mixtral", router_jitter_noise=0.1, **MOE), "jit"),
        (lambda: tiny_model("sdpa", model_type="mixtral", **MOE), None),
        (lambda: tiny_model("sdpa", model_type="phimoe", **MOE), "phimoe"),
        (lambda: tiny_model("sdpa", model_type="phimoe", router_jitter_noise=0.0, **MOE), None),
        (lambda: _dbrx(0.1), "dbrx"),
        (lambda: _dbrx(None), None),
    ],
    ids=["mixtral jitter", "mixtral", "phimoe", "phimoe no jitter", "dbrx jitter", "dbrx"],
)
def test_training_randomness_not_called_dropout_is_refused_by_name(build, refused):
    """Mixtral's router_jitter_noise and DBRX's ffn_config.moe_jitter_eps multiply by noise
    in training; PhiMoE samples its routing among experts within its router_jitter_noise
    (0.01 by default) of the best, so at 0 it trains the same under any generator. The
    refusal names the key and its override."""
    from ringctl.train.run import refuse_random_training

    model = build()
    assert _random_in_training(model) == (refused is not None)
    said = {
        "jit": r"\(router_jitter_noise=0\.1\).*task\.model_overrides\.router_jitter_noise=0$",
        "dbrx": r"\(ffn_config\.moe_jitter_eps=0\.1\).*"
        r"task\.model_overrides\.ffn_config\.moe_jitter_eps=0$",
        "phimoe": r"\(router_jitter_noise=0\.01\).*model_overrides\.router_jitter_noise=0$",
    }
    if refused is None:
        refuse_random_training(model)
        return
    with pytest.raises(ValueError, match=said[refused]):
        refuse_random_training(model)


def _listed(rank: int, world: int, views: list[str]):
    """Each rank lists its own view of the inputs (what a shared filesystem shows it)."""
    from ringctl.train.params import TrainParams
    from ringctl.train.run import sequence_stream

    params = TrainParams.from_any({"inputs": [views[rank]]})
    try:
        return sequence_stream(params, None)[1]["documents"]
    except ValueError as err:
        return str(err)


def test_ranks_that_listed_different_documents_are_refused_on_every_rank(tmp_path):
    """A document that arrived between two ranks' listings gave them different streams and
    different token counts as divisors; the job ended well. Now every rank refuses, alike."""
    views = [tmp_path / "seen-by-0", tmp_path / "seen-by-1"]
    for view in views:
        view.mkdir()
        for i in range(3):
            (view / f"doc{i}.txt").write_text(f"document number {i} " * (i + 2))
    same = run_distributed(_listed, 2, [str(v) for v in views])
    assert same[0] == same[1] and same[0].startswith("3:"), same
    (views[1] / "doc3.txt").write_text("arrived while the job started")
    said = run_distributed(_listed, 2, [str(v) for v in views])
    assert said[0] == said[1], said
    assert re.search(r"rank 0 3 documents \(3:\w+\), rank 1 4 \(4:\w+\)", said[0]), said[0]


WINDOW_HP = dict(lr=3e-3, warmup_steps=1, max_steps=3, min_lr_ratio=0.1, weight_decay=0.1)


def _window_step(rank: int, world: int, kw: dict):
    """One training step of the job's on a tiny model with ``kw``; its loss or its refusal."""
    from ringctl.longdoc.compute.scoring import BypassError
    from ringctl.train.data import Cursor, SequenceStream, ring_share
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    docs = documents()
    seqs, _ = SequenceStream(lambda i: docs[i], len(docs), 96, seed=3).take(Cursor(), 2)
    model = tiny_model("ringattn", **kw).eval()  # eval: PhiMoE's routing does not sample
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1)
    sched = make_scheduler(opt, warmup_steps=1, max_steps=3, min_lr_ratio=0.1)
    opts = StepOptions("zigzag", None, 64, 1.0, None)
    seat = RingSeat(None, 1, 0, 0, 1, None)
    try:
        return train_step(model, opt, sched, seqs, ring_share(2, 1, 0), seat, opts, False).loss
    except BypassError as err:
        return str(err)


@pytest.mark.parametrize(
    "kw",
    [
        dict(model_type="phimoe", router_jitter_noise=0.0, **MOE),
        dict(model_type="qwen2_moe", use_sliding_window=True, max_window_layers=2, **MOE),
    ],
    ids=["phimoe", "qwen2_moe"],
)
def test_a_model_windowing_through_its_mask_alone_is_refused_in_training(kw):
    """Their layers never pass sliding_window to the attention call: the ring attended over
    whole pieces, a loss that is not the model's own (its window changes it), accepted.
    A window no piece reaches past changes nothing and trains."""
    from ringctl.train.data import Cursor, SequenceStream

    docs = documents()
    seqs, _ = SequenceStream(lambda i: docs[i], len(docs), 96, seed=3).take(Cursor(), 2)
    windowed = train(
        tiny_model("sdpa", sliding_window=8, **kw).eval(), [seqs], WINDOW_HP | {"clip": 1.0}
    )
    full = train(
        tiny_model("sdpa", sliding_window=4096, **kw).eval(), [seqs], WINDOW_HP | {"clip": 1.0}
    )
    assert abs(windowed[0][0] - full[0][0]) > 1e-4  # the window is part of the model
    said = run_distributed(_window_step, 1, kw | {"sliding_window": 8})[0]
    assert isinstance(said, str) and "sliding window of 8" in said, said
    loss = run_distributed(_window_step, 1, kw | {"sliding_window": 4096})[0]
    assert abs(loss - full[0][0]) <= 1e-5 * abs(full[0][0]), (loss, full[0][0])


def _two_rings_step(rank: int, world: int, kw: dict):
    """Two rings of one rank: ring 0 trains a sequence of 8-token documents, ring 1 one
    piece of 96 tokens; each returns its loss or its refusal."""
    import torch.distributed as dist

    from ringctl.longdoc.compute.scoring import BypassError
    from ringctl.train.data import Cursor, SequenceStream, ring_share
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    short = [torch.arange(8) + i for i in range(20)]
    long = [torch.arange(200) % 256]
    seqs = [
        SequenceStream(lambda i, d=docs: d[i], len(docs), 96, seed=0).take(Cursor(), 1)[0][0]
        for docs in (short, long)
    ]
    groups = [dist.new_group([0]), dist.new_group([1])]
    model = tiny_model("ringattn", **kw).eval()  # eval: PhiMoE's routing does not sample
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1)
    sched = make_scheduler(opt, warmup_steps=1, max_steps=3, min_lr_ratio=0.1)
    seat = RingSeat(groups[rank], 1, 0, rank, 2, None)
    opts = StepOptions("zigzag", None, 64, 1.0, None)
    try:
        return train_step(model, opt, sched, seqs, ring_share(2, 2, rank), seat, opts, False).loss
    except BypassError as err:
        return str(err)


def test_every_ring_refuses_the_step_where_one_rings_piece_passes_the_window():
    """The check runs against the step's longest piece, every ring's: a ring whose own
    pieces fit the window and that went on alone would wait for the others in the
    gradients' sum until the collective timeout."""
    kw = dict(model_type="qwen2_moe", use_sliding_window=True, max_window_layers=2, **MOE)
    started = time.monotonic()
    said = run_distributed(_two_rings_step, 2, kw | {"sliding_window": 8})
    assert all(isinstance(s, str) and "sliding window of 8" in s for s in said), said
    assert time.monotonic() - started < 30


def test_a_config_asking_for_the_router_loss_is_refused_naming_the_override():
    """output_router_logits: true makes transformers train loss + coef x aux_loss; the job's
    step trains the tokens' loss alone: another objective, accepted in silence."""
    from ringctl.train.run import refuse_router_loss

    kw = dict(model_type="mixtral", router_aux_loss_coef=0.02, **MOE)
    model = tiny_model("sdpa", output_router_logits=True, **kw).train()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert float(out.aux_loss.detach()) > 0  # the model's own training loss holds 0.02 x aux_loss
    with pytest.raises(ValueError, match=r"model_overrides\.output_router_logits=false$"):
        refuse_router_loss(model)
    refuse_router_loss(tiny_model("sdpa", output_router_logits=False, **kw))


# ------------------------------------------------------------------ gather's config.json
def _save_tiny(rank: int, world: int, root: str) -> None:
    """A real checkpoint of the tiny Llama at step 1 (DCP, its config.json beside it)."""
    from ringctl.train.checkpoint import CheckpointDir, save, train_state
    from ringctl.train.optim import make_optimizer, make_scheduler

    model = tiny_model("sdpa")
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    sched = make_scheduler(opt, warmup_steps=1, max_steps=3, min_lr_ratio=0.1)
    cursor = {"epoch": 0, "index": 0, "offset": 0, "held": ""}
    state = train_state(1, cursor, sched.state_dict(), {})
    save(model, opt, CheckpointDir(Path(root)), 1, state, keep=2, metrics=Path(root) / "no")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    run_distributed(_save_tiny, 1, str(root))
    return root


@pytest.mark.parametrize(
    "change, said",
    [
        ({"vocab_size": 2**40}, r"has model\.embed_tokens\.weight of shape \[1099511627776, 32\]"),
        ({"intermediate_size": 65}, r"has model\.layers\.0\.mlp\.gate_proj\.weight of shape \[65"),
        ({"num_hidden_layers": 1}, r"holds model\.layers\.1\.\w+.*which the model it describes"),
        ({"num_hidden_layers": 3000}, r"num_hidden_layers=3000, but .* at most 2 numbered"),
        # float32 weights exported in bf16 (the load cast them: lm_head 2.4e-4 off), exit 0
        ({"dtype": "bfloat16"}, r"has model\.embed_tokens\.weight in bfloat16 .* holds float32"),
    ],
)
def test_gather_checks_config_json_against_the_checkpoint_before_building(
    saved, tmp_path, change, said
):
    """config.json is the job directory's: a vocab of 2**40 ended in a traceback, thousands
    of layers took time and memory before the load refused them, and fewer layers (or tied
    embeddings) exported a model missing what the checkpoint holds. Refused in one line,
    naming config.json and the first key that differs, in a second or two."""
    import shutil

    from ringctl.errors import UserError
    from ringctl.train.checkpoint import CheckpointDir
    from ringctl.train.export import export_model

    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    found = CheckpointDir(root).latest()
    config = found.path / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | change))
    started = time.monotonic()
    with pytest.raises(UserError, match=re.escape(str(config)) + ": .*" + said):
        export_model(found, tmp_path / "model", None)
    assert time.monotonic() - started < 4
    assert not (tmp_path / "model").exists()


def test_gather_still_exports_a_checkpoint_whose_config_matches(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    from ringctl.train.checkpoint import CheckpointDir
    from ringctl.train.export import export_model

    export_model(CheckpointDir(saved).latest(), tmp_path / "model", None)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    want = tiny_model("sdpa").state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ task.clip, publish
def _resume_with(rank: int, world: int, root: str, saved_run: dict, params_kw: dict):
    """Save a checkpoint whose run signature is ``saved_run`` then resume from it under
    ``params_kw``: the step it resumed at and what it logged, or the refusal."""
    from ringctl.train.checkpoint import CheckpointDir, save, train_state
    from ringctl.train.data import Cursor, SequenceStream
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.params import TrainParams
    from ringctl.train.run import TrainOptions, resume_from

    params = TrainParams.from_any(params_kw)
    docs = documents()
    stream = SequenceStream(lambda i: docs[i], len(docs), 96, seed=0)

    def fresh():
        model = tiny_model("sdpa")
        opt = make_optimizer(model, lr=params.lr, weight_decay=params.weight_decay)
        kw = dict(warmup_steps=params.warmup_steps, max_steps=params.max_steps)
        return model, opt, make_scheduler(opt, min_lr_ratio=params.min_lr_ratio, **kw)

    model, opt, sched = fresh()
    _, cursor = stream.take(Cursor(), 1)
    opt.step()
    sched.step()
    state = train_state(1, cursor.to_dict(), sched.state_dict(), saved_run)
    ckdir = CheckpointDir(Path(root))
    save(model, opt, ckdir, 1, state, keep=2, metrics=Path(root) / "no")
    model, opt, sched = fresh()
    logged: list[str] = []
    opts = TrainOptions(0, 1, Path(root), logged.append, None, None)
    run = params.run_signature()
    try:
        step, _ = resume_from(ckdir.latest(), model, opt, sched, stream, run, params, opts)
    except ValueError as err:
        return str(err)
    return step, logged


def test_clip_is_part_of_the_run_a_checkpoint_records(tmp_path):
    """A hand-edited config.yaml resumed with another task.clip and no notice. Now another
    clip is refused by name; a checkpoint written before clip was recorded still resumes,
    saying that its clip could not be checked."""
    from ringctl.train.params import TrainParams

    hp = {"max_steps": 4, "warmup_steps": 1, "clip": 1.0}
    recorded = TrainParams.from_any(hp).run_signature()
    assert recorded["clip"] == 1.0
    said = run_distributed(_resume_with, 1, str(tmp_path / "a"), recorded, hp | {"clip": 0.5})[0]
    assert isinstance(said, str) and "with task.clip=1.0; this one has 0.5" in said, said
    older = {k: v for k, v in recorded.items() if k != "clip"}
    step, logged = run_distributed(_resume_with, 1, str(tmp_path / "b"), older, hp)[0]
    assert step == 1
    assert any("written before checkpoints recorded task.clip" in line for line in logged)


def test_publish_syncs_config_and_metrics_before_latest_names_them(tmp_path, monkeypatch):
    """config.json and metrics.jsonl were written without fsync before the rename and
    ``latest``: a crash could leave a published checkpoint with empty files (checksums.json
    likewise)."""
    from ringctl.train.checkpoint import CheckpointDir

    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckdir = CheckpointDir(tmp_path / "checkpoints")
    staged = ckdir.staging(2, "feedface")
    staged.mkdir(parents=True)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    sums = {".metadata": "0" * 64}
    final = ckdir.publish(staged, 2, {"step": 2}, '{"model_type": "llama"}', 2, metrics, sums)
    for name in ("checksums.json", "config.json", "metrics.jsonl"):
        assert any(s.startswith(f".{name}.") for s in synced), (name, synced)
    assert (final / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((final / "config.json").read_text()) == {"model_type": "llama"}


def test_the_override_a_nested_refusal_names_is_accepted() -> None:
    """DBRX saves ffn_config with model_type "": its fields were unknown, so the override the
    randomness refusal names (task.model_overrides.ffn_config.moe_jitter_eps=0) was itself
    refused. A sub-config's class comes from its parent's sub_configs now; a key it does not
    have is still refused."""
    from ringctl.longdoc.model.overrides import problem

    config = {"model_type": "dbrx", "ffn_config": {"model_type": "", "moe_jitter_eps": 0.01}}
    assert problem(config, {"ffn_config": {"moe_jitter_eps": 0}}) is None
    key, why = problem(config, {"ffn_config": {"moe_jitter_epz": 0}})
    assert key.endswith("ffn_config.moe_jitter_epz"), (key, why)


@pytest.mark.timeout(120)
def test_a_rank_that_lists_no_document_is_refused_with_the_others(tmp_path):
    """The listing refused "no documents" on that rank alone, before the listings were
    compared: the other rank waited in the gather until the collective timeout. The refusal
    is gathered with the signatures and raised on every rank."""
    views = [tmp_path / "seen-by-0", tmp_path / "seen-by-1"]
    for view in views:
        view.mkdir()
    (views[0] / "doc0.txt").write_text("a document only rank 0 sees " * 3)
    said = run_distributed(_listed, 2, [str(v) for v in views])
    assert said[0] == said[1] and said[0].startswith("rank 1: "), said
    assert "seen-by-1: no .txt" in said[0]


def _save_chat(rank: int, world: int, root: str) -> None:
    """A checkpoint of a model whose own generation config ends a turn on two ids, samples."""
    from transformers import GenerationConfig

    from ringctl.train.checkpoint import CheckpointDir, save, train_state
    from ringctl.train.optim import make_optimizer, make_scheduler

    model = tiny_model("sdpa")
    model.generation_config = GenerationConfig(eos_token_id=[1, 5], do_sample=True, temperature=0.6)
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    sched = make_scheduler(opt, warmup_steps=1, max_steps=3, min_lr_ratio=0.1)
    state = train_state(
        1, {"epoch": 0, "index": 0, "offset": 0, "held": ""}, sched.state_dict(), {}
    )
    save(model, opt, CheckpointDir(Path(root)), 1, state, keep=2, metrics=Path(root) / "no")


def test_gather_exports_the_model_s_own_generation_config(tmp_path):
    """save_pretrained wrote a generation config derived from config.json: a chat model's
    end-of-turn ids [1, 5] became 1 and its sampling settings were lost, exit 0 (generation
    with the export ran past the end of a turn). The checkpoint keeps the model's own
    (covered by checksums.json), and gather exports it."""
    from transformers import GenerationConfig

    from ringctl.train.checkpoint import CheckpointDir, verify
    from ringctl.train.export import export_model

    run_distributed(_save_chat, 1, str(tmp_path / "ck"))
    found = CheckpointDir(tmp_path / "ck").latest()
    assert verify(found) == ""
    export_model(found, tmp_path / "model", None)
    got = GenerationConfig.from_pretrained(tmp_path / "model")
    assert got.eos_token_id == [1, 5] and got.do_sample is True and got.temperature == 0.6
