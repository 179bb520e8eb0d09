"""Train the demo's byte-level model again: its data, two runs of the training job, and the
held-out evaluation.

    python3 scripts/train_demo_model.py WORK            # what scripts/train-demo-model runs
    python3 scripts/train_demo_model.py WORK --quick    # a few steps: proves the script runs

Data: freely licensed English from two Debian packages (``apt-get install debian-handbook
jargon-text``): the English HTML of The Debian Administrator's Handbook (GPL-2+ or
CC-BY-SA-3.0), paragraphs and titles only (``<pre>`` blocks of commands and output are
dropped), one section per HTML file; and the Jargon File (public domain), paragraphs of 40
characters or more, in parts of about JARGON_PART bytes. Whitespace is collapsed, paragraphs
are wrapped at 90 columns. Of each source's sections, sorted, every tenth (index 5, 15, 25,
...) is held out and never trained on. The bundled sample documents are not read. The
held-out sections are written one per file (WORK/heldout/NAME.txt, for the evaluation and the
long-document job). The training sections, joined by newlines into one text, give each
phase as many windows of exactly its sequence length in bytes as it trains on (steps x
sequences per step), each at a random start drawn from the seed, one file per window
(WORK/train-256/NNNNN.txt, WORK/train-2048/NNNNN.txt; a cut may fall inside a multi-byte
character: the job reads bytes). Each window is then one document and fills one packed
sequence exactly; the phase is one epoch of them, in the job's shuffled order, so every step
draws its sequences from across the text at offsets never repeated. (Whole sections as
documents put consecutive pieces of one section in a step: 2.447 bits per byte held out;
consecutive fixed windows, each seen about twice at the same cut: 2.208; random windows, as
the hand-written loop drew them: about 2.1; the model card says more.)

Training: the bundled training job (``ringctl run train``), with the overrides of PHASES, on
two local ranks (one ring, zigzag, one thread each), one run per phase, each gathered with
``ringctl gather`` (its model/, metrics.jsonl, loss.png):

1. WORK/phase-1: the model's config (WORK/model.json: CONFIG, its weights drawn from the
   seed, SEED unless ``--seed``) on 256-byte sequences, 16 per step;
2. WORK/phase-2: phase 1's gathered model on 2048-byte sequences, 2 per step, with a fresh
   AdamW and schedule (the job starts both anew): a short warm-up to 5e-4, then a cosine to
   3e-4, the range the hand-written loop's single schedule spanned over these steps.

The job visits the documents in an order shuffled by the seed per epoch, each sequence's
positions from 0 (``ringctl/train/data.py``); its loss is the mean over each step's predicted
bytes (a window's last byte predicts nothing). The commands are printed as they run and
recorded in WORK/train.json.

Writes WORK/model (phase 2's weights in float16, the shipped form) and WORK/train.json (the
data, the config, the commands, a loss log, wall times, and the held-out losses of the
float16 weights loaded in float32, scored in consecutive windows of at most CONTEXT + 1
bytes, with a byte-bigram baseline).
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import math
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ringctl.jobdir import JobDir

HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PACKAGES = {"debian-handbook": "GPL-2+ or CC-BY-SA-3.0", "jargon-text": "public domain"}
JARGON_PART = 8192  # bytes of consecutive Jargon File paragraphs per "section"
HELD_OUT_EVERY, HELD_OUT_AT = 10, 5
WRAP = 90
SEED = 1234
RANKS = 2
CONTEXT = 2048
LOG_EVERY = 25  # steps between the loss log's entries in train.json
CONFIG = {
    "model_type": "mistral",
    "vocab_size": 256,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
    "sliding_window": CONTEXT,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


@dataclass(frozen=True)
class Phase:
    """One run of the training job: ``seq_len`` bytes per sequence, ``batch`` sequences per
    step, ``steps`` steps, peak ``lr`` after ``warmup`` steps, cosine to lr x min_lr_ratio."""

    name: str
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float


# The same 4096 bytes per step in both phases; phase 2 starts from phase 1's end learning rate.
PHASES = (
    Phase("phase-1", 256, 16, 1000, 3e-3, 100, 0.1),
    Phase("phase-2", CONTEXT, 2, 200, 5e-4, 20, 0.6),
)
QUICK = (
    Phase("phase-1", 256, 4, 3, 3e-3, 1, 0.1),
    Phase("phase-2", CONTEXT, 2, 2, 5e-4, 1, 0.6),
)
WEIGHT_DECAY, CLIP, CHECKPOINT_EVERY = 0.1, 1.0, 100


# --- data -----------------------------------------------------------------------------------


class _Paragraphs(html.parser.HTMLParser):
    """The text of every ``<div class="para">`` and heading, outside ``<pre>`` blocks."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._parts: list[str] | None = None
        self._tag, self._depth, self._skip = "", 0, 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("pre", "script", "style"):
            self._skip += 1
        classes = (dict(attrs).get("class") or "").split()
        opens = (tag == "div" and "para" in classes) or tag in ("h1", "h2", "h3", "h4")
        if self._parts is None and opens:
            self._parts, self._tag, self._depth = [], tag, 0
        if self._parts is not None and tag == self._tag:
            self._depth += 1

    def handle_endtag(self, tag) -> None:
        if tag in ("pre", "script", "style"):
            self._skip -= 1
        if self._parts is not None and tag == self._tag:
            self._depth -= 1
            if self._depth == 0:
                text = " ".join("".join(self._parts).split())
                if text:
                    self.found.append(text)
                self._parts = None

    def handle_data(self, data) -> None:
        if self._parts is not None and not self._skip:
            self._parts.append(data)


