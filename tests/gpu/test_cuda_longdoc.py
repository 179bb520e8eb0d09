"""The long-document path on one GPU in bf16: a P = 1 NCCL ring scores what one process does.

Model: the tiny random Llama of the long-document tests (tests/longdoc_reference.py). The
float32 stock model (sdpa attention) on the GPU is the reference; the bf16 stock model on the
same GPU sets the tolerance: the ring in bf16 must be within twice its error plus one bf16
ulp (2**-8) on the token log-probabilities, the same rule as for the attention itself
(tests/attention_reference.py, `within_sdpa`).
"""

from __future__ import annotations

import torch

from tests.attention_reference import within_sdpa
from tests.distributed import run_distributed
from tests.longdoc_reference import build, document, reference, rel_err

N = 3001  # not a multiple of 128, nor of 2P


def _score_on_cuda(rank: int, world: int) -> torch.Tensor:
    from ringctl.longdoc.compute.scoring import run_task

    model = build("llama", "ringattn").to("cuda", torch.bfloat16)
    r = run_task("score", model, document(N), group=None, layout="zigzag", chunk_size=512)
    full = torch.full((N,), float("nan"))
    full[r.tensors["positions"]] = r.tensors["token_logprob"].float()
    return full


def test_longdoc_score_bf16_on_cuda_matches_stock_model():
    (ring,) = run_distributed(_score_on_cuda, 1, backend="nccl")
    ids = document(N).cuda()
    ref = reference(build("llama", "sdpa").cuda(), ids)["token_logprob"].cpu()
    stock_bf16 = reference(build("llama", "sdpa").to("cuda", torch.bfloat16), ids)
    tol = within_sdpa(rel_err(stock_bf16["token_logprob"].cpu(), ref))
    assert ring[-1].isnan()
    assert rel_err(ring[:-1], ref) <= tol
