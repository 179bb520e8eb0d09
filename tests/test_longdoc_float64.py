"""A float64 long-document job is float64 to the end: its loss and gradients against the
unsharded model's in float64 (SDPA on the CPU computes float64), on a ring of 2."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed
from tests.longdoc_reference import MODEL_CONFIGS, SEED, document


def _float64_grad(rank: int, world: int) -> dict:
    from transformers import AutoConfig

    from ringattn.hf import register
    from ringctl.longdoc.compute.scoring import run_task
    from ringctl.longdoc.model.load import build_random

    register()
    models = {  # a config each: building sets its attention implementation
        name: build_random(
            AutoConfig.for_model(**MODEL_CONFIGS["llama"]),
            seed=SEED,
            dtype=torch.float64,
            attn_implementation=name,
        )
        for name in ("ringattn", "sdpa")
    }
    ids = document(300)
    got = run_task("grad", models["ringattn"], ids, group=None, layout="zigzag", keep_grads=True)
    ref = models["sdpa"]
    logits = ref(input_ids=ids[None], use_cache=False).logits[0]
    loss = -logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0].mean()
    loss.backward()
    grads = {
        name: ((got.grads[name] - p.grad).norm() / p.grad.norm()).item()
        for name, p in ref.named_parameters()
        if p.grad.norm() > 0
    }
    return {
        "dtype": str(logits.dtype),
        "loss": abs(got.stats["loss"] - loss.item()) / loss.item(),
        "grads": max(grads.values()),
    }


def test_a_float64_grad_job_s_loss_and_gradients_are_float64_s():
    """(embed/grad review) The scorer cast the logits to float32 whatever the model's dtype:
    a float64 job's loss was 1.1e-8 off and its gradients 4.9e-7 (relative), float32's
    precision with exit 0. Within 1e-10 now (measured: 0 and 1.2e-14 on the bundled model)."""
    for result in run_distributed(_float64_grad, 2):
        assert result["dtype"] == "torch.float64"
        assert result["loss"] < 1e-12 and result["grads"] < 1e-10, result


def test_the_float64_probe_s_noise_is_the_kept_log_probabilities_rounding_not_eager_s():
    """(embed/grad review) The probe's noise is the model's own sdpa against eager: in
    float64 that measured eager's float32 softmax (transformers runs it so whatever the
    dtype), and a float64 job's tolerance was 4 x 9.5e-6, letting a ring fault of 3e-5
    through. float64's noise is float32's rounding of the log-probabilities the outputs
    keep; the reference's log-probabilities are float64."""
    from transformers import AutoConfig

    from ringattn.hf import register
    from ringctl.longdoc import probe
    from ringctl.longdoc.model.load import build_random

    register()
    config = AutoConfig.for_model(**MODEL_CONFIGS["llama"])
    model = build_random(config, seed=SEED, dtype=torch.float64, attn_implementation="ringattn")
    ids = document(300)
    want, noise = probe._reference(model, ids, "float64")
    assert want.dtype == torch.float64
    assert noise == probe.STORED_EPS * float(want.abs().max())
    eager = probe.stock_logprobs(model, ids, "eager")
    assert noise != probe._metric("float64", eager, want)  # not eager's float32 softmax


def test_the_planner_prices_the_logits_in_the_dtype_the_scorer_computes_them():
    """(second reading) With float64 logits kept, the planner still priced a float64 grad
    job's logits and their gradients in float32 (24 bytes a token and vocabulary entry
    where they hold 32). Its dtype is the scorer's, dtype by dtype."""
    from transformers import AutoConfig

    from ringctl.longdoc.compute.scoring import output_head
    from ringctl.longdoc.model.load import build_random
    from ringctl.planner.memory import logits_dtype

    for name in ("float32", "float64", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        config = AutoConfig.for_model(**MODEL_CONFIGS["llama"])
        model = build_random(config, seed=SEED, dtype=dtype, attn_implementation="sdpa")
        hidden = torch.zeros(3, config.hidden_size, dtype=dtype)
        assert output_head(model)(hidden).dtype == getattr(torch, logits_dtype(name)), name