def section_text(path: Path) -> str:
    """One handbook HTML file as plain text: paragraphs wrapped at WRAP columns."""
    parser = _Paragraphs()
    parser.feed(path.read_text(encoding="utf-8"))
    return "\n\n".join(textwrap.fill(p, WRAP) for p in parser.found) + "\n"


def handbook_sections(root: Path = HANDBOOK) -> list[tuple[str, str]]:
    files = sorted(root.glob("*.html"))
    if not files:
        sys.exit(f"{root}: no HTML here; install the package: apt-get install -y debian-handbook")
    return [(f"handbook-{f.stem}", section_text(f)) for f in files]


def jargon_sections(path: Path = JARGON) -> list[tuple[str, str]]:
    """The Jargon File's paragraphs of 40 characters or more (not its contents lists and
    headword index), ``{cross references}`` as plain words, wrapped at WRAP columns, in
    consecutive parts of about JARGON_PART bytes."""
    if not path.is_file():
        sys.exit(f"{path}: missing; install the package: apt-get install -y jargon-text")
    raw = gzip.decompress(path.read_bytes()).decode("utf-8")
    paragraphs = [" ".join(p.split()) for p in raw.split("\n\n")]
    kept = [p.replace("{", "").replace("}", "") for p in paragraphs if len(p) >= 40]
    parts, current = [], []
    for text in kept:
        current.append(textwrap.fill(text, WRAP))
        if sum(len(c) for c in current) >= JARGON_PART:
            parts.append("\n\n".join(current) + "\n")
            current = []
    if current:
        parts.append("\n\n".join(current) + "\n")
    return [(f"jargon-{i:03d}", text) for i, text in enumerate(parts)]


def split(sections: list[tuple[str, str]]) -> tuple[list, list]:
    """(training sections, held-out sections): every HELD_OUT_EVERY-th one is held out."""
    train = [s for i, s in enumerate(sections) if i % HELD_OUT_EVERY != HELD_OUT_AT]
    held = [s for i, s in enumerate(sections) if i % HELD_OUT_EVERY == HELD_OUT_AT]
    return train, held


def sections() -> tuple[list, list]:
    """(training sections, held-out sections) of both sources, handbook first."""
    train, held = split(handbook_sections())
    train_j, held_j = split(jargon_sections())
    return train + train_j, held + held_j


