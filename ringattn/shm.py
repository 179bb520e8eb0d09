"""The ring's transport between ranks on one host: blocks exchanged through shared memory.

gloo has no shared-memory path: ranks on one host send every K/V block through TCP loopback,
and gloo's copy threads then run on the cores the kernels compute on. Here each directed pair
of ranks and each stream (``tag``: K/V, dK/dV) has a channel of two slots, files in
``/dev/shm`` mapped by both processes. ``exchange`` copies the block into the next free slot
and sends a token saying so; ``wait`` takes the token from the previous rank and copies its
block out, or, for an exchange the ring *borrows* (K/V blocks, and a one-hop leg's dK/dV
coming home: read, never kept) into CPU buffers, hands the ring views of the slot itself: one
copy per block instead of two (a block bound for a GPU is still copied to it). A borrowed
slot goes back to its sender at the next read on its channel or when the call ends
(``drive``), so a view never outlives the ring call. Two slots let a sender run one block
ahead (the ring posts the next transfer before it computes on the block it holds). The
tokens (a few bytes) travel by gloo's point-to-point: a rank waiting for one sleeps instead
of spinning on a core its peer computes on, and the system calls order the slot's writes
before the token on any memory model. A token also says how many bytes the message holds; the
receiver refuses one that is not the block it expects (a slot read with the wrong shape would
be a wrong number, not an error).

A slot file is made by its sender, under a name the token gives (re-made larger when a bigger
message comes), and unlinked by the receiver once both have it mapped, so nothing stays in
``/dev/shm`` after a clean run; a set-up removes files left by processes that died between
the two (only files made in its own pid namespace: a container sharing the host's /dev/shm
keeps its files). Setting up is two small collectives on the group (``RingShm.for_group``,
cached per group): ranks with the same host name and boot id check that they see a file the
lowest of them made (containers with their own /dev/shm do not). Two neighbours that share a
/dev/shm exchange through it; any other pair (ranks on different hosts) through gloo's
point-to-point, as ``RingComm``. Collectives (the engine's shape check) stay on gloo.

``RINGATTN_TRANSPORT``: ``auto`` (default: shared memory for a gloo group whose ranks share a
host), ``gloo`` (never), ``shm`` (required: an error where the ranks do not share a host).
"""

from __future__ import annotations

import glob
import hashlib
import mmap
import os
import secrets
import stat
import tempfile
import time
import uuid
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import STATS, RingComm
from .switches import TRANSPORT, choice

PREFIX = "ringattn-shm"


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


ALIGN = 64  # each tensor of a message starts at a multiple of this in its slot


TOKEN_WORDS = 4  # a message's token: slot file size, generation, nonce, tensor sizes


