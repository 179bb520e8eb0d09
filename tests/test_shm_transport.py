"""The shared-memory transport (ringattn/shm.py) on its own: what it delivers, what it leaves.

The ring's exactness on it is tested with the ring (tests/test_ring.py, test_ring_window.py and
test_packed.py run their gloo processes on both transports). Here: every message arrives
intact in order over both streams and both directions while the messages grow (slot files
re-made larger), several calls in a row; nothing is left in /dev/shm afterwards; the default
picks shared memory for ranks on one host and gloo when told; a bad setting is one line.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.distributed import run_distributed


def _messages(rank: int, world: int, elsewhere: int | None = None) -> dict:
    """``elsewhere``: a rank that says it runs on another host (its pairs then use gloo)."""
    import torch.distributed as dist

    from ringattn import shm
    from ringattn.comm import RingComm
    from ringattn.shm import RingShm, ring_transport

    if rank == elsewhere:
        shm._host = lambda: ("another-host", "another-boot")

    ring = ring_transport(None)
    chosen = type(ring).__name__
    assert isinstance(ring, RingComm)
    got = []
    for size in (3, 3, 1000, 17, 250_000, 250_000, 5):  # grows twice, shrinks, grows again
        for shift, tag in ((1, 0), (-1, 1), (2, 0)):
            send = [
                torch.full((size,), rank * 1000 + size, dtype=torch.float32),
                torch.arange(size, dtype=torch.int64) + rank,
            ]
            recv = [torch.empty_like(t) for t in send]
            ring.exchange(send, recv, tag=tag, shift=shift).wait()
            source = (rank - shift) % world
            ok = bool((recv[0] == source * 1000 + size).all()) and torch.equal(
                recv[1], torch.arange(size, dtype=torch.int64) + source
            )
            got.append(ok)
    shared = None
    if isinstance(ring, RingShm):  # settle as a ring call does, then compare notes
        ring.drive([])
        shared = ring.shared
    dist.barrier()
    return {"chosen": chosen, "all_ok": all(got), "shared": shared, "pid": os.getpid()}


def _files_made_by(pids: set[int]) -> list[str]:
    """Slot files whose sender (the pid in the name) is one of ``pids``: only this test's own,
    since other pytest workers run shared-memory rings at the same time."""
    from ringattn import shm

    senders = {path: shm.slot_sender(path) for path in glob.glob(f"/dev/shm/{shm.PREFIX}-*")}
    return [path for path, sender in senders.items() if sender and sender[0] in pids]


@pytest.mark.parametrize("transport", ["auto", "shm", "gloo"])
def test_messages_arrive_intact_and_nothing_is_left(transport):
    per_rank = run_distributed(_messages, 3, transport=transport)
    want = "RingComm" if transport == "gloo" else "RingShm"
    assert all(r["chosen"] == want and r["all_ok"] for r in per_rank), per_rank
    assert _files_made_by({r["pid"] for r in per_rank}) == []


def test_a_bad_setting_is_one_line(monkeypatch):
    from ringattn.shm import ring_transport

    monkeypatch.setenv("RINGATTN_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="RINGATTN_TRANSPORT='carrier-pigeon'"):
        ring_transport(None)


def test_orphaned_slot_files_are_removed(tmp_path):
    """A slot file whose sender is gone (a crash before its receiver mapped it) is removed by
    the next set-up; one of a live process stays, and so does one made in another pid
    namespace (a container sharing the host's /dev/shm), whose sender's pid means nothing
    here: removing it would break that container's live ring."""
    from ringattn import shm

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    dead = _a_dead_pid()
    orphan = f"/dev/shm/{shm.slot_name('feedbeef0000', dead, 0, 1, 0, 0, 0)}"
    alive = f"/dev/shm/{shm.slot_name('feedbeef0000', os.getpid(), 0, 1, 0, 0, 0)}"
    elsewhere = f"/dev/shm/{shm.slot_name('feedbeef0000', dead, 0, 1, 0, 0, 0, namespace='ns1')}"
    assert shm.slot_sender(elsewhere) == (dead, "ns1"), "slot_sender reads what slot_name wrote"
    assert shm.slot_sender(orphan)[1] != "ns1", "this test runs in pid namespace ns1"
    for path in (orphan, alive, elsewhere):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        shm.remove_orphans()
        assert not os.path.exists(orphan) and os.path.exists(alive), "judged by the pid"
        assert os.path.exists(elsewhere), "a file of another pid namespace was removed"
    finally:
        for path in (orphan, alive, elsewhere):
            if os.path.exists(path):
                os.unlink(path)


def test_a_slot_name_with_a_non_ascii_pid_is_not_judged():
    """/dev/shm is every user's: a file named like a slot whose pid is '²' (str.isdigit() says
    yes, int() raises) made every shm ring's set-up on the host fail in remove_orphans."""
    from ringattn import shm

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    name = shm.slot_name("feedbeef0000", 1, 0, 1, 0, 0, 0).split("-")
    name[3] = "\u00b2"
    planted = "/dev/shm/" + "-".join(name)
    with open(planted, "wb") as f:
        f.write(b"x")
    try:
        assert shm.slot_sender(planted) is None
        shm.remove_orphans()
    finally:
        os.unlink(planted)


def _a_dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_neighbours_on_other_hosts_go_through_gloo():
    """Rank 2 of 3 on 'another host': ranks 0 and 1 exchange through shared memory, every
    pair with rank 2 through gloo (rank 2 shares with no one: plain RingComm), all in the same
    ring, every message intact."""
    per_rank = run_distributed(_messages, 3, 2, transport="auto")
    assert all(r["all_ok"] for r in per_rank), per_rank
    assert [r["chosen"] for r in per_rank] == ["RingShm", "RingShm", "RingComm"]
    assert [r["shared"] for r in per_rank] == [[True, True, False], [True, True, False], None]


def _borrowed(rank: int, world: int) -> dict:
    """Rank 0 sends three messages on one channel as fast as it may; rank 1 borrows each. The
    third goes into the first one's slot, so rank 0 must wait until rank 1 gives that back."""
    import time

    import torch.distributed as dist

    from ringattn.shm import ring_transport

    ring = ring_transport(None)
    like = [torch.empty(1000, dtype=torch.float32), torch.empty(3, dtype=torch.int64)]
    seen = {}
    if rank == 0:
        channel = ring.channel(0, 1, 0)
        for i in (1, 2, 3):
            channel.send([torch.full((1000,), float(i)), torch.full((3,), i, dtype=torch.int64)])
    else:
        channel = ring.channel(0, 1, 0)
        first = channel.read(channel.post_recv(), like, borrow=True)
        time.sleep(1.0)  # room for rank 0 to overwrite the slot, were it given back already
        seen["first_kept"] = bool((first[0] == 1).all()) and bool((first[1] == 1).all())
        seen["in_place"] = first[0].data_ptr() != like[0].data_ptr()
        second = channel.read(channel.post_recv(), like, borrow=True)
        third = channel.read(channel.post_recv(), like, borrow=False)
        seen["second"] = bool((second[0] == 2).all())
        seen["third_copied"] = third[0] is like[0] and bool((like[0] == 3).all())
    ring.drive([])  # settle: rank 0 waits until rank 1 has given back every slot
    dist.barrier()
    return seen


def test_a_borrowed_slot_is_not_written_until_given_back():
    """A borrowed block is the slot itself (no copy), and stays as it came while the ring holds
    it, however far ahead its sender runs; an unborrowed one is copied into the buffer given."""
    per_rank = run_distributed(_borrowed, 2, transport="shm")
    assert per_rank[1] == {
        "first_kept": True,
        "in_place": True,
        "second": True,
        "third_copied": True,
    }, per_rank


def _counted_waits(rank: int, world: int, elsewhere: int | None) -> dict:
    from ringattn import shm
    from ringattn.comm import STATS
    from ringattn.shm import ring_transport

    if rank == elsewhere:
        shm._host = lambda: ("another-host", "another-boot")
    ring = ring_transport(None)
    STATS.reset(enabled=True)
    for _ in range(3):
        send = [torch.full((1000,), float(rank))]
        ring.exchange(send, [torch.empty_like(send[0])]).wait()
    counted = {"waits": len(STATS.waits), "exchanges": STATS.exchanges}
    STATS.reset(enabled=False)
    ring.drive([])
    return counted


@pytest.mark.parametrize("elsewhere", [None, 2], ids=["one-host", "one-rank-elsewhere"])
def test_each_wait_is_counted_once(elsewhere):
    """The benchmarks' wait statistics: one entry per exchange waited on, on shared memory and
    where a pair also goes through gloo (a wait was once counted twice there)."""
    per_rank = run_distributed(_counted_waits, 3, elsewhere, transport="auto")
    assert per_rank == [{"waits": 3, "exchanges": 3}] * 3, per_rank


def _strided_and_mismatched(rank: int, world: int) -> dict:
    """Rows 3..9 of a batch of 2 (a strided view, as a ring hop of a batched block sends),
    then a message whose receiver expects one row more than is sent."""
    import torch.distributed as dist

    from ringattn.shm import ring_transport

    ring = ring_transport(None)
    block = torch.arange(2 * 16 * 4, dtype=torch.float32).reshape(2, 16, 4) + 1000 * rank
    recv = torch.empty(2, 6, 4)
    ring.exchange([block[:, 3:9]], [recv]).wait()
    source = (rank - 1) % world
    want = torch.arange(2 * 16 * 4, dtype=torch.float32).reshape(2, 16, 4) + 1000 * source
    intact = torch.equal(recv, want[:, 3:9])
    refused = []
    for tag, sent, expected in (
        (0, block[:, :6], torch.empty(2, 7, 4)),
        # 6 rows of 16 bytes read as 7: the same total once padded to 64 bytes (the padded
        # totals were compared: the 7th row came from whatever the slot held)
        (1, torch.ones(6, 8, dtype=torch.bfloat16), torch.empty(7, 8, dtype=torch.bfloat16)),
    ):
        pending = ring.exchange([sent], [expected], tag=tag)
        try:
            pending.wait()
            refused.append("")
        except RuntimeError as err:
            refused.append(str(err))
    dist.barrier()
    return {"chosen": type(ring).__name__, "intact": intact, "refused": refused}


def test_a_strided_block_arrives_intact_and_a_wrong_size_is_refused():
    """A batched block's rows are a strided view: the sender copies it into its slot as it is.
    Both sides derive a hop's rows from the layout; were they ever to disagree, the receiver
    refuses the message by name instead of reading the slot with the wrong shape."""
    per_rank = run_distributed(_strided_and_mismatched, 2, transport="shm")
    for r in per_rank:
        assert r["chosen"] == "RingShm" and r["intact"], r
        whole, padded_alike = r["refused"]
        assert "sent tensors of other sizes on stream 0" in whole, r
        assert "expected (224 bytes" in whole, r  # 2 x 7 x 4 float32
        assert "sent tensors of other sizes on stream 1" in padded_alike, r


_PIDNS_RANK = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=timedelta(seconds=30))
from ringattn.shm import ring_transport
ring = ring_transport(None)
recv = [torch.empty(8)]
ring.exchange([torch.full((8,), float(rank + 1))], recv).wait()
ring.drive([])
print(type(ring).__name__, recv[0].tolist(), flush=True)
dist.barrier()
"""


def test_ranks_in_their_own_pid_namespaces_share_a_dev_shm():
    """Two containers run with the host's /dev/shm and network (``--ipc=host
    --network=host``, as for NCCL) each have a pid namespace: the receiver named the sender's
    slot file with its own namespace, so every exchange failed (FileNotFoundError on both
    ranks, the default transport). Rank 1 runs under ``unshare --pid --fork`` here."""
    import shutil
    import socket
    import subprocess
    import sys

    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode
    ):
        pytest.skip("unshare --pid needs root (or user namespaces) here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "RINGATTN_TRANSPORT": "auto", "PYTHONPATH": os.getcwd()}
    argv = [sys.executable, "-c", _PIDNS_RANK]
    ranks = [
        subprocess.Popen([*argv, "0", port], env=env, stdout=subprocess.PIPE, text=True),
        subprocess.Popen(
            ["unshare", "--pid", "--fork", *argv, "1", port],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        ),
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert outs == ["RingShm [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]", f"RingShm {[1.0] * 8}"]


def _groups_outlive_destroy(rank: int, world: int) -> dict:
    """Ring attention over shared memory on the default group and on a subgroup, then every
    group destroyed: are the groups gone (their gloo threads joined)?"""
    import gc
    import weakref

    import torch.distributed as dist

    from ringattn import ring_attention, shm

    sub = dist.new_group(list(range(world)))
    refs = [weakref.ref(dist.group.WORLD), weakref.ref(sub)]
    torch.manual_seed(0)
    for group in (None, sub):
        q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
        ring_attention(q, k, v, causal=True, layout="contiguous", group=group).sum().backward()
    chosen = type(shm.ring_transport(None)).__name__
    dist.destroy_process_group(sub)
    del sub, group
    dist.destroy_process_group()
    gc.collect()
    return {
        "chosen": chosen,
        "alive": [r() is not None for r in refs],
        "cached": len(shm._BY_GROUP),
    }


def test_destroyed_groups_are_not_kept_alive_by_the_transport():
    """The transport's cache held each process group by a strong key: destroy_process_group
    left the group alive, its gloo threads running into interpreter shutdown, where one
    freeing the final barrier's work had to take the GIL and was killed inside a C++
    destructor: `terminate called without an active exception`, about 1 run in 10 of the
    README's engine example (7 of 60; 0 of 60 with the gloo transport, 2 of 60 on it with
    the group kept alive by the script). Weak keys, and a ring holding its group weakly."""
    per_rank = run_distributed(_groups_outlive_destroy, 2, transport="auto")
    assert all(r["chosen"] == "RingShm" for r in per_rank), per_rank
    assert all(r["alive"] == [False, False] and r["cached"] == 0 for r in per_rank), per_rank
