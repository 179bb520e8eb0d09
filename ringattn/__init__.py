"""ringattn: exact attention over a sequence sharded across a ring of ranks.

from ringattn import ring_attention, shard_sequence, sequence_positions
"""

from .kernels import BlockKernel, ChunkedKernel, TorchCPUKernel, select_kernel
from .layouts import (
    LAYOUTS,
    padded_length,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from .ring import block_plan, ring_attention

__all__ = [
    "LAYOUTS",
    "BlockKernel",
    "ChunkedKernel",
    "TorchCPUKernel",
    "block_plan",
    "padded_length",
    "ring_attention",
    "select_kernel",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
