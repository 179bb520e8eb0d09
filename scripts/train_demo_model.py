"""Train the demo's byte-level model once, reproducibly, through ringattn's own ring.

    python3 scripts/train_demo_model.py OUT            # what scripts/train-demo-model runs
    python3 scripts/train_demo_model.py OUT --quick    # a few steps: proves the script runs

Data: freely licensed English from two Debian packages (``apt-get install debian-handbook
jargon-text``): the English HTML of The Debian Administrator's Handbook (GPL-2+ or
CC-BY-SA-3.0), paragraphs and titles only (``<pre>`` blocks of commands and output are
dropped), one section per HTML file; and the Jargon File (public domain), paragraphs of 40
characters or more, in parts of about JARGON_PART bytes. Whitespace is collapsed, paragraphs
are wrapped at 90 columns. Of each source's sections, sorted, every tenth (index 5, 15, 25,
...) is held out and never trained on. The bundled sample documents are not read.

Training: two local ranks (gloo, one thread each) hold the zigzag shards of every sequence;
the model is transformers' MistralForCausalLM (a Llama with a sliding window of CONTEXT bytes:
over the training sequences, never longer than CONTEXT, the window changes nothing; past
CONTEXT it keeps every query's keys within the distances the model was trained on) whose
attention is ``ringattn`` (the ring's forward and backward); each rank's loss is its tokens'
share of the batch mean and the gradients are summed over the ring. AdamW, linear warm-up
then cosine decay; two phases with the same bytes per step: short windows first, then
windows of CONTEXT bytes. Batches are drawn from one seeded generator (every rank draws the
same offsets), the weights from a seeded init.

Writes OUT/model (config.json + model.safetensors in float16, the shipped form), OUT/heldout
(the held-out text, one .txt per section, for ``ringctl run`` to score) and OUT/train.json
(the settings, the loss log, the held-out losses of the saved float16 weights, wall time).
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import math
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PACKAGES = {"debian-handbook": "GPL-2+ or CC-BY-SA-3.0", "jargon-text": "public domain"}
JARGON_PART = 8192  # bytes of consecutive Jargon File paragraphs per "section"
HELD_OUT_EVERY, HELD_OUT_AT = 10, 5
WRAP = 90
SEED = 1234
WORLD = 2
CONTEXT = 2048
# (context, sequences per step, steps): the same bytes per step in both phases.
PHASES = ((256, 16, 1000), (CONTEXT, 2, 200))
QUICK_PHASES = ((256, 4, 3), (CONTEXT, 1, 3))
LR, MIN_LR_FRACTION, WARMUP, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 100, 0.1, 1.0
EVAL_EVERY, EVAL_WINDOWS, LOG_EVERY = 100, 8, 25
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


def as_bytes(sections: list[tuple[str, str]]) -> torch.Tensor:
    raw = "\n".join(text for _, text in sections).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


# --- model ----------------------------------------------------------------------------------


def build_model(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringattn.hf import register

    register()
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(**CONFIG)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to MIN_LR_FRACTION * peak."""
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    done = (step - WARMUP) / max(1, total - WARMUP)
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * done)))


def optimizer_for(model) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


# --- the ring -------------------------------------------------------------------------------


def ring_loss(model, windows: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's share of the mean next-byte loss of ``windows`` (B, T + 1), through the
    ring: inputs and labels are sharded alike (zigzag), positions are global."""
    from ringattn import sequence_positions, shard_sequence
    from ringattn.hf import ring_settings

    batch, length = windows.shape[0], windows.shape[1] - 1
    kw = dict(world_size=WORLD, rank=rank, layout="zigzag")
    ids = shard_sequence(windows[:, :-1], dim=1, **kw)
    labels = shard_sequence(windows[:, 1:], dim=1, **kw)
    positions = sequence_positions(length, **kw).expand(batch, -1)
    with ring_settings(layout="zigzag", seq_len=length, model=model):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return nll / (batch * length)


def sum_gradients(model) -> None:
    """One all_reduce of every gradient (the ring's ranks hold parts of one batch)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    torch.nn.utils.vector_to_parameters(flat, grads)


def draw(data: torch.Tensor, gen: torch.Generator, batch: int, context: int) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()])


