"""The training job (``task.name: train``): packed sequences through the ring, checkpoints
that survive preemption, and losses that do not depend on the cluster's shape.

    data.py        documents -> packed sequences of seq_len tokens, a resumable cursor
    step.py        one optimizer step: each ring's sequences, the loss over the step's tokens
    optim.py       AdamW and the warm-up + cosine schedule
    checkpoint.py  checkpoints/ (DCP): save, latest, resume, keep the newest K
    metrics.py     logs/metrics.jsonl: one record per step

Importing the package imports nothing heavy; its modules import torch.
"""
