"""ringattn: exact attention over a sequence sharded across a ring of ranks.

from ringattn import ring_attention, shard_sequence, sequence_positions
from ringattn import hybrid_attention, hybrid_groups   # Ulysses x ring (ringattn.hybrid)
from ringattn import LocalRing    # P virtual ranks in one process: ring_attention(..., comm=...)
"""

from .comm import RingComm
from .hybrid import HybridGroups, hybrid_attention, hybrid_groups, hybrid_rank
from .kernels import BlockKernel, ChunkedKernel, TorchCPUKernel, TorchCUDAKernel, select_kernel
from .layouts import (
    HYBRID_LAYOUTS,
    LAYOUTS,
    padded_length,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from .local_ring import LocalRing
from .ring import block_plan, ring_attention

__all__ = [
    "HYBRID_LAYOUTS",
    "HybridGroups",
    "LAYOUTS",
    "LocalRing",
    "RingComm",
    "BlockKernel",
    "ChunkedKernel",
    "TorchCPUKernel",
    "TorchCUDAKernel",
    "block_plan",
    "hybrid_attention",
    "hybrid_groups",
    "hybrid_rank",
    "padded_length",
    "ring_attention",
    "select_kernel",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
