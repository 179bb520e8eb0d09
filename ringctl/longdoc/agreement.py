"""Model agreement: every rank of a ring loads the same tokenizer and model, or all refuse.

What a job over documents does before it computes anything (the long-document job per ring,
the training job once): on each rank, the config is read and checked (``model/compat.py``:
families ring attention cannot run exactly are refused by name before they are built), the
tokenizer and the model are loaded (whole or as an FSDP2 shard: ``model/load.py`` says how),
and the rank says why they cannot serve (a vocabulary that does not match, a refused model,
a weight that is not finite); every rank raises if any rank found a problem
(``consensus.agree``). Then the ranks must hold the same weights, and the probe must
reproduce the model's own forward pass on the ring (``probe.py``).

At the top of the package, beside the probe and the consensus it runs: it uses the model wing,
and the wings never import the top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .consensus import agree
from .model.compat import config_refusal, model_refusal, read_model_config
from .model.load import check_same_weights, weights_fingerprint
from .model.overrides import describe as describe_overrides
from .model.tokenize import load_tokenizer, vocabulary_mismatch
from .probe import run_probe


@dataclass
class Agreed:
    tokenizer: Any
    model: Any
    probe: str  # what the probe measured (the lead rank's line)


def non_finite_weights(model, model_path: str | None) -> str:
    """Empty when every weight this rank holds is finite, else one line naming the first
    parameter that is not. Checked before the ranks compare their weights: a NaN fingerprint
    equals no other (the ranks would be said to "hold different model weights") and an inf
    one equals every other (it would pass), when the cause is the checkpoint."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            bad = int((~torch.isfinite(local)).sum())
            if bad:
                where = model_path or "the random model"
                return (
                    f"non-finite weights: {name} holds {bad} value(s) that are NaN or inf "
                    f"({where}: a corrupt or badly converted checkpoint); nothing was computed"
                )
    return ""


def try_load(params, load: Callable[[], Any]) -> tuple[Any, Any, str]:
    """(tokenizer, model, why they cannot serve or "") on this rank; ``load()`` builds the
    model (whole or sharded)."""
    tokenizer = model = None
    try:
        config = read_model_config(params.model_path, params.model_overrides)  # checked
        refused = config_refusal(config)  # before building: some refused families cannot be
        if refused:  # built with ringattn at all (a KeyError or AttributeError otherwise)
            raise ValueError(refused)
        tokenizer = load_tokenizer(params.tokenizer_path)
        model = load()
        vocab = int(model.config.get_text_config().vocab_size)
        is_bytes = params.tokenizer_path is None
        error = vocabulary_mismatch(tokenizer.vocab_size, vocab, is_bytes=is_bytes)
        error = error or model_refusal(model) or non_finite_weights(model, params.model_path)
        return tokenizer, model, error
    except ValueError as err:
        return tokenizer, model, str(err)
    except (OSError, KeyError, AttributeError, TypeError) as err:
        why = f"the model could not be loaded for ring attention: {type(err).__name__}: {err}"
        return tokenizer, model, why


def fingerprint_of(model) -> torch.Tensor:
    """The weights' fingerprint, equal on ranks that hold equal weights: a model sharded by
    FSDP2 (DTensor parameters) from its shards, over its shard group; a whole one from its
    tensors. Chosen from the model itself, so no caller can pass the whole model's to a
    sharded one (the training job did: `model.shard=job` failed in its first check)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from .compute.fsdp import weights_fingerprint as sharded

        return sharded(model).to(next(model.parameters()).device)
    return weights_fingerprint(model)


def load_agreed(params, load: Callable[[], Any], *, group, lead: bool, log):
    """Every rank of ``group``: the checked tokenizer and model, the same weights on every
    rank, and the probe passed; else every rank raises alike (see the module docstring)."""
    tokenizer, model, error = try_load(params, load)
    agree(error, group)
    check_same_weights(model, group, fingerprint=fingerprint_of)
    probe = run_probe(
        model,
        group=group,
        layout=params.layout,
        dtype_name=params.dtype,
        chunk_size=int(params.chunk_size),
    )
    if lead:  # which ids the job's numbers are of: a model directory's tokenizer, or bytes
        log(f"tokenizer: {params.tokenizer_path or 'UTF-8 bytes (256 ids)'}")
    if lead and params.model_overrides:
        log(describe_overrides(params.model_overrides))
    if lead and probe.message:
        log(probe.message)
    agree(probe.error if lead else "", group)
    return Agreed(tokenizer, model, probe.message)
