"""Run a function on P real processes joined by a gloo (or NCCL) process group (test helper).

The function must live at module level (spawned processes import it). Each process gets
(rank, world_size, *args); whatever it returns is pickled back to the caller, in rank order.
An exception in any rank is re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks fork from one server that has imported torch and transformers once, instead of each
# importing them anew (2-5 s of CPU a rank on this 2-core machine, hundreds of ranks a suite).
# The server imports nothing else and runs no Python thread (its native threads are numpy's
# and scipy's OpenBLAS servers, idle, which OpenBLAS stops around a fork), so a fork of it
# is a fresh process but for those modules; each rank takes the caller's environment as it
# is at the call.
mp.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "transformers",
        "transformers.modeling_utils",
        "safetensors.torch",
    ]
)


def _entry(
    rank: int,
    world_size: int,
    store_dir: str,
    fn: Callable,
    args: tuple,
    backend: str,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    result_path = os.path.join(store_dir, f"result-{rank}.pkl")
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store_dir}/store",
            rank=rank,
            world_size=world_size,
            # a test of what outlasts the group's timeout sets a short one
            timeout=timedelta(seconds=float(os.environ.get("RINGCTL_TEST_GROUP_TIMEOUT", 60))),
        )
        value = ("ok", fn(rank, world_size, *args))
    except BaseException as err:  # report every failure to the parent, typed
        value = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(result_path, "wb") as f:
        pickle.dump(value, f)
    # The result is on disk: skip interpreter teardown, where threads of the communication
    # library have been seen to abort an otherwise finished process (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, backend: str = "gloo", transport: str | None = None
) -> list[Any]:
    """``transport``: the ranks' RINGATTN_TRANSPORT (``shm``: the ring through shared memory,
    required; ``gloo``: gloo's point-to-point; None: the engine's default, auto)."""
    saved = os.environ.get("RINGATTN_TRANSPORT")
    if transport is not None:
        os.environ["RINGATTN_TRANSPORT"] = transport  # the spawned ranks inherit it
    try:
        return _run(fn, world_size, args, backend)
    finally:
        if saved is None:
            os.environ.pop("RINGATTN_TRANSPORT", None)
        else:
            os.environ["RINGATTN_TRANSPORT"] = saved


def _run(fn: Callable, world_size: int, args: tuple, backend: str) -> list[Any]:
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(
            _entry,
            args=(world_size, store_dir, fn, args, backend, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(store_dir, f"result-{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed: {value}")
            results.append(value)
        return results
