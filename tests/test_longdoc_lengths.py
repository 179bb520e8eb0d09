"""One length estimator (issue 20): submit's check, `ringctl plan JOB` and the job's schedule
size a document with the same function, ``longdoc.schedule.estimated_tokens``. Before, plan
divided the bytes by 4 whenever a tokenizer was set while submit took the bytes, so plan
priced a corpus four times shorter than the one submit had just let through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.longdoc.inputs.documents import list_documents
from ringctl.longdoc.schedule import (
    RingOptions,
    estimated_tokens,
    plan_schedule,
    sampled_bytes_per_token,
)
from ringctl.tasks import get_task
from tests.longdoc_reference import word_model

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "longdoc.yaml"


def _corpus(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("short one")
    (tmp_path / "b.txt").write_bytes("é".encode() * 5000)  # 2 bytes per character
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n{"text": "two records"}\n')
    return tmp_path


class _Halves:
    """A tokenizer of two bytes per token (what a real one's sample measures)."""

    name = "halves"

    def encode(self, raw: bytes) -> list[int]:
        return list(range(-(-len(raw) // 2)))


def test_submit_plan_and_job_size_documents_alike(tmp_path):
    corpus = _corpus(tmp_path)
    docs = list_documents([str(corpus)]).documents
    nbytes = [len(d.read_bytes()) for d in docs]
    assert estimated_tokens(docs) == nbytes  # bytes: the byte tokenizer's exact count
    # a tokenizer set: plan and submit still size by bytes (an upper bound), not bytes / 4
    byte_model = "task.model_path=bundled:demo-byte-llama"
    cfg = load_job(JOB, [f"task.inputs=[{corpus}]", f"task.tokenizer_path={tmp_path}", byte_model])
    listed = get_task("longdoc").document_lengths(cfg)
    assert listed == [(d.id, n) for d, n in zip(docs, nbytes, strict=True)]
    # the job: the same function, refined by the sampled bytes per token
    assert sampled_bytes_per_token(docs, _Halves()) == sum(nbytes) / sum(-(-n // 2) for n in nbytes)
    for tokenizer, ratio in ((type("B", (), {"name": "bytes"})(), 1.0), (_Halves(), None)):
        ratio = ratio or sampled_bytes_per_token(docs, tokenizer)
        schedule = plan_schedule(docs, RingOptions(), world=2, layout="zigzag", tokenizer=tokenizer)
        tokens = [e.tokens for e in sorted(schedule.entries, key=lambda e: e.index)]
        assert tokens == estimated_tokens(docs, ratio)
        assert tokens == [int(-(-n // ratio)) for n in nbytes]


def test_the_estimator_and_the_scheduler_import_without_torch():
    """Submit and plan size documents with no torch in the process."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ringctl.longdoc.schedule, ringctl.longdoc.schedule, ringctl.tasks.longdoc\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_document_denser_than_the_sample_is_counted_before_it_is_placed(tmp_path):
    """The job sizes documents with one bytes-per-token ratio sampled from the first ones: a
    document of short words (2 bytes a token against the sample's 11) was estimated at a
    fifth of its tokens and put on a ring of 1 rank, which then ran it over
    ring.max_tokens_per_rank unsaid (an out-of-memory on a GPU). A document whose estimate
    picks a ring its bytes would not fit is tokenised for its real count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ringctl.longdoc.model.tokenize import load_tokenizer

    words = {"[UNK]": 0, "abcdefghij": 1, "a": 2}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for n in range(20):  # the sample: 11 bytes a token
        (corpus / f"{n:02d}.txt").write_text("abcdefghij " * 300)
    (corpus / "z-dense.txt").write_text("a " * 600)  # 1,200 bytes, 600 tokens: 2 a token
    docs = list_documents([str(corpus)]).documents
    assert sampled_bytes_per_token(docs, tokenizer) > 10  # the dense one taken for 118
    budget = 400  # a rank holds 400 tokens: the dense document needs a ring of 2
    options = RingOptions(size="auto", max_tokens_per_rank=budget)
    schedule = plan_schedule(docs, options, world=2, layout="zigzag", tokenizer=tokenizer)
    dense = next(e for e in schedule.entries if e.doc_id == "z-dense.txt")
    assert dense.tokens == len(tokenizer.encode(b"a " * 600)) == 600
    assert dense.ring_size == 2, dense
    assert all(e.ring_size == 1 for e in schedule.entries if e.doc_id != "z-dense.txt")


def test_submit_and_plan_refuse_by_a_document_s_real_length(tmp_path, capsys):
    """Both sized documents by bytes, an upper bound for a model's tokenizer: a job whose
    document makes 300 tokens (3,300 bytes) was refused on a ring holding 400 ("has 3,300
    tokens: no ring of this job holds it"). A document whose bound no ring holds is now
    counted with the job's tokenizer. And submit left the bundled samples out ("they fit"):
    under a budget of 2,000 the byte model's job passed submit and failed on the ranks."""
    from ringctl.cli import main
    from ringctl.errors import UserError
    from ringctl.submission import checked_for_submission

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "long.txt").write_text("abcdefghij " * 300)  # 3,300 bytes, 300 tokens
    model = word_model(tmp_path)
    job = [f"task.inputs=[{docs}]", f"task.model_path={model}", "nodes=1", "tasks_per_node=2"]
    job += ["ring.size=auto", "ring.max_tokens_per_rank=200"]  # a ring of 2 holds 400
    checked_for_submission(load_job(JOB, job), str(JOB))  # not refused
    capsys.readouterr()
    assert main(["plan", str(JOB), *job]) == 0, capsys.readouterr().err
    job[-1] = "ring.max_tokens_per_rank=100"  # 200 a ring: now it truly does not fit
    with pytest.raises(UserError, match="'long.txt' has 300 tokens"):
        checked_for_submission(load_job(JOB, job), str(JOB))
    samples = ["task.model_path=bundled:demo-byte-llama", "ring.max_tokens_per_rank=2000"]
    with pytest.raises(UserError, match="jargon-file-excerpts.txt.*Nothing was submitted"):
        checked_for_submission(load_job(JOB, samples), str(JOB))


def test_a_document_sparser_than_the_sample_is_counted_not_refused_by_its_estimate(tmp_path):
    """The second reading: a document whose sampled estimate fits no ring kept the estimate,
    and the ranks refused the job by it ("has 84,852 tokens") after submit had counted it
    and let it through. It is counted too."""
    from ringctl.longdoc.model.tokenize import load_tokenizer

    tokenizer = load_tokenizer(word_model(tmp_path))
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for n in range(30):  # the sample: 2 bytes a token
        (corpus / f"{n:02d}.txt").write_text("a " * 300)
    (corpus / "prose.txt").write_text("abcdefghij " * 600)  # 6,600 bytes, 600 tokens
    docs = list_documents([str(corpus)]).documents
    options = RingOptions(size="auto", max_tokens_per_rank=400)  # a ring of 2 holds 800
    schedule = plan_schedule(docs, options, world=2, layout="zigzag", tokenizer=tokenizer)
    prose = next(e for e in schedule.entries if e.doc_id == "prose.txt")
    assert (prose.tokens, prose.ring_size) == (600, 2)


def test_without_transformers_here_the_bounds_stand(tmp_path, monkeypatch):
    """A job naming its own environment (env.venv) is not held to this host's packages: a
    document's count needed transformers here, a ModuleNotFoundError traceback at submit."""
    import sys

    from ringctl.errors import UserError
    from ringctl.submission import checked_for_submission

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "long.txt").write_text("abcdefghij " * 300)
    job = [f"task.inputs=[{docs}]", f"task.model_path={word_model(tmp_path)}"]
    job += ["nodes=1", "tasks_per_node=2", "ring.size=auto", "ring.max_tokens_per_rank=200"]
    job += [f"env.venv={tmp_path}", "backend=slurm"]  # (a local job runs this interpreter)
    cfg = load_job(JOB, job)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserError, match="'long.txt' has 3,300 tokens"):  # by its bound
        checked_for_submission(cfg, str(JOB))


def test_the_unchecked_note_is_for_the_job_s_own_inputs(tmp_path, capsys):
    """Submit now checks the bundled samples under a budget; with no device and no budget it
    said "nothing checks that it fits" of them, on the demo's first command. Said for the
    job's own inputs only."""
    from ringctl.sizing import Sizing
    from ringctl.submission import check_documents

    check_documents(Sizing(load_job(JOB, ["task.model_path=null"])))
    assert "nothing checks that it fits" not in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("a document of its own")
    check_documents(Sizing(load_job(JOB, ["task.model_path=null", f"task.inputs=[{tmp_path}]"])))
    assert "nothing checks that it fits" in capsys.readouterr().err
