"""ringattn: exact attention over a sequence sharded across a ring of ranks.

from ringattn import ring_attention, shard_sequence, sequence_positions
from ringattn import hybrid_attention, hybrid_groups   # Ulysses x ring (ringattn.hybrid)
from ringattn import LocalRing    # P virtual ranks in one process: ring_attention(..., comm=...)
from ringattn import pack_sequence, document_positions  # packed documents (cu_seqlens)

The package face is lazy: a name is imported from its module when first used, so
``import ringattn.geometry`` (where every token lives, which blocks each step computes: no
torch) does not load torch. The planner imports only that.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "RingComm": "comm",
    "HybridGroups": "hybrid",
    "hybrid_attention": "hybrid",
    "hybrid_groups": "hybrid",
    "hybrid_rank": "hybrid",
    "BlockKernel": "kernels",
    "ChunkedKernel": "kernels",
    "TorchCPUKernel": "kernels",
    "TorchCUDAKernel": "kernels",
    "select_kernel": "kernels",
    "HYBRID_LAYOUTS": "geometry",
    "LAYOUTS": "geometry",
    "SequenceLayout": "geometry",
    "block_plan": "geometry",
    "padded_length": "geometry",
    "document_positions": "layouts",
    "pack_sequence": "layouts",
    "sequence_positions": "layouts",
    "shard_sequence": "layouts",
    "unshard_sequence": "layouts",
    "LocalRing": "local_ring",
    "ring_attention": "ring",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
