"""What the long-document job computes on a ring: one document's score, embedding or
gradients (``scoring``), short documents packed into one sequence (``packing``), and weights held as
FSDP2 shards (``fsdp``)."""
