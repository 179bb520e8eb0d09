"""The training job's checkpoints: one owner that writes, finds, reads and prunes them.

Layout under the job directory's ``checkpoints/`` (``JobDir.checkpoints``)::

    step-0000100/            torch.distributed.checkpoint (DCP) files of the model and the
                             optimizer, written by every rank; train_state.json (step, data
                             cursor, learning-rate schedule, what the run was configured
                             with), config.json (the model's), metrics.jsonl (the run's
                             history up to this step) and checksums.json (the sha256 of each
                             of those files, each rank hashing the DCP files it wrote),
                             written by rank 0
    latest                   the name of the newest complete checkpoint ("step-0000100")

A save writes into ``step-NNNNNNN.tmp-<token>`` and becomes ``step-NNNNNNN`` by one rename
after every rank has finished (a barrier), and only then does ``latest`` move (an atomic
replace): a kill at any moment leaves ``latest`` naming a complete checkpoint, and the next
save removes the half-written folder. ``keep`` newest checkpoints stay. DCP (not a
hand-written format) because it reshards: a checkpoint saved by 4 ranks under FSDP loads on 2,
on 8, or unsharded, and the same job resumes on another shape.

Every name read back (``latest``'s content, folder names) is checked to be a plain
``step-NNNNNNN`` (ASCII digits, as ``step_name`` writes it) inside ``checkpoints/``, and
neither a folder nor a file read is a link: a remote-writable file cannot point a resume at
another path. The DCP files themselves are read through ``dcp_reader`` (no pickle runs),
after their checksums are checked (``verify``): DCP keeps none, and a byte flipped on disk
was resumed from and exported as a weight, exit 0. A checkpoint written before checksums.json
existed is read without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write, atomic_write_json, fsync_dir
from ..bounded_read import open_regular, read_regular
from ..jobdir import DCP_METADATA
from ..text import echo

STEP_NAME = re.compile(r"step-([0-9]{7,12})")
TRAIN_STATE = "train_state.json"
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # the model's own (eos ids, sampling), if any
METRICS = "metrics.jsonl"
LATEST = "latest"
CHECKSUMS = "checksums.json"  # {covered file's name: sha256}, written by rank 0 at publish
STATE_KEYS = {"step", "cursor", "scheduler", "run"}
MAX_POINTER_BYTES = 64
MAX_STATE_BYTES = 4 << 20


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint folder's name gives, in ``step_name``'s own form only (not
    ``step-00000008`` nor a staging ``.tmp-`` name), else None."""
    match = STEP_NAME.fullmatch(name)
    step = int(match.group(1)) if match else None
    return step if step is not None and name == step_name(step) else None


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder and what rank 0 wrote beside the DCP files."""

    path: Path
    step: int
    state: dict[str, Any]


class CheckpointDir:
    """``checkpoints/`` of one training job."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # ----------------------------------------------------------------------------- reading
    def pointer(self) -> str | None:
        """The name ``latest`` holds, as written (None: no checkpoint yet); ValueError where
        it is not a regular file of at most MAX_POINTER_BYTES. Not checked to name a
        checkpoint: ``latest`` does that. With no ``latest``, the newest published folder
        (``unpointed``)."""
        path = self.root / LATEST
        if not os.path.lexists(path):
            return self.unpointed()
        return read_regular(path, MAX_POINTER_BYTES).decode("utf-8", errors="replace").strip()

    def unpointed(self) -> str | None:
        """The newest published folder when no ``latest`` names one (None: none). A folder
        is published (renamed from its staging name) only once every rank's files are in
        it, before ``latest`` names it: a kill between the two, or a ``latest`` lost since,
        left complete checkpoints that a resume passed over, starting again from step 0
        (and its saves then replaced them) without a word."""
        done = self.complete()
        return done[-1].name if done else None

    def latest(self) -> Checkpoint | None:
        """The checkpoint ``latest`` names (None: no checkpoint yet), checked; with no
        ``latest``, the newest published folder (``unpointed``), named as that."""
        name = self.pointer()
        if name is None:
            return None
        where = str(self.root / LATEST)
        if not self.pointed():
            where = f"{self.root} (no {LATEST}: its newest published folder)"
        return self.read(name, where=where)

    def pointed(self) -> bool:
        """Whether ``latest`` is there (else ``pointer`` names the newest published folder)."""
        return os.path.lexists(self.root / LATEST)

    def read(self, name: str, *, where: str) -> Checkpoint:
        step = checkpoint_step(name)
        if step is None:
            raise ValueError(f"{where}: {echo(name)} is not a checkpoint name (step-NNNNNNN)")
        path = self.root / name
        if path.is_symlink() or not (path / TRAIN_STATE).is_file():
            raise ValueError(f"{where}: names {name}, which is missing, incomplete or a link")
        if not (path / DCP_METADATA).is_file():
            raise ValueError(f"{where}: names {name}, which is missing or incomplete")
        state = read_train_state(path / TRAIN_STATE)
        if state["step"] != step:
            raise ValueError(f"{path / TRAIN_STATE}: step {state['step']} in folder {name}")
        return Checkpoint(path, state["step"], state)

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        found = [
            p
            for p in self.root.glob("step-*")
            if STEP_NAME.fullmatch(p.name) and not p.is_symlink() and p.is_dir()
        ]
        return sorted(found, key=lambda p: int(STEP_NAME.fullmatch(p.name).group(1)))

    # ----------------------------------------------------------------------------- writing
    def staging(self, step: int, token: str | None = None) -> Path:
        """Where every rank writes step ``step``'s DCP files (``token``: the same on every
        rank, chosen by rank 0)."""
        return self.root / f"{step_name(step)}.tmp-{token or uuid.uuid4().hex[:8]}"

    def publish(
        self,
        staged: Path,
        step: int,
        state: dict,
        model_config: str,
        keep: int,
        metrics: Path,
        sums: dict[str, str],
        generation_config: str | None = None,
    ) -> Path:
        """Rank 0, after every rank wrote ``staged``: the model's config, the train state and
        the metrics so far beside the DCP files, then the checksums of them all (``sums``:
        the ranks' own of the DCP files), the rename, ``latest``, and the pruning. Returns
        the folder."""
        atomic_write(staged / MODEL_CONFIG, model_config)  # synced before latest names them
        if generation_config is not None:
            atomic_write(staged / GENERATION_CONFIG, generation_config)
        atomic_write_json(staged / TRAIN_STATE, state)
        if metrics.exists():
            atomic_write(staged / METRICS, metrics.read_bytes())
        sums = {
            **sums,
            **{n: file_sha256(staged / n) for n in RANK0_FILES if (staged / n).exists()},
        }
        missing = sorted({p.name for p in covered_files(staged)} - set(sums))
        if missing:  # a rank's listing missed a file: it could never be resumed from
            raise ValueError(f"{staged}: no rank hashed {', '.join(missing)}")
        atomic_write_json(staged / CHECKSUMS, sums)
        fsync_dir(staged)  # their entries too, before the rename and latest
        final = self.root / step_name(step)
        if final.exists():  # a rerun of a step saved before (after a resume): replace it
            shutil.rmtree(final)
        staged.rename(final)
        fsync_dir(self.root)  # the rename durable before latest names it
        atomic_write(self.root / LATEST, final.name + "\n")
        fsync_dir(self.root)
        self.prune(keep)
        return final

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints (and always ``latest``'s); remove half-written
        folders of earlier saves."""
        for tmp in self.root.glob("step-*.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        latest = self.pointer() or ""
        for old in self.complete()[:-keep] if keep > 0 else []:
            if old.name != latest:
                shutil.rmtree(old, ignore_errors=True)


# What rank 0 writes at publish beside the ranks' DCP files, each covered by checksums.json:
# config.json (gather builds the exported model from it), generation_config.json (the
# model's: gather exports it; without it a chat model's end-of-turn ids were lost),
# train_state.json (the data cursor and schedule a resume continues from: an offset changed
# by one resumed on other tokens, exit 0) and metrics.jsonl (gather's loss and history, a
# resume's restored log).
RANK0_FILES = (MODEL_CONFIG, GENERATION_CONFIG, TRAIN_STATE, METRICS)


def covered_files(folder: Path) -> list[Path]:
    """What checksums.json covers, by name: the DCP files (``.metadata``, the ``*.distcp``
    shards) and ``RANK0_FILES``."""
    names = (DCP_METADATA, *RANK0_FILES)
    found = (p for p in folder.iterdir() if p.name in names or p.name.endswith(".distcp"))
    return sorted(found, key=lambda p: p.name)


def file_sha256(path: Path) -> str:
    """The sha256 of a regular file, read a block at a time (not through a link)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


HASH_BLOCK = 8 << 20


def written_sums(folder: Path, rank: int, world: int) -> dict[str, str]:
    """At the save, {name: sha256} of the DCP files this rank wrote (DCP names a rank's
    shards ``__<rank>_<n>.distcp``; rank 0 also the ``.metadata`` it wrote and any file no
    rank's name claims): read back from the writer's own page cache, not over the network."""
    mine = f"__{rank}_"
    ours = tuple(f"__{r}_" for r in range(world))
    chosen = [
        p
        for p in covered_files(folder)
        if p.name.startswith(mine) or rank == 0 and not p.name.startswith(ours)
    ]
    return {p.name: file_sha256(p) for p in chosen if p.name not in RANK0_FILES}


def share_sums(folder: Path, rank: int, world: int) -> dict[str, str]:
    """{name: sha256} of this rank's share of the covered files (every world-th, from
    ``rank``): the ranks of a resume check a checkpoint together, each a part."""
    return {p.name: file_sha256(p) for p in covered_files(folder)[rank::world]}


def largest_share_bytes(folder: Path, world: int) -> int:
    """The bytes of the largest share ``share_sums`` gives a rank (0 where the files cannot
    be listed: ``verify`` says why)."""
    try:
        sizes = [p.stat().st_size for p in covered_files(folder)]
    except OSError:
        return 0
    return max((sum(sizes[rank::world]) for rank in range(max(1, world))), default=0)


def verify(checkpoint: Checkpoint, rank: int = 0, world: int = 1) -> str:
    """Why this rank's share of the checkpoint's files is not what checksums.json says ("":
    it is). A checkpoint of an earlier ringctl has none (read as it is); one whose run
    recorded ``byte_tokens`` was written with it (the same release), so its absence is a
    file removed, which is refused: deleting it turned the check off."""
    path = checkpoint.path / CHECKSUMS
    if not os.path.lexists(path):
        if "byte_tokens" in checkpoint.state.get("run", {}):
            return f"{path}: missing (this checkpoint was written with one)"
        return ""
    try:
        listed = json.loads(read_regular(path, MAX_STATE_BYTES).decode("utf-8"))
    except (ValueError, RecursionError) as err:
        return f"{path}: not readable ({err})"
    if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
        return f"{path}: must map each covered file's name to its sha256"
    names = [
        p.name for p in covered_files(checkpoint.path) if p.name not in _uncovered_then(listed)
    ]
    if sorted(listed) != names:
        return f"{checkpoint.path}: its files ({', '.join(names)}) are not those {path} lists"
    try:
        mine = share_sums(checkpoint.path, rank, world)
    except (OSError, ValueError) as err:  # a file gone, or made a link or a pipe
        return f"{checkpoint.path}: a checkpoint file cannot be read ({err})"
    for name, digest in mine.items():
        if name in listed and digest != listed[name]:
            return (
                f"{checkpoint.path / name}: its sha256 is not the one {CHECKSUMS} recorded at "
                "the save (the file changed since: a disk or copy error?)"
            )
    return ""


def _uncovered_then(listed: dict) -> set[str]:
    """Which of ``RANK0_FILES`` checksums.json did not cover yet when ``listed`` was written:
    it covered the DCP files alone, then config.json too, then train_state.json and
    metrics.jsonl too. A checkpoint of an earlier release (a job running across the upgrade)
    is not refused as corrupt."""
    if TRAIN_STATE in listed:
        return set()
    return {TRAIN_STATE, METRICS} if MODEL_CONFIG in listed else set(RANK0_FILES)
    # (generation_config.json came after train_state.json: a folder without it has none)


def read_train_state(path: Path) -> dict[str, Any]:
    """train_state.json, validated: step (int >= 0), cursor, scheduler and run (mappings)."""
    raw = read_regular(path, MAX_STATE_BYTES)  # ValueError naming the file
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{path}: not readable as JSON ({type(err).__name__})") from None
    if not isinstance(data, dict) or set(data) != STATE_KEYS:
        raise ValueError(f"{path}: must hold exactly the keys {sorted(STATE_KEYS)}")
    step = data["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: step must be an integer >= 0, got {step!r}")
    for key in ("cursor", "scheduler", "run"):
        if not isinstance(data[key], dict):
            raise ValueError(f"{path}: {key} must be a mapping")
    return data


def train_state(step: int, cursor: dict, scheduler: dict, run: dict) -> dict[str, Any]:
    """What train_state.json holds (``read_train_state`` reads it back)."""
    return {"step": step, "cursor": cursor, "scheduler": scheduler, "run": run}


# ----------------------------------------------------------------------------- DCP
def save(
    model,
    optimizer,
    ckdir: CheckpointDir,
    step: int,
    state: dict,
    *,
    keep: int,
    metrics: Path,
    group=None,
) -> Path:
    """Every rank: write the model's and the optimizer's state (DCP, each rank its shards; a
    model every rank holds whole is written once), then rank 0 publishes it (``publish``).
    Collective over the job."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    token = [uuid.uuid4().hex[:8] if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, src=_rank0(group), group=group)
    staged = ckdir.staging(step, token[0])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staged), process_group=group)
    dist.barrier(group=group)
    world = dist.get_world_size(group)
    shares: list = [None] * world
    dist.all_gather_object(shares, written_sums(staged, dist.get_rank(group), world), group=group)
    final = ckdir.root / step_name(step)
    if dist.get_rank(group) == 0:
        config = model.config.to_json_string() if hasattr(model, "config") else "{}"
        generation = getattr(model, "generation_config", None)
        sums = {name: digest for share in shares for name, digest in share.items()}
        final = ckdir.publish(
            staged,
            step,
            state,
            config,
            keep,
            metrics,
            sums,
            generation.to_json_string() if generation is not None else None,
        )
    dist.barrier(group=group)
    return final


def verify_together(checkpoint: Checkpoint, *, group=None) -> None:
    """Every rank hashes its share of the checkpoint's files (``verify``); ValueError on
    every rank alike, whichever share held the changed file. Collective over the job; before
    anything of the checkpoint is believed (its train_state's run signature and cursor were
    compared first: a damaged one was refused as a changed setting). The ranks wait for each
    other as long as the largest share takes to read (``patient_group``): a checkpoint of a
    large model's optimizer state resumed on few ranks is minutes of hashing a rank, past the
    collective timeout."""
    import torch.distributed as dist

    from ..longdoc.consensus import agree, patient_group

    if not dist.is_initialized():  # one process (a check of it alone): the whole of it
        error = verify(checkpoint)
        if error:
            raise ValueError(error)
        return
    world = dist.get_world_size(group)
    with patient_group(largest_share_bytes(checkpoint.path, world), group) as patient:
        error = verify(checkpoint, dist.get_rank(group), world)
        try:
            agree(error, patient)
        except RuntimeError as err:
            raise ValueError(str(err)) from None


def load(model, optimizer, checkpoint: Checkpoint, *, group=None) -> None:
    """Every rank: the model's and the optimizer's state from ``checkpoint`` (checked by
    ``verify_together`` first), resharded to however this job holds them (DCP, read through
    ``dcp_reader``: its files may be hostile). Collective over the job."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from . import dcp_reader

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_reader.load(state, checkpoint.path, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_weights(model, checkpoint: Checkpoint) -> None:
    """One process, no process group: the model's weights alone (gather's export, which
    ``verify``-ies the checkpoint before it reads any of its files)."""
    import warnings

    from . import dcp_reader

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": it is, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp_reader.load(state, checkpoint.path, no_dist=True)
    model.load_state_dict(state["model"])


def _rank0(group) -> int:
    import torch.distributed as dist

    return 0 if group is None else dist.get_global_rank(group, 0)