def _sizes(tensors: Sequence[torch.Tensor]) -> int:
    """The message's tensor sizes in bytes, as one 62-bit signature for its token: a receiver
    whose tensors differ refuses the message (padded totals could agree where sizes do not:
    6 rows read as 7 took a row the slot held from an earlier block)."""
    text = ",".join(str(_bytes(t)) for t in tensors).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _check_own_file(fd: int, path: str, size: int) -> None:
    """A slot file the receiver opens must be this user's regular file of at least the size
    the token says (the sender made it so: anything else was put there by someone else)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size < size:
        raise RuntimeError(
            f"ringattn shm: {path} is not the slot its sender made (another owner, kind or "
            "size): refusing to read it"
        )


def _offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor of a message starts in its slot, and the bytes the message needs:
    aligned, so a receiver's view of a slot has its dtype's alignment (and a cache line's)."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-_bytes(t) // ALIGN) * ALIGN
    return offsets, end


class _Slot:
    """One slot of a channel as one side maps it: the file of its current generation."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.view: torch.Tensor | None = None
        self.generation = -1
        self.pending_free = None  # sender: the receiver's "read it" token for this slot
        self.nonce = 0  # the current file's nonce (its name's last part)

    def attach(self, path: str, size: int, generation: int, create: bool) -> None:
        # The old map is dropped, not closed: it unmaps when the last view of it goes.
        self.view, self.map = None, None
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                _check_own_file(fd, path, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if not create:
            os.unlink(path)  # both sides have it mapped: nothing to clean up later
        self.view = torch.frombuffer(self.map, dtype=torch.uint8)
        self.generation = generation


class _Channel:
    """``src -> dst`` for one stream: two slots, used in turn."""

    def __init__(self, ring: RingShm, src: int, dst: int, tag: int) -> None:
        self.ring, self.src, self.dst, self.tag = ring, src, dst, tag
        self.slots = [_Slot(), _Slot()]
        self.count = 0  # messages sent (sender) or read (receiver)
        self.borrowed = False  # receiver: the ring holds views of the last message's slot

    def _path(self, index: int, generation: int, nonce: int) -> str:
        """The slot file's name: the sender's pid and pid namespace (as the sender sees them:
        ranks in containers sharing the host's /dev/shm each have their own), and a nonce the
        sender drew for this file and sends in its token (a name nobody else can predict, and
        so cannot take first: another user making it would fail the sender's O_EXCL)."""
        sender, namespace = self.ring.pids[self.src], self.ring.namespaces[self.src]
        names = (self.src, self.dst, self.tag, index, generation, nonce)
        return os.path.join(
            _shm_root(), slot_name(self.ring.token, sender, *names, namespace=namespace)
        )

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        index = self.count % 2
        slot = self.slots[index]
        if slot.pending_free is not None:  # the receiver must be done with this slot's last
            slot.pending_free[1].wait()
        offsets, need = _offsets(tensors)
        if slot.map is None or len(slot.map) < need:
            slot.nonce = secrets.randbits(62)
            slot.attach(
                self._path(index, slot.generation + 1, slot.nonce),
                max(need, 1),
                slot.generation + 1,
                create=True,
            )
        for offset, src in zip(offsets, tensors, strict=True):  # strided (a batch's rows) too
            slot.view[offset : offset + _bytes(src)].view(src.dtype).view(src.shape).copy_(src)
        sizes = _sizes(tensors)
        token = torch.tensor([len(slot.map), slot.generation, slot.nonce, sizes], dtype=torch.int64)
        self.ring.token_send(token, self.dst, 2 * self.tag)
        freed = torch.empty(1, dtype=torch.int64)  # lives as long as its receive
        slot.pending_free = (freed, self.ring.token_recv(freed, self.dst, 2 * self.tag + 1))
        self.count += 1

    def post_recv(self):
        """The token of the next message from ``src`` (posted early, waited on by read)."""
        token = torch.empty(TOKEN_WORDS, dtype=torch.int64)
        return token, self.ring.token_recv(token, self.src, 2 * self.tag)

    def read(self, posted, recv: Sequence[torch.Tensor], borrow: bool) -> tuple:
        """The next message from ``src``: copied into ``recv``, or with ``borrow`` views of its
        slot shaped as ``recv`` (the slot stays this side's until ``give_back``). First gives
        back a slot borrowed before: a ring that waits for its next block is done with the
        one it held."""
        self.give_back()
        token, request = posted
        request.wait()
        size, generation, nonce, sent = (int(x) for x in token.tolist())
        offsets, _ = _offsets(recv)
        if sent != _sizes(recv):  # both sides derive a block's rows from the layout: never,
            # but a slot read with another shape would be a wrong number, not an error
            raise RuntimeError(
                f"ringattn shm: rank {self.src} sent tensors of other sizes on stream "
                f"{self.tag} than rank {self.dst} expected "
                f"({', '.join(str(_bytes(t)) for t in recv)} bytes: the ranks disagree on "
                "the ring's layout)"
            )
        index = self.count % 2
        slot = self.slots[index]
        if generation != slot.generation:
            path = self._path(index, generation, nonce)
            slot.attach(path, size, generation, create=False)
        self.count += 1
        views = [
            slot.view[offset : offset + _bytes(t)].view(t.dtype).view(t.shape)
            for offset, t in zip(offsets, recv, strict=True)
        ]
        if borrow and all(t.device.type == "cpu" for t in recv):  # a slot is host memory
            self.borrowed = True
            return tuple(views)
        for dst, view in zip(recv, views, strict=True):
            dst.copy_(view)
        self._free()
        return tuple(recv)

    def give_back(self) -> None:
        """Tell the sender the slot lent by the last ``read`` may be written again."""
        if self.borrowed:
            self.borrowed = False
            self._free()

    def _free(self) -> None:
        self.ring.token_send(torch.ones(1, dtype=torch.int64), self.src, 2 * self.tag + 1)


class _Pending:
    """A posted exchange. Its shared-memory send is done; ``wait`` finishes its gloo
    transfers (a pair on different hosts) and reads a shared-memory block from the previous
    rank; ``received`` then holds the block (``recv``, or views of a borrowed slot)."""

    __slots__ = ("borrow", "channel", "kept", "posted", "received", "requests")

    def __init__(
        self, channel: _Channel | None, recv: Sequence[torch.Tensor], borrow: bool
    ) -> None:
        self.channel, self.received, self.requests, self.borrow = channel, tuple(recv), [], borrow
        self.kept: Sequence[torch.Tensor] = ()  # tensors sent through gloo, until done
        self.posted = channel.post_recv() if channel is not None else None

    def wait(self) -> None:
        start = time.perf_counter() if STATS.enabled else 0.0
        for request in self.requests:  # a pair on different hosts: gloo's transfers
            request.wait()
        if self.channel is not None:
            self.received = self.channel.read(self.posted, self.received, self.borrow)
        if STATS.enabled:
            elapsed = time.perf_counter() - start
            STATS.wait_s += elapsed
            STATS.waits.append(elapsed)


class RingShm(RingComm):
    """A ``RingComm`` whose blocks go through shared memory: the same ring order, endpoint
    and transport (``exchange``, ``drive``); gloo carries the tokens and the collectives."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        token: str,
        pids: list[tuple[int, str]],
        shared: list[bool],
    ) -> None:
        super().__init__(group)  # the group held weakly (``group``): _BY_GROUP's key
        self.token = token
        self.pids = [pid for pid, _ in pids]  # each rank's pid and pid namespace
        self.namespaces = [namespace for _, namespace in pids]
        self.shared = shared  # shared[r]: this rank and rank r share a /dev/shm
        self._channels: dict[tuple[int, int, int], _Channel] = {}
        self._sent: list = []  # token sends in flight (their tensors must live until done)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The ring's group, held weakly: _BY_GROUP holds this ring under the group as a weak
        key, which a strong reference here would keep alive for ever all the same."""
        group = self._group() if self._group is not None else None
        if self._group is not None and group is None:
            raise RuntimeError("ringattn shm: the ring's process group has been destroyed")
        return group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        self._group = None if group is None else weakref.ref(group)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, required: bool) -> RingShm | None:
        """The ring of ``group`` through shared memory where neighbours share a /dev/shm (set
        up once per group), or None when no two ranks of it do (an error when ``required``:
        then every rank must share one)."""
        key = dist.group.WORLD if group is None else group  # the default group of now
        if key not in _BY_GROUP:
            token, pids, shared = _agree(group)
            rank = dist.get_rank(group)
            others = any(s for r, s in enumerate(shared) if r != rank)
            _BY_GROUP[key] = cls(group, token, pids, shared) if others else None
        ring = _BY_GROUP[key]
        if required and (ring is None or not all(ring.shared)):
            raise RuntimeError(
                "RINGATTN_TRANSPORT=shm: the ranks of this ring do not all share a host (or a "
                "/dev/shm); use RINGATTN_TRANSPORT=auto or gloo"
            )
        return ring

    def token_send(self, token: torch.Tensor, to: int, tag: int) -> None:
        self._sent = [(t, r) for t, r in self._sent if not r.is_completed()]
        request = dist.isend(token, self._global(to), group=self.group, tag=tag)
        self._sent.append((token, request))

    def token_recv(self, token: torch.Tensor, source: int, tag: int):
        return dist.irecv(token, self._global(source), group=self.group, tag=tag)

    def channel(self, src: int, dst: int, tag: int) -> _Channel:
        """The one shared-memory channel from rank src to rank dst for messages of `tag`."""
        key = (src, dst, tag)
        if key not in self._channels:
            self._channels[key] = _Channel(self, src, dst, tag)
        return self._channels[key]

    def drive(self, loops, device=None) -> list:
        """Run this rank's loop, then settle: every slot it borrowed given back, every block
        it sent read by its receiver and every token it sent delivered, so no transfer is in
        flight when the call returns (a process may exit right after, and gloo drops what it
        had not written yet)."""
        results = super().drive(loops, device)
        for channel in self._channels.values():
            channel.give_back()
        for channel in self._channels.values():
            for slot in channel.slots:
                if slot.pending_free is not None:
                    slot.pending_free[1].wait()
                    slot.pending_free = None
        for _, request in self._sent:
            request.wait()
        self._sent = []
        return results

    def exchange(
        self, send, recv, *, tag: int = 0, shift: int = 1, borrow: bool = False
    ) -> _Pending:
        """As ``RingComm.exchange``: ``send`` to rank + shift (through shared memory: copied
        into its channel now), ``recv`` from rank - shift (through shared memory: read by the
        returned exchange's ``wait``, in place with ``borrow``); a pair that shares no
        /dev/shm goes through gloo."""
        world = self.world_size
        to, source = (self.rank + shift) % world, (self.rank - shift) % world
        if STATS.enabled:
            STATS.bytes_sent += sum(_bytes(t) for t in send)
            STATS.exchanges += 1
        from_shm = self.shared[source]
        channel = self.channel(source, self.rank, tag) if from_shm else None
        pending = _Pending(channel, recv, borrow)
        if not from_shm:
            pending.requests += [
                dist.irecv(t, self._global(source), group=self.group, tag=tag) for t in recv
            ]
        if self.shared[to]:
            self.channel(self.rank, to, tag).send(send)
        else:
            send = [t.contiguous() for t in send]  # kept alive by the pending exchange
            pending.kept = send
            pending.requests += [
                dist.isend(t, self._global(to), group=self.group, tag=tag) for t in send
            ]
        return pending


