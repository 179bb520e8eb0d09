"""What the long-document job computes on a ring: one document's score, embedding or
gradients (``scoring``), short documents in one forward (``batching``), and weights held as
FSDP2 shards (``fsdp``)."""
