"""The training task: packed sequences through the ring, checkpoints that survive preemption,
losses that do not depend on the cluster's shape (``ringctl.train``).

Its parameters are ``ringctl.train.params.TrainParams`` (the ``task:`` section; that module
lists every key). The inputs, model and tokenizer are checked at submit as the long-document
job's are (``CorpusTask``); beside them: a ``seq_len`` no ring holds under
``ring.max_tokens_per_rank``, ``batch_sequences`` that the rings cannot share evenly, and a
``model.shard`` other than none or job, each refused naming its key.

Its gather step (``ringctl.train.export``) writes ``OUT/metrics.jsonl``, ``OUT/loss.png`` and
``OUT/model/`` (a transformers directory consolidated from the last checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import job_layout
from ..errors import StoppedOnRequest
from ..train.params import TrainParams
from .base import Gatherer, world_size
from .longdoc import CorpusTask

SHARD_MODES = ("none", "job")


@dataclass
class TrainModelSection:
    """``model:`` of a training job: how the weights, gradients and optimizer state are held."""

    shard: str = "none"  # none: every rank holds them whole | job: FSDP2 over all ranks


class TrainGatherer(Gatherer):
    """`ringctl gather` of a training job: ringctl.train.export, imported when used."""

    @staticmethod
    def _module():
        from ..train import export

        return export

    def gather(self, job_dir, out, **options):
        return self._module().gather(job_dir, out, **options)

    def recognises(self, path) -> bool:
        return self._module().recognises(path)

    def replaces_partial(self, job_dir, out) -> bool:
        return self._module().replaces_partial(job_dir, out)

    def show(self, result, console) -> None:
        self._module().show(result, console)


class TrainTask(CorpusTask):
    """Train a causal LM on packed sequences through the ring."""

    name = "train"
    params = TrainParams
    start_imports = (*CorpusTask.start_imports, "ringctl.train.run")
    sections = {"model": TrainModelSection}
    # FSDP2 or whole weights: the same losses (a checkpoint loads either way, README); one
    # that ran out of memory resumes sharded (it was refused as changing the results)
    resume_keys = ("model.shard",)

    def check(self, cfg, bad) -> None:
        super().check(cfg, bad)
        self.check_shape(cfg, bad)

    @staticmethod
    def check_shape(cfg, bad) -> None:
        """The rings can share each step's sequences, and a ring holds a sequence."""
        from ringattn.geometry import ring_capacity, ring_holds

        world = world_size(cfg)
        size = cfg.ring.size
        if size in (None, "null"):
            size = world
        if str(size) == "auto" or not isinstance(size, int) or size < 1 or world % size:
            raise bad(
                "ring.size",
                f"a training job takes null or a divisor of its {world} ranks, not {size!r}",
                *("nodes", "tasks_per_node"),
            )
        rings, batch = world // size, int(cfg.task.batch_sequences)
        if batch % rings:
            raise bad(
                "task.batch_sequences",
                f"{batch} sequences per step cannot be shared "
                f"evenly by {rings} rings of {size} ranks",
                *("ring.size", "nodes", "tasks_per_node"),
            )
        shard = str(cfg.model.shard)
        if shard not in SHARD_MODES:
            raise bad("model.shard", f"expected one of {', '.join(SHARD_MODES)}, got {shard!r}")
        budget = cfg.ring.get("max_tokens_per_rank")
        layout = job_layout(cfg)
        seq_len = int(cfg.task.seq_len)
        if budget and not ring_holds(seq_len, size, int(budget), layout):
            raise bad(
                "task.seq_len",
                f"{seq_len:,} tokens do not fit a ring of {size} ranks "
                f"at ring.max_tokens_per_rank={int(budget):,} (it holds "
                f"{ring_capacity(size, int(budget), layout):,})",
                *("ring.max_tokens_per_rank", "ring.size", "nodes", "tasks_per_node"),
            )

    def workload(self, cfg):
        """What the planner prices: a training step of one sequence of ``seq_len`` on a ring,
        with the optimizer's state (``ringctl plan jobs/train.yaml``)."""
        from ..planner.cost import Workload

        m = self.job_model_shape(cfg)
        return Workload(
            seq_len=int(cfg.task.seq_len),
            heads=m.heads,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            model=m,
            dtype=str(cfg.task.dtype),
            mode="train",
            backward=True,
            layout=job_layout(cfg),
            lm_head_chunk=int(cfg.task.chunk_size),
            optimizer="adam",
            autocast=True,  # bfloat16 runs autocast over float32 weights (train.step)
            shard="full" if str(cfg.model.shard) == "job" else "none",
            shard_degree=world_size(cfg) if str(cfg.model.shard) == "job" else None,
            checkpoint="full" if bool(cfg.task.activation_checkpointing) else "none",
        )

    def run(self, cfg, ctx) -> dict:
        from ..train.run import TrainOptions, run_training

        size = cfg.ring.size if isinstance(cfg.ring.size, int) else None
        opts = TrainOptions(
            rank=ctx.rank,
            world_size=ctx.world_size,
            job_dir=ctx.job_dir,
            log=ctx.log,
            progress=ctx.progress,
            should_stop=ctx.stop_requested,
            device=ctx.device,
            ring_size=size,
            shard=str(cfg.model.shard),
            timeout=ctx.timeout,
        )
        summary = run_training(self.params_of(cfg), opts)
        if summary.stopped:  # a preemption signal: not done, and must not look done
            raise StoppedOnRequest(
                f"stopped on request at step {summary.step} of {cfg.task.max_steps} "
                f"(checkpoint {summary.checkpoint}); `ringctl resume` continues"
            )
        loss = f"loss {summary.loss}" if summary.loss is not None else "nothing left to train"
        ctx.log(f"train: {summary.steps} steps this attempt, at step {summary.step}, {loss}")
        return {"steps": summary.steps, "step": summary.step, "loss": summary.loss}

    def resume_problem(self, cfg, job_dir) -> str | None:
        """Input documents other than those the latest checkpoint trained on: every rank
        loaded the model, then refused, and the job read FAILED (training review). Checked
        where this machine sees the inputs (not over ssh), by the ranks' own rule."""
        from ..backends import files_here
        from ..jobdir import JobDir
        from ..longdoc.inputs.documents import listing_signature
        from ..train.checkpoint import CheckpointDir
        from ..train.run import changed_run

        if not files_here(cfg):
            return None
        try:
            found = CheckpointDir(JobDir(job_dir).checkpoints).latest()
        except ValueError:  # the ranks refuse it by name
            return None
        had = found.state.get("run", {}) if found is not None else {}
        if "documents" not in had:  # no checkpoint yet (or one before documents were kept)
            return None
        documents, refused = self.listed_documents(cfg)
        if documents is None:
            return refused
        now = listing_signature(documents)
        if now == had["documents"]:
            return None
        params = self.params_of(cfg)
        return changed_run(found, "documents", had | {"documents": now}, had, params)

    def gatherer(self) -> Gatherer:
        return TrainGatherer()