def as_bytes(sections: list[tuple[str, str]]) -> torch.Tensor:
    raw = "\n".join(text for _, text in sections).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def write_documents(folder: Path, sections: list[tuple[str, str]]) -> None:
    """One NAME.txt per section (a document of the job), the folder emptied first."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, text in sections:
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")


def write_windows(folder: Path, data: torch.Tensor, size: int, count: int, seed: int) -> None:
    """``count`` windows of ``size`` bytes of ``data`` (bytes as ids) at random starts drawn
    from ``seed``, one file each, the folder emptied first. Random starts, not consecutive
    cuts: a window seen twice at the same cut is learnt by heart (the module docstring)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    raw = bytes(data.to(torch.uint8).tolist())
    gen = torch.Generator().manual_seed(seed + size)
    starts = torch.randint(0, len(raw) - size + 1, (count,), generator=gen).tolist()
    for i, start in enumerate(starts):
        (folder / f"{i:05d}.txt").write_bytes(raw[start : start + size])


# --- training: runs of the job ----------------------------------------------------------------


def overrides(phase: Phase, work: Path, model_path: Path, seed: int) -> list[str]:
    """The ``ringctl run train`` overrides of one phase."""
    return [
        f"job_dir={work / phase.name}",
        "backend=local",
        "nodes=1",
        f"tasks_per_node={RANKS}",
        f"task.inputs={work / f'train-{phase.seq_len}'}",
        f"task.model_path={model_path}",
        "task.dtype=float32",
        f"task.seq_len={phase.seq_len}",
        f"task.batch_sequences={phase.batch}",
        f"task.max_steps={phase.steps}",
        f"task.lr={phase.lr}",
        f"task.warmup_steps={phase.warmup}",
        f"task.min_lr_ratio={phase.min_lr_ratio}",
        f"task.weight_decay={WEIGHT_DECAY}",
        f"task.clip={CLIP}",
        f"task.seed={seed}",
        f"task.checkpoint_every={min(CHECKPOINT_EVERY, phase.steps)}",
        "ring.layout=zigzag",
    ]


def ringctl(args: list[str], work: Path) -> tuple[str, float]:
    """Run one ringctl command (its output passes through); (the command as recorded, with
    WORK for the work directory, wall seconds)."""
    shown = " ".join(["ringctl", *args])
    print(f"$ {shown}", flush=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ringctl", *args], check=False)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"`{shown}` exited {done.returncode}")
    return shown.replace(str(work), "WORK"), seconds


def train(work: Path, phases: tuple[Phase, ...], seed: int) -> dict:
    """Every phase's run and gather; what train.json records of them."""
    model_path = work / "model.json"
    model_path.write_text(json.dumps({**CONFIG, "_ringctl_seed": seed}, indent=1) + "\n")
    runs, history, done = [], [], 0
    for phase in phases:
        job = work / phase.name
        shutil.rmtree(job, ignore_errors=True)
        run, run_s = ringctl(["run", "train", *overrides(phase, work, model_path, seed)], work)
        gather, gather_s = ringctl(["gather", str(job)], work)
        gathered = JobDir(job).gathered  # where `ringctl gather` writes by default
        records = [json.loads(line) for line in (gathered / "metrics.jsonl").open()]
        history += log_of(records, done, phase.seq_len)
        runs.append(
            {
                "phase": phase.name,
                "commands": [run, gather],
                "wall_seconds": round(run_s, 1),
                "gather_seconds": round(gather_s, 1),
                "step_seconds": round(sum(r["seconds"] for r in records), 1),
                "last_loss": records[-1]["loss"],
                "mean_loss_last_25_steps": mean([r["loss"] for r in records[-LOG_EVERY:]]),
            }
        )
        done += phase.steps
        model_path = gathered / "model"
    to_float16(model_path, work / "model")
    return {"runs": runs, "history": history}


def log_of(records: list[dict], before: int, seq_len: int) -> list[list]:
    """Every LOG_EVERY-th step (and the last) of a phase: [step of the whole training,
    seq_len, the step's loss, the mean loss of the LOG_EVERY steps up to it, its lr]."""
    out = []
    for i, r in enumerate(records):
        if r["step"] % LOG_EVERY == 0 or i == len(records) - 1:
            recent = [x["loss"] for x in records[max(0, i + 1 - LOG_EVERY) : i + 1]]
            out.append([before + r["step"], seq_len, r["loss"], mean(recent), r["lr"]])
    return out


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 5)


