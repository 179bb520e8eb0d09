"""The job's own guards on 2 real ranks (``run_longdoc``): a model it cannot run exactly is
refused on every rank with one clear line; a scorer that gets a model wrong (here: one that
forgets Cohere's logit scale) is stopped by the probe before any document is scored; the model
directory's tokenizer is used by default (and gives the model's own numbers); documents longer
than Llama 4's attention chunk are refused, naming the limit, after the shorter ones are scored,
while a sliding-window model scores them all (the ring applies its window); model overrides
reach the model; a bad record is skipped and named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = ["ring", "attention", "shards", "tokens", "travel", "between", "ranks", "under"]
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _model_with_tokenizer(root: Path) -> Path:
    """A saved tiny Llama (vocabulary 16) with a word-level tokenizer in the same directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from ringctl.longdoc.model.load import build_random

    d = root / "wordllama"
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    config = AutoConfig.for_model("llama", vocab_size=16, **TINY)
    build_random(config, seed=3, dtype=torch.float32, attn_implementation="eager").save_pretrained(
        d
    )
    return d


def _ranks(rank: int, world: int, base: str) -> dict:
    from ringctl.longdoc.run import run_longdoc

    root = Path(base)
    out: dict = {}
    for name in ("bloom", "falcon", "chunked", "windowed"):
        lines: list[str] = []
        params = {"inputs": [str(root / "docs")], "model_path": str(root / f"{name}.json")}
        try:
            run_longdoc(params, rank, world, None, root / f"out-{name}-{rank}", lines.append)
            out[name] = ("completed", lines)
        except RuntimeError as err:
            out[name] = (str(err), lines)
    out["scorer bug"] = _with_plain_head(run_longdoc, rank, world, root)
    lines = []  # the same chunked model, its chunk made longer knowingly: all documents run
    longer = {
        "inputs": [str(root / "docs")],
        "model_path": str(root / "chunked.json"),
        "model_overrides": {"attention_chunk_size": 4096},
    }
    lines = []
    done = run_longdoc(longer, rank, world, None, root / "out-longer", lines.append).done
    out["overridden"] = (done, lines)
    words = {"inputs": [str(root / "words.jsonl")], "model_path": str(root / "wordllama")}
    summary = run_longdoc(words, rank, world, None, root / "out-words", lines.append)
    out["words"] = (summary.done, lines)
    return out


def _with_plain_head(run_longdoc, rank: int, world: int, root: Path) -> tuple[str, bool]:
    """A scorer that forgot Cohere's logit_scale: the job's probe must refuse it, on every
    rank, before any document is scored. Returns (the error, whether any shard was written)."""
    from ringctl.longdoc.compute import scoring

    def plain(model):
        head = model.get_output_embeddings()
        return lambda h: head(h).float()

    kept = scoring.output_head
    scoring.output_head = plain
    params = {"inputs": [str(root / "docs")], "model_path": str(root / "cohere.json")}
    out = root / f"out-bug-{rank}"
    try:
        run_longdoc(params, rank, world, None, out, print)
        error = "completed"
    except RuntimeError as err:
        error = str(err)
    finally:
        scoring.output_head = kept
    return error, (out / "longdoc" / "shards").exists()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("guards")
    (root / "docs").mkdir()
    (root / "docs" / "a-short.txt").write_bytes(bytes(range(40, 90)))  # 50 bytes = 50 tokens
    (root / "docs" / "b-long.txt").write_bytes(bytes(range(30, 130)))  # 100 tokens
    base = dict(model_type="llama", vocab_size=256, **TINY)
    for kind in ("bloom", "falcon"):
        (root / f"{kind}.json").write_text(json.dumps(dict(base, model_type=kind)))
    (root / "cohere.json").write_text(json.dumps(dict(base, model_type="cohere", logit_scale=0.5)))
    windowed = dict(base, model_type="mistral", sliding_window=64)
    (root / "windowed.json").write_text(json.dumps(windowed))
    chunked = dict(base, model_type="llama4_text", attention_chunk_size=64)
    (root / "chunked.json").write_text(json.dumps(chunked))
    _model_with_tokenizer(root)
    text = " ".join(WORDS * 20)
    records = [json.dumps({"text": text}), "{not json", json.dumps({"text": "ranks travel"})]
    (root / "words.jsonl").write_text("\n".join(records) + "\n")
    return root, run_distributed(_ranks, 2, str(root))


