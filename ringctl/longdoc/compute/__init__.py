"""What the long-document job computes on a ring: one document's score, embedding or
gradients (``scoring``), short documents packed into one sequence (``packing``), and weights held as
FSDP2 shards (``fsdp``).

``MODES`` names the three (``task.mode``, and ``task`` in run.json and each manifest entry):
spelled here once, torch-free, for the parameters, the scorer and the manifest readers.
``SHARD_MODES`` names how the weights are held (``model.shard``: none, ring: FSDP2 over each
ring's ranks, job: over all ranks), read at load and by ``fsdp`` on the ranks."""

MODES = ("score", "embed", "grad")
SHARD_MODES = ("none", "ring", "job")
