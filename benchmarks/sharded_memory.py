"""Memory per rank with the weights sharded (``model.shard=ring``) against every rank whole.

    python -m benchmarks.sharded_memory --ranks 1,2 --tiny        # seconds: proves it runs
    python -m benchmarks.sharded_memory --ranks 1,2,4 --layers 8 --hidden 1024 \\
        --intermediate 2816 --vocab 32000 --tokens 1024           # the figures (~3 minutes)

A random Llama of the given size is saved once as a Hugging Face directory in several
safetensors shards (``save_pretrained(max_shard_size=...)``). For each P, P real gloo processes
(one run per P and mode, so that one mode's peak RSS cannot hide in the other's) load it:
``none`` with ``from_pretrained`` (every rank whole), ``ring`` with ``load_sharded_model`` (each
rank reads its rows only), then score one document of ``--tokens`` tokens. Per rank (the
largest over ranks is shown):

* weights held at rest (bytes of the local shards), and what 1/P of the model would be;
* peak gathered weights: the most unsharded weight bytes registered when the token embedding,
  any decoder layer or the output head runs (one of them at a time, for an untied model);
* weights peak: held + peak gathered (for ``none``: the whole model), the bound on weight
  memory per rank that sharding is meant to cut to ~1/P (plus one layer, norm and head);
* RSS: growth during loading, and peak (VmHWM) over the process's RSS before loading (the
  imports of torch and transformers are not counted). Read these with care on CPU:
  ``from_pretrained`` maps the safetensors files, so a ``none`` rank's weights count only once
  touched, and a sharded rank's peak also holds the transient buffers of a gather (FSDP
  gathers into a flat buffer and copies out: about twice the group); ``MALLOC_MMAP_THRESHOLD_``
  is fixed at 1 MiB in the ranks so that glibc returns freed buffers. The weight figures above
  are exact.

Prints a table; writes JSON (default benchmarks/results/sharded-memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results/sharded-memory.json")
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Make VmHWM start from the current RSS (Linux: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _import_everything() -> None:
    import safetensors.torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from ringattn.hf import register

    register()


def _one_rank(rank: int, world: int, path: str, mode: str, tokens: int) -> dict:
    import torch

    from ringctl.longdoc.compute import fsdp as sharding
    from ringctl.longdoc.model.load import load_model

    torch.set_num_threads(1)
    _import_everything()  # so that the baseline RSS holds the code, and the deltas the weights

    _reset_peak_rss()
    base_kib = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if mode == "none":
        model = load_model(path)
    else:
        model = sharding.load_sharded_model(path, mode=mode, mesh_or_group=None)
    load_s = time.perf_counter() - t0
    loaded_kib = _status_kib("VmRSS")
    peak_gathered = [0]

    def watch(*_):
        peak_gathered[0] = max(peak_gathered[0], sharding.gathered_parameter_bytes(model))

    watched = [*model.model.layers, model.get_input_embeddings(), model.get_output_embeddings()]
    for module in watched:  # each runs with its group gathered
        module.register_forward_pre_hook(watch)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator())
    t0 = time.perf_counter()
    sharding.run_task_sharded("score", model, ids, group=None, layout="zigzag", chunk_size=256)
    return {
        "rank": rank,
        "held_bytes": sharding.local_parameter_bytes(model),
        "peak_gathered_bytes": peak_gathered[0],
        "weights_peak_bytes": sharding.local_parameter_bytes(model)
        if mode == "none"
        else sharding.local_parameter_bytes(model) + peak_gathered[0],
        "load_rss_mib": (loaded_kib - base_kib) / 1024,
        "peak_rss_mib": (_status_kib("VmHWM") - base_kib) / 1024,
        "load_s": load_s,
        "score_s": time.perf_counter() - t0,
    }


def _rank_entry(rank: int, world: int, store: str, args: tuple) -> None:
    """One spawned rank: join the gloo group, measure, leave the figures in ``store``."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        figures = {"ok": _one_rank(rank, world, *args)}
    except Exception as err:  # reported by the parent, with the rank
        figures = {"error": f"{type(err).__name__}: {err}"}
    finally:
        dist.destroy_process_group()
    Path(store, f"rank-{rank}.json").write_text(json.dumps(figures))
    # The figures are on disk: skip interpreter teardown, where gloo's threads can abort a
    # finished process (SIGABRT, as tests/distributed.py notes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world: int, *args) -> list[dict]:
    import torch.multiprocessing as mp

    # glibc raises its mmap threshold to the size of each large block freed, so freed gather
    # buffers would stay in the heap and in RSS; a fixed threshold returns them to the system.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as store:
        mp.start_processes(
            _rank_entry, args=(world, store, args), nprocs=world, join=True, start_method="spawn"
        )
        every = [json.loads(Path(store, f"rank-{r}.json").read_text()) for r in range(world)]
    for rank, figures in enumerate(every):
        if "error" in figures:
            raise RuntimeError(f"rank {rank} of {world} failed: {figures['error']}")
    return [figures["ok"] for figures in every]


def _save_model(args, root: Path) -> tuple[str, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.tokens),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_kib = max(64, total // 5 // 1024)  # about five files
    model.save_pretrained(str(root), max_shard_size=f"{shard_kib}KB")
    return str(root), total


def _measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path, total = _save_model(args, Path(tmp))
        files = len(list(Path(path).glob("*.safetensors")))
        for p in args.ranks:
            for mode in ("none", "ring"):
                per_rank = _spawn(p, path, mode, args.tokens)
                worst = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "rank"}
                rows.append(
                    {
                        "ranks": p,
                        "shard": mode,
                        "expected_held_bytes": total / p if mode == "ring" else total,
                        **worst,
                    }
                )
    return {"model_bytes": total, "checkpoint_files": files, "args": vars(args), "rows": rows}


def _table(result: dict) -> str:
    head = (
        "P",
        "shard",
        "held MiB",
        "1/P MiB",
        "peak gathered",
        "weights peak",
        "RSS load",
        "RSS peak",
        "load s",
        "score s",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        lines.append(
            " | ".join(
                [
                    str(r["ranks"]),
                    r["shard"],
                    f"{r['held_bytes'] / MIB:.1f}",
                    f"{r['expected_held_bytes'] / MIB:.1f}",
                    f"{r['peak_gathered_bytes'] / MIB:.1f}",
                    f"{r['weights_peak_bytes'] / MIB:.1f}",
                    f"{r['load_rss_mib']:.1f}",
                    f"{r['peak_rss_mib']:.1f}",
                    f"{r['load_s']:.2f}",
                    f"{r['score_s']:.2f}",
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sharded_memory", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--ranks", default="1,2,4", help="comma-separated P values")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--tiny", action="store_true", help="a 2-layer hidden-64 model (smoke run)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    try:
        args.ranks = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1:
        p.error("--ranks: every P must be >= 1")
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 64, 128, 256
        args.heads, args.kv_heads, args.tokens = 4, 2, 64
    result = _measure(args)
    table = _table(result)
    print(
        f"model: {result['model_bytes'] / MIB:.1f} MiB in {result['checkpoint_files']} "
        "safetensors files; largest value over the ranks of each run"
    )
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