def eval_windows(data: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``context + 1`` bytes (the same every run)."""
    step = (data.numel() - context - 1) // count
    return torch.stack([data[i * step : i * step + context + 1] for i in range(count)])


def train_rank(rank: int, port: int, out: str, phases, lr, train_data, held_data, log) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = build_model("ringattn")
    model.train()
    opt = optimizer_for(model)
    gen = torch.Generator().manual_seed(SEED)
    held = eval_windows(held_data, CONTEXT, EVAL_WINDOWS)
    total, step, start = sum(p[2] for p in phases), 0, time.monotonic()
    for context, batch, steps in phases:
        for _ in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, lr)
            loss = ring_loss(model, draw(train_data, gen, batch, context), rank)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            sum_gradients(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            seen = loss.detach().clone()
            dist.all_reduce(seen)
            step += 1
            if step % EVAL_EVERY == 0 or step == total:
                model.eval()
                with torch.no_grad():
                    held_loss = ring_loss(model, held, rank)
                dist.all_reduce(held_loss)
                model.train()
                if rank == 0:
                    log.put(
                        (step, context, float(seen), float(held_loss), time.monotonic() - start)
                    )
            elif step % LOG_EVERY == 0 and rank == 0:
                log.put((step, context, float(seen), None, time.monotonic() - start))
    log.put(("cpu", rank, time.process_time()))
    if rank == 0:
        model.half().save_pretrained(Path(out) / "model", safe_serialization=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_training(out: Path, phases, lr, train_data, held_data) -> tuple[list, float, float]:
    """(loss log, wall seconds, CPU seconds of both ranks) of one training run."""
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    args = (free_port(), str(out), phases, lr, train_data, held_data, log)
    procs = [ctx.Process(target=train_rank, args=(r, *args)) for r in range(WORLD)]
    start = time.monotonic()
    for p in procs:
        p.start()
    history, cpu = [], 0.0
    while any(p.is_alive() for p in procs) or not log.empty():
        try:
            entry = log.get(timeout=1.0)
        except Exception:  # queue.Empty: nothing logged this second
            continue
        if entry[0] == "cpu":
            cpu += entry[2]
            continue
        history.append(entry)
        step, context, loss, held, secs = entry
        held_text = f"  held-out {held:.4f}" if held is not None else ""
        print(
            f"step {step:5d} ctx {context:5d}  loss {loss:.4f}{held_text}  {secs:7.1f} s",
            flush=True,
        )
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"a training rank exited {p.exitcode}")
    return history, time.monotonic() - start, cpu


# --- after training -------------------------------------------------------------------------


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


def evaluate(out: Path, held: list, train_data: torch.Tensor) -> dict:
    """Held-out losses of the saved float16 weights loaded in float32 (what a job loads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        out / "model", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    within, total, count = 0.0, 0.0, 0
    for _, text in held:
        ids = as_bytes([("", text)])
        for s in range(0, ids.numel() - 1, CONTEXT):
            nll = loss_of(model, ids[s : s + CONTEXT + 1])
            total, count = total + float(nll.sum()), count + nll.numel()
    within = total / count
    held_data = as_bytes(held)
    return {
        "held_out_bytes": held_data.numel(),
        "held_out_loss_nats_per_byte": within,
        "held_out_bits_per_byte": within / math.log(2),
        "held_out_scored_in": f"consecutive windows of at most {CONTEXT + 1} bytes",
        "bigram_loss_nats_per_byte": bigram_loss(train_data, held_data),
    }


def write_heldout(out: Path, held: list) -> None:
    folder = out / "heldout"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in held:
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="a few steps: proves the script runs")
    ap.add_argument("--phases", help="CONTEXTxBATCHxSTEPS,... instead of the shipped schedule")
    ap.add_argument("--lr", type=float, default=LR, help=f"peak learning rate (shipped: {LR})")
    args = ap.parse_args(argv)
    train, held = split(handbook_sections())
    train_j, held_j = split(jargon_sections())
    train, held = train + train_j, held + held_j
    train_data, held_data = as_bytes(train), as_bytes(held)
    phases = QUICK_PHASES if args.quick else PHASES
    if args.phases:
        phases = tuple(tuple(int(v) for v in p.split("x")) for p in args.phases.split(","))
    sizes = f"{len(train)} sections ({train_data.numel()} bytes) for training, {len(held)} "
    print(f"{', '.join(PACKAGES)}: {sizes}held out ({held_data.numel()} bytes)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    history, seconds, cpu = run_training(args.out, phases, args.lr, train_data, held_data)
    write_heldout(args.out, held)
    result = evaluate(args.out, held, train_data)
    training = {
        "seed": SEED,
        "ranks": WORLD,
        "layout": "zigzag",
        "phases": phases,
        "lr": args.lr,
        "min_lr_fraction": MIN_LR_FRACTION,
        "warmup": WARMUP,
        "weight_decay": WEIGHT_DECAY,
        "clip": CLIP,
        "wall_seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "torch": torch.__version__,
    }
    data = {
        "packages": PACKAGES,
        "files": [str(HANDBOOK), str(JARGON)],
        "train_sections": len(train),
        "train_bytes": train_data.numel(),
        "held_out": [name for name, _ in held],
    }
    record = {"data": data, "config": CONFIG, "training": training, "result": result}
    record["history"] = history
    (args.out / "train.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
