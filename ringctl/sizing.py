"""Sizing a job: where job configs meet the planner.

A job config (its task, ranks, device, ``ring.size``, ``model.shard``) becomes the planner's
plain ``Workload``, ``Device`` and ring sizes here, once per submission: ``Sizing(cfg)`` reads
the devices table and builds the workload (the task's ``workload(cfg)`` hook) a single time,
and answers the three questions `ringctl submit` asks of the planner: the per-rank budget
``ring.size=auto`` needs (``budget``), whether the ranks hold the job (``preflight``), and
whether they hold its documents (``documents``, ``unchecked``). `ringctl plan JOB` reads the
job the same way (``ring_size``, ``job_workload``). The planner itself (ringctl/planner)
imports neither the tasks nor the config.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

from .backends import ranks_here
from .config import job_layout, world_size
from .errors import UserError
from .planner.cost import GIB, ModelShape, Workload, estimate, memory_per_rank, nominal_link
from .planner.devices import Device, load_devices
from .planner.model import ModelTooLarge, Unpriced, too_large
from .planner.preflight import Preflight

__all__ = [
    "Sizing",
    "config_section",
    "host_memory",
    "job_shard",
    "job_workload",
    "resolve_model",
    "ring_size",
]


def host_memory() -> int | None:
    """This host's memory in bytes (None: not known here)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_model(spec: str) -> ModelShape:
    """``spec``: a preset name (see planner/data/models.json) or a model directory / config
    file, read by the job's own reader (``longdoc.compat.model_shape``)."""
    from pathlib import Path

    from .longdoc.model.compat import model_shape
    from .planner.model import presets

    table = presets()
    if spec in table:
        return table[spec]
    if spec.strip() and Path(spec).expanduser().exists():  # "" is Path("."): no model named
        return model_shape(str(Path(spec).expanduser()))
    raise UserError(
        f"--model {spec!r}: neither a preset ({', '.join(sorted(table))}) nor a model "
        "directory or config.json"
    )


def config_section(cfg, name: str) -> dict:
    """A config section as plain data, {} when the job has none (keys others are adding)."""
    from omegaconf import OmegaConf

    value = cfg.get(name)
    if value is None:
        return {}
    data = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return data if isinstance(data, dict) else {}


def ring_size(cfg) -> int | None:
    """``ring.size``: an int ring size, or None (absent, or ``auto``: rings per document)."""
    size = config_section(cfg, "ring").get("size")
    if size is None or str(getattr(size, "value", size)) == "auto":
        return None
    try:
        return int(size)
    except (TypeError, ValueError):
        raise UserError(f"ring.size: expected auto or a number of ranks, got {size!r}") from None


def job_shard(cfg, ring: int | None, world: int, trains: bool) -> tuple[str, int | None]:
    """``model.shard``: none | ring | job -> the planner's (shard, degree). Inference shards
    the weights; training (grad) also reduces gradients into shards."""
    value = str(config_section(cfg, "model").get("shard", "none"))
    if value == "none":
        return "none", None
    if value not in ("ring", "job"):
        raise UserError(f"model.shard: expected none, ring or job, got {value!r}")
    kind = "full" if trains else "weights"
    return kind, (ring or world) if value == "ring" else world


def job_workload(cfg, ring: int | None) -> Workload | None:
    """The planner's workload for a job: its task's ``workload(cfg)`` (a long-document job's
    has ``seq_len`` 0: documents differ; see the budget), sharded as ``model.shard`` says.
    None: the task does not describe its work up front."""
    from .tasks import get_task

    work = get_task(str(cfg.task.name)).workload(cfg)
    if work is None:
        return None
    work = replace(work, ulysses=job_ulysses(cfg, work))
    shard, degree = job_shard(cfg, ring, world_size(cfg), work.trains)
    return replace(work, shard=shard, shard_degree=degree) if shard != "none" else work


def job_ulysses(cfg, work: Workload) -> int:
    """``ring.ulysses``: the Ulysses degree the job's ranks will run with
    (``rings.ulysses_degree``, without the placement that only the allocation has): submit
    priced a flat ring where `ringctl plan JOB` priced the hybrid grid, and a job plan
    refused (100 GiB a rank) was submitted as fitting (53 GiB)."""
    from .rings import ulysses_degree

    requested = config_section(cfg, "ring").get("ulysses")  # checked at load (config.py)
    return ulysses_degree(
        requested,
        ranks_per_node=int(cfg.tasks_per_node),
        world=world_size(cfg),
        heads=work.heads,
        kv_heads=work.kv_heads,
    )


