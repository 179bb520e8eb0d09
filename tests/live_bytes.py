"""Bytes of tensor storage a block of code allocates and holds at its peak (test helper).

A dispatch mode sees every tensor an aten op returns: a storage none of the op's inputs had is
new (views and in-place results share their input's), counted until the storage is freed
(``weakref.finalize``). Memory that torch allocates inside a kernel and frees before it
returns, and storage made outside aten (a transport's shared-memory slots) are not seen:
this measures what the engine's own tensors hold, which is what the planner prices.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._held.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in given or key in self._held or nbytes == 0:
                continue
            self._held.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out