# Weak keys: the cache must not keep a process group alive past destroy_process_group, which
# joins its gloo threads only when the last reference goes. A group kept here instead lives into
# interpreter shutdown, where a gloo worker still dropping a finished collective (the final
# barrier's) must take the GIL to free its tensors and is killed inside a C++ destructor:
# "terminate called without an active exception".
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ring_transport(group: dist.ProcessGroup | None) -> RingComm:
    """The ring of ``group``'s processes: through shared memory where its ranks share a host
    and it runs on gloo (``RINGATTN_TRANSPORT``: see the module docstring), else
    ``RingComm``'s point-to-point."""
    mode = choice(TRANSPORT, os.environ.get(TRANSPORT))
    if mode != "gloo" and dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo":
        ring = RingShm.for_group(group, required=mode == "shm")
        if ring is not None:
            return ring
    return RingComm(group)


def _host() -> tuple[str, str]:
    """(host name, boot id): ranks with the same pair may share a /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return os.uname().nodename, boot


def _agree(group: dist.ProcessGroup | None) -> tuple[str, list[int], list[bool]]:
    """(a token naming this ring's files, every rank's (pid, pid namespace), with which ranks
    this one shares a /dev/shm). The lowest rank of each host makes a probe file (named as a
    slot is: ``remove_orphans`` clears it if that rank dies before removing it); a rank shares
    with those of its host that see it as it does."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hosts: list = [None] * world
    me = (_host(), (os.getpid(), _pid_namespace()), uuid.uuid4().hex[:12])
    dist.all_gather_object(hosts, me, group=group)
    token = hosts[0][2]
    leader = min(r for r in range(world) if hosts[r][0] == hosts[rank][0])
    pid, namespace = hosts[leader][1]
    probe = os.path.join(_shm_root(), slot_name(token, pid, leader, namespace=namespace))
    if rank == leader:
        remove_orphans()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        os.close(os.open(probe, flags, 0o600))
    dist.barrier(group=group)
    sees: list = [None] * world
    dist.all_gather_object(sees, os.path.exists(probe), group=group)
    if rank == leader:
        os.unlink(probe)
    shared = [
        hosts[r][0] == hosts[rank][0] and bool(sees[r]) and bool(sees[rank]) for r in range(world)
    ]
    return token, [h[1] for h in hosts], shared