class Sizing:
    """One job's sizing: its workload, device entry and rings, each computed once.

    The workload is built on first use; a config the planner cannot read (a UserError) is
    kept and raised again by the questions that refuse on it (``budget``, ``documents``),
    while ``preflight`` and ``unchecked`` answer None, as each did on its own before.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.world = world_size(cfg)
        self.per_node = int(cfg.tasks_per_node)

    def with_config(self, cfg) -> Sizing:
        """The same sizing for ``cfg``, a copy of this job's config with its budget written in
        (``ring.max_tokens_per_rank`` is no input of the workload)."""
        other = Sizing.__new__(Sizing)
        other.__dict__.update(self.__dict__, cfg=cfg)
        return other

    @cached_property
    def devices(self) -> dict[str, Device]:
        return load_devices()

    @cached_property
    def _work(self) -> tuple[Workload | None, UserError | None]:
        try:
            return job_workload(self.cfg, ring=ring_size(self.cfg)), None
        except UserError as err:
            return None, err

    @property
    def work(self) -> Workload | None:
        """The job's workload (None: its task does not describe it); a UserError if unreadable."""
        work, err = self._work
        if err is not None:
            raise err
        return work

    @property
    def device_name(self) -> str | None:
        name = self.cfg.get("device")
        return str(name) if name else None

    @property
    def device(self) -> Device | None:
        """The job's ``device`` entry in the table (None: no device, or one not in it)."""
        return self.devices.get(self.device_name) if self.device_name else None

    def device_problem(self) -> str | None:
        """Why the job's ``device`` cannot be priced: one the table does not know (`ringctl
        plan` refuses it too). A typo (``device=H100``) switched submit's plan check off in
        silence, and a job that could not fit was submitted."""
        from .planner.devices import USER_DEVICES, get_device

        if not self.device_name or self.device_name in self.devices:
            return None
        try:
            get_device(self.device_name)  # its words, the ones `plan` gives
        except UserError as err:
            return (
                f"device: {err} (a device of your own goes in {USER_DEVICES}, or the file "
                "RINGCTL_DEVICES names)"
            )
        return None

    @cached_property
    def largest_ring(self) -> int:
        from .rings import ring_sizes

        size = self.cfg.ring.size if self.cfg.ring.size is not None else self.world
        return max(ring_sizes(self.world, size))

    def preflight(self) -> Preflight | None:
        """What `ringctl submit` checks: the job's plan, or None when it cannot be sized (no
        device entry, or a task that does not describe its work up front)."""
        import socket

        work, err = self._work
        if err is not None or work is None or not work.seq_len:
            return None
        name = self.device_name
        if not name and int(self.cfg.gpus_per_node) == 0:
            name = f"cpu-{socket.gethostname().split('.')[0]}"
        if not name or name not in self.devices:
            return None
        device = self.devices[name]
        ranks = ring_size(self.cfg) or self.world
        link = nominal_link(device, max(1, -(-ranks // self.per_node)))
        est = estimate(work, ranks, device, link, ranks_on_host=self.ranks_on_host)
        return Preflight(name, est)

    @property
    def ranks_on_host(self) -> int:
        """The job's ranks on one node, which share its memory and cores whatever the ring
        size: priced by the ring's (4 rings of 1 on a 23.5 GiB host got 22.5 GiB each,
        66 GiB in all, "fits", and a quarter of the time). The local backend runs every
        rank on this host, however many nodes the job names."""
        if ranks_here(self.cfg):
            return self.world
        return max(1, min(self.world, self.per_node))

    def budget(self) -> tuple[int, str] | None:
        """(tokens per rank, which device said so) for a job with ring.size=auto and no budget
        of its own: the planner's largest per-rank share for the job's device, model, dtype,
        mode and sharding, the smallest over the ring sizes the job may use. None: not sizable
        (no device entry, or a task that does not describe its model)."""
        from .makespan import auto_budget

        device = self.device
        if device is None:
            return None
        try:
            work = self.work
        except Unpriced as err:  # the job runs it; only the planner's budget cannot be had
            raise UserError(f"{err}; give ring.max_tokens_per_rank to size the rings") from None
        if work is None:
            return None
        return auto_budget(work, device, self.world, self.ranks_on_host), str(self.device_name)

    def documents(self, lengths: list[tuple[str, int]]) -> tuple[list[str], list[str]] | None:
        """(problems, warnings) of a long-document job's documents: a document no ring of the
        job can hold (a problem) on its device, or under its own ring.max_tokens_per_rank; a
        predicted time over slurm.time (a warning, with a device). None: neither a device
        entry nor a budget says what a rank holds (``unchecked`` says what the longest one
        needs)."""
        from .scheduler import too_long

        cfg, device, name = self.cfg, self.device, self.device_name
        given = cfg.ring.max_tokens_per_rank  # the job's own budget needs no pricing
        if device is None and not given:
            return None
        work, unread = self._work
        if not lengths or (work is None and not unread):
            return [], []
        budget, fits = self._document_budget
        biggest = self.largest_ring
        of = f" ({name})" if device is not None and not given else ""
        layout = job_layout(cfg)
        problems = [
            too_long(doc, n, [biggest], budget, layout) + of for doc, n in lengths if not fits(n)
        ]
        if device is None or problems or work is None:
            return problems, []
        return problems, self._time_warnings(lengths, work, device, biggest)

    def ring_fits(self):
        """``fits(tokens)``: whether the job's largest ring holds a document of that many
        tokens, on its device or under its own ring.max_tokens_per_rank (what ``documents``
        judges by); None where neither says what a rank holds, or the planner cannot."""
        given = self.cfg.ring.max_tokens_per_rank
        work, unread = self._work
        if (self.device is None and not given) or (work is None and not unread):
            return None
        if unread and not given:  # ``documents`` says why, where there are documents
            return None
        return self._document_budget[1]

    @cached_property
    def _document_budget(self):
        """(tokens per rank, ``fits``) of ``documents``: the job's own budget, else its
        device's as the planner prices it (a model it cannot read raises)."""
        from ringattn.geometry import ring_holds

        from .planner.pricing import max_tokens_per_rank

        given = self.cfg.ring.max_tokens_per_rank
        work, unread = self._work
        biggest, layout = self.largest_ring, job_layout(self.cfg)
        if not given and unread:  # the device's budget is the planner's: it must read the model
            raise unread
        budget = given or max_tokens_per_rank(work, self.device, biggest, self.ranks_on_host)
        return budget, lambda n: ring_holds(n, biggest, budget, layout)

    def _time_warnings(self, lengths, work: Workload, device: Device, biggest: int) -> list[str]:
        """A predicted time over slurm.time, for the job's documents on its rings."""
        from .config import slurm_time_seconds
        from .planner.pricing import document_cost

        cfg = self.cfg
        limit = slurm_time_seconds(cfg.slurm.time) if cfg.slurm.time else None
        if not limit:
            return []
        nodes = max(1, -(-biggest // self.per_node))
        seconds = sum(
            document_cost(n, biggest, work, device, nodes=nodes, ranks_on_host=self.ranks_on_host)
            for _, n in lengths
        )
        seconds /= max(1, self.world // biggest)  # the rings of the job share the documents
        if seconds <= limit:
            return []
        return [
            f"the documents need about {seconds:,.0f} s on {self.world} x {device.name} "
            f"(ringctl plan), over slurm.time={cfg.slurm.time} ({limit:,} s)"
        ]

    def model_state_problem(self) -> str | None:
        """Why a job's ranks cannot hold its model's state (weights; gradients and optimizer
        state when training: the planner's ``state_parts``, sharded as ``model.shard`` says):
        more than any machine holds (a config of 1e12 layers), or, for ranks on this host
        (backend local) with no device entry to plan them, more than this host has. None: it
        fits, or the planner cannot read the model (its fields are checked apart)."""
        from .planner.memory import state_parts
        from .planner.model import total_params

        work, err = self._work
        if isinstance(err, ModelTooLarge):
            return str(err)
        if err is not None or work is None or work.model is None:
            return None
        params = total_params(work.model, work.heads, work.kv_heads, work.head_dim)
        if too_large(params):
            return too_large(params)
        here = ranks_here(self.cfg)
        if not here or self.device is not None:
            return None  # ranks on other hosts, or a device the planner checks them against
        degree = work.shard_degree or self.largest_ring
        per_rank = sum(state_parts(work, degree).values())
        ranks, host = self.world, host_memory()  # local: every rank runs here
        if host is None or per_rank * ranks <= host:
            return None
        return (
            f"the model's state ({params:,} parameters) needs {per_rank / GIB:,.1f} GiB per rank, "
            f"{per_rank * ranks / GIB:,.1f} GiB for the {ranks} ranks on this host, which has "
            f"{host / GIB:,.1f} GiB"
        )

    def unchecked(self, lengths: list[tuple[str, int]]) -> str | None:
        """What the longest document needs per rank of the job's largest ring (the planner's
        memory model needs no device), for a job whose ranks' memory nothing states."""
        from ringattn.geometry import padded_length

        work, err = self._work
        if err is not None or work is None or not lengths:
            return None
        ring = self.largest_ring
        doc, n = max(lengths, key=lambda item: item[1])
        padded = replace(work, seq_len=padded_length(n, world_size=ring, layout=work.layout))
        need = sum(memory_per_rank(padded, ring).values())
        return (
            f"the longest document, {doc!r} ({n:,} tokens at most: its bytes), needs about "
            f"{need / GIB:,.1f} GiB per rank on a ring of {ring}; nothing checks that it fits "
            "(set device=NAME, a `ringctl plan` device, or ring.max_tokens_per_rank)"
        )