def test_unsupported_model_is_refused_on_every_rank(results) -> None:
    _, per_rank = results
    for r in per_rank:
        for kind in ("bloom", "falcon"):  # falcon: a KeyError 'ringattn' before
            msg, _ = r[kind]
            assert f"model type '{kind}'" in msg and "not supported" in msg, msg
            assert "\n" not in msg and "KeyError" not in msg


def test_a_length_limit_refuses_only_longer_documents(results) -> None:
    root, per_rank = results
    for rank, r in enumerate(per_rank):
        msg, lines = r["chunked"]
        assert msg.startswith("b-long.txt: 100 tokens is longer than model type 'llama4_text'"), msg
        assert "limit 64" in msg
        entry = root / f"out-chunked-{rank}" / "longdoc" / "shards"
        assert len(list(entry.iterdir())) == 1  # a-short.txt was scored and written
    lead = per_rank[0]["chunked"][1]
    assert any(line.startswith("probe: model type 'llama4_text', 64 probe tokens") for line in lead)


def test_a_sliding_window_scores_every_document(results) -> None:
    """The window is applied in the ring: the 100-token document (window 64) is scored, and
    the probe (251 tokens, four windows long) checked the ring against the model's own
    windowed forward pass first."""
    _, per_rank = results
    for r in per_rank:
        msg, lines = r["windowed"]
        assert msg == "completed", msg
    lead = per_rank[0]["windowed"][1]
    assert any(line.startswith("probe: model type 'mistral', 251 probe tokens") for line in lead)


def test_the_probe_refuses_the_job_when_the_scorer_is_wrong(results) -> None:
    _, per_rank = results
    for r in per_rank:
        error, wrote = r["scorer bug"]
        assert "does not agree with itself on the ring: model type 'cohere'" in error, error
        assert not wrote  # nothing was scored


def test_model_overrides_reach_the_model(results) -> None:
    """Set on the loaded config (not given to a loader), and said in the job's log."""
    _, per_rank = results
    assert [r["overridden"][0] for r in per_rank] == [2, 2]
    said = "model overrides set on the loaded config: attention_chunk_size=4096"
    assert said in per_rank[0]["overridden"][1]


def test_model_directory_tokenizer_is_the_default_and_exact(results) -> None:
    root, per_rank = results
    done, lines = per_rank[0]["words"]
    assert done == 2
    assert any("bad record skipped" in line and "words.jsonl:2" in line for line in lines)
    run = json.loads((root / "out-words" / "longdoc" / "run.json").read_text())
    assert run["tokenizer_path"] == str(root / "wordllama")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringctl.longdoc.inputs.documents import doc_key

    tok = AutoTokenizer.from_pretrained(root / "wordllama")
    model = AutoModelForCausalLM.from_pretrained(root / "wordllama", attn_implementation="sdpa")
    ids = torch.tensor(tok(" ".join(WORDS * 20))["input_ids"])
    assert ids.numel() == 160 and int(ids.max()) <= len(WORDS)  # words, not bytes
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    want = logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    got = torch.full((ids.numel(),), float("nan"))
    shards = root / "out-words" / "longdoc" / "shards" / doc_key("words.jsonl#1")
    for rank in range(2):
        t = load_file(shards / f"rank-{rank:05d}.safetensors")
        got[t["positions"]] = t["token_logprob"]
        assert torch.equal(t["input_ids"], ids[t["positions"]])
    assert (got[:-1] - want).abs().max() < 2e-5