def slot_name(token: str, sender_pid: int, *where: int, namespace: str | None = None) -> str:
    """A slot file's name: the ring's token, the sender's pid and pid namespace (this
    process's unless given: what ``remove_orphans`` judges it by), then ``where`` (src, dst,
    stream, slot, generation). ``slot_sender`` reads it back."""
    namespace = namespace or _pid_namespace()
    return "-".join((PREFIX, token, str(sender_pid), namespace, *map(str, where)))


def slot_sender(path: str) -> tuple[int, str] | None:
    """(sender's pid, its pid namespace) from a slot file's name (``slot_name``; a set-up's
    probe file is named alike); None for another file."""
    parts = os.path.basename(path).split("-")
    pid = parts[3] if len(parts) >= 5 and parts[:2] == PREFIX.split("-") else ""
    if not (pid.isascii() and pid.isdigit()):  # '²' passes isdigit() alone, and int() raises
        return None
    return int(pid), parts[4]


def _pid_namespace() -> str:
    """This process's pid namespace ('ns' and its inode; 'ns0' where /proc has none). A
    container run with the host's /dev/shm (``--ipc=host``) has a namespace of its own, in
    which the pids of the other containers' ranks do not exist."""
    try:
        return f"ns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "ns0"


def remove_orphans() -> None:
    """Slot files whose sender (the pid in the name) no longer runs: a crash between a slot's
    creation and its receiver mapping it. Only files made in this pid namespace: another's
    pids cannot be looked up from here (a live ring in another container would lose its
    files)."""
    here = _pid_namespace()
    for path in glob.glob(os.path.join(_shm_root(), f"{PREFIX}-*")):
        sender = slot_sender(path)
        if sender is None or sender[1] != here:
            continue
        try:
            os.kill(sender[0], 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except PermissionError:  # another user's live process
            pass
