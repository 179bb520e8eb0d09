"""The parameters of a training job: its ``task:`` section (``task.name: train``).

The inputs, model, tokenizer, layout and output-head chunk are the long-document job's
(``longdoc.params.CorpusParams``: the same readers, refusals and probe); the rest is training:

    task:
      name: train
      inputs: null             # as the long-document job's; null = the bundled samples
      model_path: null         # as the long-document job's; null = a tiny random Llama
      dtype: float32           # float32 | bfloat16 (bfloat16 compute over float32 weights
                               # and optimizer state)
      seq_len: 4096            # tokens per packed sequence
      batch_sequences: 4       # sequences per optimizer step, in the whole job
      max_steps: 100
      lr: 3.0e-4               # the peak learning rate
      min_lr_ratio: 0.1        # the cosine ends at lr x this
      warmup_steps: 10
      weight_decay: 0.1        # on matrices only
      clip: 1.0                # max gradient norm; 0 = no clipping
      seed: 0                  # the data order; a random model's weights are seeded by
                               # _ringctl_seed in its JSON config, not by this
      activation_checkpointing: false
      checkpoint_every: 50     # steps; also at the end and on Slurm's warning signal
      keep_checkpoints: 2      # the newest K stay
      chunk_size: 1024         # rows per output-head chunk in the loss

Importing it imports neither torch nor transformers: ``ringctl submit`` validates with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..longdoc.params import CorpusParams
from ..task_params import MAX_COUNT, MAX_SEED, MAX_SIZE, int_problem

TRAIN_DTYPES = ("float32", "bfloat16")


@dataclass
class TrainParams(CorpusParams):
    name: str = "train"
    seq_len: int = 4096
    batch_sequences: int = 4
    max_steps: int = 100
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    activation_checkpointing: bool = False
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    chunk_size: int = 1024

    def choices(self) -> dict[str, tuple]:
        return {**super().choices(), "dtype": TRAIN_DTYPES}

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        counts = {  # key: (least, most): task_params' bounds
            "seq_len": (2, MAX_SIZE),
            "batch_sequences": (1, MAX_SIZE),
            "max_steps": (1, MAX_COUNT),
            "warmup_steps": (0, MAX_COUNT),
            "checkpoint_every": (1, MAX_COUNT),
            "keep_checkpoints": (1, MAX_COUNT),
            "seed": (0, MAX_SEED),
        }
        for key, (least, most) in counts.items():
            why = int_problem(getattr(self, key), least, most)
            if why:
                out.append((key, why))
        warmup, steps = self.warmup_steps, self.max_steps
        if not any(key in (k for k, _ in out) for key in ("warmup_steps", "max_steps")):
            if warmup > steps:  # the schedule never reached task.lr, the run ended well
                out.append(
                    (
                        "warmup_steps",
                        f"{warmup} is more than task.max_steps ({steps}): the learning rate "
                        "would never reach task.lr",
                    )
                )
        reals = {"lr": (0.0, False), "weight_decay": (0.0, True), "clip": (0.0, True)}
        for key, (least, inclusive) in reals.items():
            value = getattr(self, key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and (value >= least if inclusive else value > least)
            if not ok:
                word = ">=" if inclusive else ">"
                out.append((key, f"must be a finite number {word} {least}, not {value!r}"))
        ratio = self.min_lr_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            out.append(("min_lr_ratio", f"must be a number in [0, 1], not {ratio!r}"))
        if not isinstance(self.activation_checkpointing, bool):
            out.append(("activation_checkpointing", "must be true or false"))
        return out

    def run_signature(self) -> dict:
        """What a resumed run must keep to continue the same run (the checkpoint records it;
        the number of ranks and rings may change, these may not)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "model_overrides": self.model_overrides or {},
            "seq_len": self.seq_len,
            "batch_sequences": self.batch_sequences,
            "seed": self.seed,
            "dtype": self.dtype,
            # the optimizer's hyperparameters and the schedule's shape: a resume loads the
            # optimizer's own groups (lr, weight decay) from the checkpoint, so a changed value
            # here would be silently ignored; max_steps may grow (the cosine stretches)
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "warmup_steps": self.warmup_steps,
            "min_lr_ratio": self.min_lr_ratio,
            # the gradients' clipping: another value trains another run (run.ADDED_KEYS: a
            # checkpoint written before it was recorded resumes, with a notice)
            "clip": self.clip,
        }


def run_byte_tokens(run: dict) -> bool:
    """Whether a run (the signature its checkpoints recorded) trained on UTF-8 bytes as ids:
    its ``byte_tokens``, or, in a checkpoint written before that was recorded, whether it
    named no tokenizer (``tokenizer_path`` null or "bytes"): training read no model
    directory's tokenizer then. Resume and gather ask the same question here."""
    if isinstance(run.get("byte_tokens"), bool):
        return run["byte_tokens"]
    return run.get("tokenizer_path") in (None, "bytes")