def to_float16(gathered: Path, out: Path) -> None:
    """The gathered float32 model as the shipped float16 transformers directory."""
    from transformers import AutoModelForCausalLM

    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gathered, dtype=torch.float16)
    model.save_pretrained(out, safe_serialization=True)


# --- evaluation -------------------------------------------------------------------------------


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-byte next-byte losses of one document (float64), the model's own sdpa forward."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    return -logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def bigram_loss(train: torch.Tensor, test: torch.Tensor) -> float:
    """The byte bigram baseline (add-one smoothing, fitted on the training bytes)."""
    counts = torch.ones(256, 256, dtype=torch.float64)
    counts.index_put_(
        (train[:-1], train[1:]), torch.ones(train.numel() - 1, dtype=torch.float64), accumulate=True
    )
    logp = (counts / counts.sum(1, keepdim=True)).log()
    return float(-logp[test[:-1], test[1:]].mean())


def evaluate(model_dir: Path, held: list, train_data: torch.Tensor) -> dict:
    """Held-out losses of the saved float16 weights loaded in float32 (what a job loads), each
    section in consecutive windows of at most CONTEXT + 1 bytes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    total, count, per_section = 0.0, 0, {}
    for name, text in held:
        ids = as_bytes([("", text)])
        nll_sum, nll_count = 0.0, 0
        for s in range(0, ids.numel() - 1, CONTEXT):
            nll = loss_of(model, ids[s : s + CONTEXT + 1])
            nll_sum, nll_count = nll_sum + float(nll.sum()), nll_count + nll.numel()
        per_section[name] = round(nll_sum / nll_count, 5)
        total, count = total + nll_sum, count + nll_count
    within = total / count
    held_data = as_bytes(held)
    return {
        "held_out_bytes": held_data.numel(),
        "held_out_loss_nats_per_byte": within,
        "held_out_bits_per_byte": within / math.log(2),
        "held_out_scored_in": f"consecutive windows of at most {CONTEXT + 1} bytes",
        "bigram_loss_nats_per_byte": bigram_loss(train_data, held_data),
        "per_section_nats_per_byte": per_section,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--quick", action="store_true", help="a few steps: proves the script runs")
    ap.add_argument("--seed", type=int, default=SEED, help=f"weights and data order ({SEED})")
    args = ap.parse_args(argv)
    work = args.work.absolute()
    train_sections, held = sections()
    train_data, held_data = as_bytes(train_sections), as_bytes(held)
    sizes = f"{len(train_sections)} sections ({train_data.numel()} bytes) for training, "
    print(f"{', '.join(PACKAGES)}: {sizes}{len(held)} held out ({held_data.numel()} bytes)")
    write_documents(work / "heldout", held)
    phases = QUICK if args.quick else PHASES
    for phase in phases:  # one epoch of windows per phase
        count = phase.steps * phase.batch
        write_windows(work / f"train-{phase.seq_len}", train_data, phase.seq_len, count, args.seed)
    start = time.monotonic()
    trained = train(work, phases, args.seed)
    seconds = time.monotonic() - start
    result = evaluate(work / "model", held, train_data)
    import transformers

    training = {
        "job": "train (ringctl run train, the overrides in commands)",
        "seed": args.seed,
        "ranks": RANKS,
        "layout": "zigzag",
        "phases": [[p.seq_len, p.batch, p.steps] for p in phases],
        "lr": [p.lr for p in phases],
        "warmup_steps": [p.warmup for p in phases],
        "min_lr_ratio": [p.min_lr_ratio for p in phases],
        "weight_decay": WEIGHT_DECAY,
        "clip": CLIP,
        "wall_seconds": round(seconds, 1),
        "runs": trained["runs"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    data = {
        "packages": PACKAGES,
        "files": [str(HANDBOOK), str(JARGON)],
        "train_sections": len(train_sections),
        "train_bytes": train_data.numel(),
        "held_out": [name for name, _ in held],
    }
    record = {"data": data, "config": CONFIG, "training": training, "result": result}
    record["history"] = trained["history"]
    (work / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_section_nats_per_byte"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
