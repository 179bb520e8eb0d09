"""What the long-document job computes on a ring: one document's score, embedding or
gradients (``scoring``), short documents packed into one sequence (``packing``), and weights held as
FSDP2 shards (``fsdp``).

``MODES`` names the three (``task.mode``, and ``task`` in run.json and each manifest entry):
spelled here once, torch-free, for the parameters, the scorer and the manifest readers."""

MODES = ("score", "embed", "grad")
