"""The job schema (dataclasses), and loading a job file with command-line overrides.

A job file is YAML; `load_job("jobs/smoke.yaml", ["nodes=4", "slurm.partition=gpu"])` merges the
overrides (OmegaConf dotlist form) over the file, checks every key and type against the schema
below, and returns a typed, read-only `DictConfig`. Anything wrong (an unknown key, a wrong type,
a mandatory `???` value left unset, a value that cannot work) is a `UserError` naming the file or
override and the full key path, raised before anything is written or submitted.

The `task` section is typed by the task it names (`task.name`, see `ringctl.tasks`): each task
brings its own parameter dataclass and may add top-level sections of its own (e.g. `model`).
The backends are asked likewise (`ringctl.backends`): their names, and the sections they declare
(`ssh`), each with its own checks. `slurm` is the batch script's `#SBATCH` header, which every
job's script carries whatever runs it, checked with the header's rules (`ringctl.sbatch`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

from ringattn import switches

from . import job_yaml, sbatch
from .backends import BACKENDS, config_sections
from .errors import UserError
from .sbatch import slurm_time_seconds
from .task_params import DEFAULT_TASK
from .tasks.base import ranks_device, world_size
from .text import ascii_number, echo
from .topology.links import MAX_GBPS

__all__ = [
    "job_layout",
    "load_job",
    "load_recorded",
    "load_resolved",
    "slurm_time_seconds",
    "world_size",
]


# `backend:` takes the name of a registered backend (ringctl.backends.BACKENDS).
BackendName = enum.Enum("BackendName", {name: name for name in BACKENDS}, type=str)


class Layout(str, enum.Enum):
    contiguous = "contiguous"
    zigzag = "zigzag"


class DistBackend(str, enum.Enum):
    auto = "auto"  # nccl where the rank has a CUDA device, gloo otherwise
    gloo = "gloo"
    nccl = "nccl"


class PlacementMode(str, enum.Enum):
    required = "required"  # no placement -> the Slurm job fails, saying so
    optional = "optional"  # no placement -> warn, ranks keep Slurm's task order
    skip = "skip"  # no probe, no placement: ranks in Slurm's task order


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = "00:30:00"  # Slurm's --time (e.g. 90, 1:30:00, 2-00:00:00)
    constraint: str | None = None
    exclusive: bool = False  # --exclusive; with mem unset, --mem=0 too (else Slurm gives an
    # exclusive job all its nodes' CPUs and GPUs but only the memory it asks for, its default)
    switches: str | None = None  # --switches=COUNT[@MAX_WAIT], e.g. "1" or "1@00:10:00"
    cpus_per_task: int | None = None
    mem: str | None = None
    # sent to every rank this long before the time limit: workers finish the current unit of
    # work, write what they have, and exit cleanly (Slurm's --signal=SIG@SECONDS)
    signal: str | None = "USR1@120"
    requeue: bool = False
    extra_sbatch: list[str] = field(default_factory=list)  # "--mail-type=END", one option each


@dataclass
class EnvConfig:
    modules: list[str] = field(default_factory=list)  # `module load` each, in order
    venv: str | None = None  # a virtualenv directory to activate
    conda: str | None = None  # a conda environment (name or path) to activate
    python: str | None = None  # interpreter on the nodes; default: this one (local/slurm)
    container_image: str | None = None  # pyxis: srun --container-image
    container_mounts: list[str] = field(default_factory=list)  # pyxis: SRC:DST (job dir added)
    vars: dict[str, str] = field(default_factory=dict)  # exported before the job steps


@dataclass
class RingConfig:
    layout: Layout = Layout.zigzag
    placement: PlacementMode = PlacementMode.required  # `ring.plan` before 0.2
    dist_backend: DistBackend = DistBackend.auto
    # Many rings per job (ringctl.rings): null = one ring of the whole job; N = rings of N
    # consecutive ranks; auto = each document on the smallest ring that holds it.
    size: Any = None
    max_tokens_per_rank: int | None = None  # auto's budget; default: from `device` (planner)
    ulysses: Any = None  # Ulysses degree inside an NVLink domain: null/1, N or auto
    nvlink_blocks: bool = False  # Slurm topology/block = NVLink domains (GB200/GB300 NVL72)
    network_gbps: float | None = None  # the inter-node rate when the nodes cannot tell it


DEFAULT_OUTPUT_DIR = "runs"  # where jobs go, relative to where ringctl runs


@dataclass
class JobConfig:
    name: str = MISSING
    output_dir: str = DEFAULT_OUTPUT_DIR
    job_dir: str | None = None  # default: <output_dir>/<name>-<YYYYmmdd-HHMMSS>
    backend: BackendName = BackendName.local
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    # `ringctl plan` device table entry of each rank (e.g. H100-SXM); submit checks the job fits
    device: str | None = None
    timeout: float = 300.0  # seconds a collective may wait for a peer before the rank fails
    rendezvous_timeout: float = 600.0  # seconds ranks wait for each other to start
    task: Any = None  # replaced per task by its parameter dataclass
    ring: RingConfig = field(default_factory=RingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # then the backends' sections (`ssh`), and the task's own


def job_schema(task_name: str) -> type:
    """JobConfig with `task` typed by the named task, the backends' sections, and that task's
    extra sections."""
    from . import tasks

    task = tasks.get_task(task_name)
    params = task.params
    fields: list[tuple[str, Any, Any]] = [
        ("task", params, field(default_factory=lambda: params(name=task_name)))
    ]
    for section, cls in {**config_sections(), **task.sections}.items():
        fields.append((section, cls, field(default_factory=cls)))
    return dataclasses.make_dataclass(f"JobConfig_{task_name}", fields, bases=(JobConfig,))


def _first_line(err: OmegaConfBaseException) -> str:
    msg = getattr(err, "msg", None) or str(err)
    return msg.strip().splitlines()[0] if msg.strip() else type(err).__name__


def _describe(err: OmegaConfBaseException, schema: DictConfig | None = None) -> str:
    key = getattr(err, "full_key", None) or ""
    msg = _first_line(err)
    if type(err).__name__ == "ConfigKeyError" and key:
        try:  # a hint only: an interpolation that cannot resolve must not turn it into a crash
            meant = _meant(schema, key) if schema is not None else None
        except OmegaConfBaseException:
            meant = None
        return f"unknown key {key}" + (f" (did you mean {meant}?)" if meant else "")
    if msg.startswith("Merge error:") and " is not a subclass of " in msg:  # task=5
        section = f"{key}: " if key else ""  # OmegaConf names none for a merge
        return (
            f"{section}a single value where a section of keys goes: give its keys (under it "
            "in a file, SECTION.KEY=VALUE on the command line)"
        )
    return f"{key}: {msg}" if key else msg


def _meant(schema: DictConfig, key: str) -> str | None:
    """The key an unknown ``key`` likely meant: a close name beside it (task.seqlen ->
    task.seq_len), else a section holding its name (max_steps -> task.max_steps). OmegaConf's
    own hint came for a file's keys only, not an override's."""
    import difflib

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(schema, parent) if parent else schema
    if isinstance(node, DictConfig):
        close = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=1)
        if close:
            return f"{parent}.{close[0]}" if parent else close[0]
    for section in schema.keys():
        held = schema.get(section)
        if isinstance(held, DictConfig) and leaf in held and str(section) != parent:
            return f"{section}.{leaf}"
    return None


def _task_name(layers: list[tuple[str, DictConfig]]) -> str:
    name = DEFAULT_TASK
    for _, layer in layers:
        given = _named_task(layer)
        name = name if given is None else given
    return name


# Keys renamed since 0.1: still read, with a one-line note (old dotted key -> new one).
RENAMED_KEYS = {"ring.plan": "ring.placement"}


def _renamed(layers, *, quiet: bool = False):
    """Move renamed keys to their new names, saying so once per layer (``quiet``: a second
    reading of layers the first already spoke of)."""
    for source, layer in layers:
        for old, new in RENAMED_KEYS.items():
            old_parent, _, old_leaf = old.rpartition(".")
            parent = OmegaConf.select(layer, old_parent) if old_parent else layer
            if isinstance(parent, DictConfig) and old_leaf in parent:
                value = parent[old_leaf]
                _same_as_new(source, layer, old, new, value)
                layer = OmegaConf.masked_copy(layer, list(layer.keys()))
                parent = OmegaConf.select(layer, old_parent) if old_parent else layer
                del parent[old_leaf]
                OmegaConf.update(layer, new, value, force_add=True)
                if not quiet:
                    print(f"ringctl: {source}: {old} is deprecated, read as {new}", file=sys.stderr)
        yield source, layer


def _same_as_new(source: str, layer: DictConfig, old: str, new: str, value) -> None:
    """A layer giving both a renamed key and its new name: the same value, or refused (the
    old key silently won: `ring.plan: skip` beside `ring.placement: required` ran unplaced)."""
    given = OmegaConf.to_container(layer, resolve=False)  # as written: `${...}` unresolved
    for part in new.split("."):
        given = given.get(part) if isinstance(given, dict) else None
    if given is not None and str(given) != str(value):
        raise UserError(
            f"{source}: {old} (deprecated) is {value!r} and {new} is {given!r}: give {new} only"
        )


def _drop_other_tasks(layers, task_name: str):
    """A `task` section belongs to the task it names: when a later layer switches the task
    (`task.name=train` over a file written for `longdoc`), an earlier section is kept when the
    new task has all its keys (inputs, model_path, dtype: the file's own, not the defaults),
    and refused, naming the keys, when it has not: dropping them ran the job on the bundled
    samples with the random model, without a word. Its `name` goes, which the switch replaces."""
    from . import tasks

    layers = list(layers)
    switch = [source for source, layer in layers if _named_task(layer) == task_name][-1:]
    keys = {f.name for f in dataclasses.fields(tasks.get_task(task_name).params)}
    for source, layer in layers:
        name = _named_task(layer)
        if name is not None and name != task_name:
            task = layer.get("task")
            other = sorted(str(k) for k in task if str(k) not in keys)
            if other:
                raise UserError(
                    f"{switch[0] if switch else source}: task.name={task_name} over the "
                    f"{name} task of {source}, whose task.{', task.'.join(other)} "
                    f"{'is' if len(other) == 1 else 'are'} not {task_name}'s and would be "
                    f"dropped: start from that task's file (`ringctl example {task_name}`), "
                    f"or remove {'it' if len(other) == 1 else 'them'} there"
                )
            layer = OmegaConf.masked_copy(layer, list(layer.keys()))
            del layer.task["name"]
        yield source, layer


def _named_task(layer: DictConfig) -> str | None:
    """The task a layer's `task.name` names, or None."""
    task = layer.get("task") if isinstance(layer, DictConfig) else None
    name = task.get("name") if isinstance(task, DictConfig) else None
    return None if name is None else str(name)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Load, merge and validate a job; a `UserError` names what is wrong and where."""
    from .resources import find_job

    layers = [_file_layer(find_job(path))]
    for item in overrides:
        layers.append((f"override {item!r}", _override(item)))
    return _build(layers)


def _file_layer(path: Path) -> tuple[str, DictConfig]:
    """(source, layer) of a job file: a YAML mapping (``job_yaml``'s rules)."""
    data = job_yaml.load_file(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: a job file must be a YAML mapping of keys to values")
    try:
        return str(path), OmegaConf.create(data)
    except OmegaConfBaseException as err:
        raise UserError(f"{path}: {_first_line(err)}") from None


def _override(item: str) -> DictConfig:
    """``key=value`` as a one-key config; the value read by the job file's YAML rules."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise UserError(f"override {item!r} is not of the form key=value (e.g. nodes=4)")
    source = f"override {item!r}"
    if "" in key.split("."):  # OmegaConf read ring..size as ring: "unknown key ring"
        raise UserError(f"{source}: {key} is not a key (a name is empty between its dots)")
    value = job_yaml.load_text(text, source, what="not a valid value")
    layer = OmegaConf.create()
    try:
        OmegaConf.update(layer, key, value, force_add=True)
    except OmegaConfBaseException as err:
        raise UserError(f"{source}: {_first_line(err)}") from None
    return layer


def load_job_from_dict(data: dict, *, source: str) -> DictConfig:
    """Validate a config given as plain data (e.g. a task's prepared copy) like a job file."""
    return _build([(source, OmegaConf.create(data))])


def load_resolved(path: str | Path) -> DictConfig:
    """Load a job directory's config.yaml (already resolved) with the same checks."""
    return load_job(path)


def load_recorded(path: str | Path) -> tuple[DictConfig, str]:
    """A job directory's config.yaml for the verbs that look at a job or stop it (status,
    logs, cancel, gather): (config, "") by today's checks; where one refuses it (a rule added
    since its release accepted it: ``task.seed: -1``), (the file as written over its task's
    schema, unchecked, the refusal), so that an earlier release's job can still be seen and
    cancelled (every verb refused it, a queued job out of reach). What runs it again (resume,
    the ranks) keeps the checks."""
    try:
        return load_resolved(path), ""
    except UserError as err:
        refused = str(err)
    cfg = _as_written(Path(path))
    if cfg is None:
        raise UserError(refused)
    return cfg, refused


def _as_written(path: Path) -> DictConfig | None:
    """config.yaml merged over its task's schema without the task's and the values' checks
    (None: not even that); the backends' own sections checked still (an ssh.command_timeout
    of .inf hung status)."""
    try:
        # quiet: load_recorded's first reading said a renamed key's note already
        cfg, _, _ = _merged([_file_layer(path)], quiet=True)  # (`???` refused: a traceback)
        for cls in config_sections().values():  # what the backends act on (ssh, slurm)
            cls.check(cfg, lambda key, why: UserError(f"{path}: {key}: {why}"))
    except (UserError, OmegaConfBaseException, TypeError, ValueError, KeyError):
        return None
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _build(layers: list[tuple[str, DictConfig]]) -> DictConfig:
    """The job the layers give (``_merged``), checked and read-only."""
    cfg, prepared, unresolved = _merged(layers)
    _check_typed_given(cfg, prepared, unresolved)
    _check_text_given_as_text(cfg, prepared)
    _check(cfg, lambda key, *also: _source_of(prepared, key, *also))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _merged(
    layers: list[tuple[str, DictConfig]], *, quiet: bool = False
) -> tuple[DictConfig, list, dict]:
    """(the layers merged over their task's schema and resolved, the layers as merged, the
    merge before interpolation): no value checked but what the merge and a ``???`` refuse."""
    from . import tasks

    task_name = _task_name(layers)
    if task_name not in tasks.TASKS:
        source = [s for s, layer in layers if "task" in layer][-1:] or ["the job"]
        known = ", ".join(sorted(tasks.TASKS))
        raise UserError(f"{source[0]}: task.name: unknown task {task_name!r} (known: {known})")
    cfg = OmegaConf.structured(job_schema(task_name))
    prepared = list(_drop_other_tasks(_renamed(layers, quiet=quiet), task_name))
    for source, layer in prepared:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as err:
            raise UserError(f"{source}: {_describe(err, cfg)}") from None
        except (TypeError, ValueError) as err:  # e.g. a list where the schema has a mapping
            raise UserError(f"{source}: {_shape_error(cfg, layer) or err}") from None
    unfilled = _marked_unfilled(prepared)
    unresolved = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    try:
        missing = sorted(set(OmegaConf.missing_keys(cfg)) | set(unfilled))
        if not missing:
            OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:  # an interpolation (`${...}`) that cannot resolve
        key = getattr(err, "full_key", None) or ""
        raise UserError(f"{_source_of(prepared, key)}: {_describe(err)}") from None
    if missing:
        sources = {unfilled.get(key, layers[0][0]) for key in missing}
        source = sources.pop() if len(sources) == 1 else layers[0][0]
        keys = ", ".join(
            f"{key} (marked in {unfilled.get(key, layers[0][0])})" if len(sources) > 1 else key
            for key in missing
        )
        raise UserError(
            f"{source}: missing mandatory value{'s' if len(missing) > 1 else ''}: {keys} "
            f"(set {'them' if len(missing) > 1 else 'it'} in the file or on the command line, "
            f"e.g. {_settable(missing[0])}=...)"
        )
    return cfg, prepared, unresolved


def _settable(key: str) -> str:
    """The key an override sets for a missing ``key``: a list's own (``env.modules[0]`` is no
    override's key: ``env.modules=[...]`` sets the list)."""
    return key.split("[", 1)[0]


def _marked_unfilled(layers: list[tuple[str, DictConfig]]) -> dict[str, str]:
    """{key: the file or override that marked it} for each value marked `???` (to be given)
    that no later file or override gives. OmegaConf's merge keeps what lies below a `???`
    (the schema's default): a job file's `inputs: ???` scored the bundled samples, its
    `model_path: ???` with the random tiny model, exit 0."""
    left: dict[str, str] = {}
    for source, layer in layers:
        for key, value in _given(_plain(layer), ""):
            empty = isinstance(value, dict)  # `{}`: fills a mark on itself, none below it
            for marked in list(left):
                filled_below = key.startswith(f"{marked}.")  # K.x given: mapping K is given
                if marked == key or filled_below or (marked.startswith(f"{key}.") and not empty):
                    del left[marked]
            if value == MISSING_VALUE:
                left[key] = source
    return left


def _given(node: Any, prefix: str):
    """(key, value) of what a layer gives: a mapping's entries one by one, an empty mapping
    as itself (merged, it gives no key below it), a list whole."""
    if isinstance(node, dict) and (node or not prefix):
        for key, value in node.items():
            yield from _given(value, _join(prefix, key))
    elif prefix:
        yield prefix, node


MISSING_VALUE = "???"  # OmegaConf's mark of a value that must be given


def _check_text_given_as_text(cfg: DictConfig, layers: list[tuple[str, DictConfig]]) -> None:
    """A text field (a partition, an env var's value, a module) given a YAML boolean, float,
    list or mapping: the schema would turn it into Python's spelling of it (``yes`` -> True,
    ``false`` -> ``export X=False``, ``[0, 1]`` -> ``'[0, 1]'``, ``1e3`` -> ``1000.0``), which is
    not what was written. Refused, naming the last file or override that set it; an integer
    means its decimal digits."""
    for key, value in _containers_in_text_slots(cfg, ""):
        raise UserError(
            f"{_source_of(layers, key)}: {key}: expected text, got the YAML "
            f"{'list' if isinstance(value, list) else 'mapping'} {value!r}: quote it to mean "
            "the text as written"
        )
    merged = OmegaConf.to_container(cfg, resolve=False)
    seen: set[str] = set()
    for source, layer in reversed(layers):
        for key, given, have in _given_where_text(merged, _plain(layer), ""):
            if key in seen:
                continue
            seen.add(key)
            if isinstance(given, bool) or not isinstance(given, (str, int)):
                kind = {bool: "boolean", float: "number", list: "list", dict: "mapping"}
                raise UserError(
                    f"{source}: {key}: expected text, got the YAML "
                    f"{kind.get(type(given), type(given).__name__)} {given!r} (read as "
                    f"{have!r}): quote it to mean the text as written"
                )


_TYPED_NODES = ((BooleanNode, bool), (IntegerNode, int), (FloatNode, float))


def _typed_slots(node: Any, prefix: str):
    """(key, bool, int or float) for each field the schema types as one of them."""
    if not isinstance(node, DictConfig) or node._is_none():
        return
    for key in node.keys():
        child = node._get_node(key)
        path = _join(prefix, key)
        kinds = [kind for cls, kind in _TYPED_NODES if isinstance(child, cls)]
        if kinds:
            yield path, kinds[0]
        else:
            yield from _typed_slots(child, path)


def _check_typed_given(cfg: DictConfig, layers: list[tuple[str, DictConfig]], unresolved) -> None:
    """A boolean or number field given anything but its type or its YAML 1.2 core text
    (``job_yaml.typed_text_problem``: OmegaConf took ``requeue: '0123'`` or ``causal: -1`` for
    true, ``nodes: '٤'`` for 4), naming the last file or override that set it. An
    interpolation is judged by the text it gives (``unresolved``: the merged config before
    interpolation, read without the schema's types)."""
    slots = dict(_typed_slots(cfg, ""))
    raw: DictConfig | None = None
    seen: set[str] = set()
    for source, layer in reversed(layers):
        for key, given in _given(_plain(layer), ""):
            if key not in slots or key in seen:
                continue
            seen.add(key)
            if isinstance(given, str) and "${" in given:
                raw = raw if raw is not None else OmegaConf.create(unresolved)
                given = OmegaConf.select(raw, key)
            why = job_yaml.typed_text_problem(given, slots[key])
            if why:
                raise UserError(f"{source}: {key}: {why}")


def _containers_in_text_slots(node: Any, prefix: str):
    """(key, value) of each list or mapping the schema holds where it wants text (an env var's
    value, a module): OmegaConf keeps them as containers there, and a template prints them."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return
    text = node._metadata.element_type is str
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        child = node._get_node(key)
        path = f"{prefix}[{key}]" if isinstance(node, ListConfig) else _join(prefix, key)
        if text and isinstance(child, (DictConfig, ListConfig)):
            yield path, OmegaConf.to_container(child, resolve=False)
        else:
            yield from _containers_in_text_slots(child, path)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _given_where_text(have: Any, given: Any, prefix: str):
    """(key, value given, value merged) for each place a layer sets where the job holds text."""
    if isinstance(have, str):
        yield prefix, given, have
    elif isinstance(have, dict) and isinstance(given, dict):
        for key, value in given.items():
            if key in have:
                yield from _given_where_text(have[key], value, _join(prefix, key))
    elif isinstance(have, list) and isinstance(given, list) and len(have) == len(given):
        for i, (a, b) in enumerate(zip(have, given, strict=True)):
            yield from _given_where_text(a, b, f"{prefix}[{i}]")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node


def _shape_error(cfg: DictConfig, layer: DictConfig) -> str | None:
    """The key where a layer gives a list for a mapping (or the reverse), said in one line."""

    def walk(have: Any, give: Any, prefix: str) -> str | None:
        if not isinstance(have, dict) or not isinstance(give, dict):
            return None
        for key, value in give.items():
            path = _join(prefix, key)
            if key not in have:
                continue
            old = have[key]
            if isinstance(old, dict) and not isinstance(value, dict):
                return f"{path}: expected a mapping of keys to values, got {value!r}"
            if isinstance(old, list) and not isinstance(value, list):
                return f"{path}: expected a list, got {value!r}"
            found = walk(old, value, path)
            if found:
                return found
        return None

    return walk(_plain(cfg), _plain(layer), "")


_PATH_PART = re.compile(r"([^.\[\]]+)|\[([0-9]+)\]")


def _source_of(layers: list[tuple[str, DictConfig]], key: str, *also: str) -> str:
    """The file or override that set `key` last (the first file when none did: a default);
    with ``also``, the keys a check read beside it, the latest of their sources: `nodes=3`
    typed on the command line, not the bundled file's task.seq_len it cannot split."""
    return layers[max(_layer_of(layers, k) for k in (key, *also))][0]


def _layer_of(layers: list[tuple[str, DictConfig]], key: str) -> int:
    """The index of the last layer that sets `key` (0 when none does)."""
    parts = [(m.group(1), m.group(2)) for m in _PATH_PART.finditer(key)]
    for at in range(len(layers) - 1, -1, -1):
        node: Any = _plain(layers[at][1])
        for name, index in parts:
            if name is not None and isinstance(node, dict) and name in node:
                node = node[name]
            elif index is not None and isinstance(node, list) and int(index) < len(node):
                node = node[int(index)]
            else:
                break
        else:
            if parts:
                return at
    return 0


_ONE_LINE = re.compile(r"[^\n\r\x00]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_TIMEOUT_S = 365 * 86400.0
MAX_RANKS = 1 << 20  # a job's world: a million ranks (the largest machines have ~10^5 GPUs)

# Names the batch script (templates/slurm.sh.j2) sets or reads, and the ranks' identity: an
# env.vars entry of one of them would change which directory runs, which nodes a probe
# visits, the rendezvous, or a rank's place (tests/test_render.py reads the template's names).
SCRIPT_NAMES = frozenset(
    {
        "JOB_DIR",
        "PY",
        "NODES",
        "NODE_ARGS",
        "CONTAINER",
        "RUN_ONE",
        "PLACED",
        "UNPLACED",
        "UNPROBED",
        "SHOWN",
        "PROBE_MINUTES",
        "SRUN_CPUS_PER_TASK",
        "RC",
        "RESTARTS",
        "KEPT",
        "BATCH_LOG",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RINGCTL_RUN_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "PYTHONUNBUFFERED",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "SLURMD_NODENAME",
        "SLURM_RESTART_COUNT",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NTASKS",
    }
)
SLURM_JOB_PREFIXES = ("SLURM_JOB_", "SLURM_STEP_")  # the job's own facts, set by Slurm


def reserved_env_name(name: str) -> str | None:
    """Why ``name`` cannot be an ``env.vars`` entry, or None."""
    if name == "SRUN_CPUS_PER_TASK":
        return "is what the batch script exports from slurm.cpus_per_task: set that instead"
    if name in SCRIPT_NAMES or name.startswith(SLURM_JOB_PREFIXES):
        return (
            "is set or read by the job's batch script or its ranks (the job's directory, nodes, "
            "rendezvous or ranks); it cannot be given"
        )
    return None


PROBE_MINUTES_MAX = 24 * 60


def probe_minutes(cfg) -> int:
    """srun's --time for the node probe step: env.vars.RINGCTL_PROBE_MINUTES (checked at load),
    else 5, or 20 where the step first imports a container image. Written into the script as a
    number: read there from the environment, a submitting shell's RINGCTL_PROBE_MINUTES=0
    (sbatch exports it) was no bound at all."""
    given = cfg.env.vars.get("RINGCTL_PROBE_MINUTES")
    if given is not None:
        return int(ascii_number(str(given), 9))
    return 20 if cfg.env.container_image else 5


def _env_value_problem(name: str, value) -> str | None:
    """Why an env.vars value that ringctl or the engine reads cannot be taken, or None:
    RINGCTL_PROBE_MINUTES is srun's --time for the probe step (0 would be no bound); the
    engine's switches (RINGATTN_KERNEL, RINGATTN_TRANSPORT) take their named values only."""
    if name in switches.CHOICES:
        try:
            switches.choice(name, str(value))
        except ValueError:
            return f"must be one of {', '.join(switches.CHOICES[name])}, got {value!r}"
        return None
    if name != "RINGCTL_PROBE_MINUTES":
        return None
    minutes = ascii_number(str(value), 9)
    if minutes is not None and 1 <= minutes <= PROBE_MINUTES_MAX:
        return None
    return f"must be a whole number of minutes from 1 to {PROBE_MINUTES_MAX}, got {value!r}"


def _check(cfg: DictConfig, source_of) -> None:
    """Checks a type cannot express; nothing past here should fail for a reason in the config.
    `source_of(key, *also)` names the file or override the value came from (the latest of
    theirs where a check reads other keys beside it: ``bad(key, why, *also)``)."""

    def bad(key: str, why: str, *also: str) -> UserError:
        return UserError(f"{source_of(key, *also)}: {key}: {why}")

    # Values that reach a batch script: one line each, or the line structure breaks.
    for key, value in _leaves(OmegaConf.to_container(cfg, enum_to_str=True)):
        if isinstance(value, str) and not _ONE_LINE.fullmatch(value):
            raise bad(key, "must be a single line (no newline or NUL characters)")
        if isinstance(value, str) and "${" in value:
            raise bad(
                key,
                "holds '${' after interpolation (an escaped \\${...}): the job's config.yaml "
                "is read again on the nodes, which would interpolate it there; write the "
                "value without '${'",
            )
    for var in cfg.env.vars:
        if not _ENV_NAME.fullmatch(str(var)):
            shown = var if _ONE_LINE.fullmatch(var) and var.isprintable() else repr(var)
            where = source_of(f"env.vars.{var}")
            raise UserError(f"{where}: env.vars.{shown}: is not a valid environment variable name")
        why = reserved_env_name(str(var)) or _env_value_problem(str(var), cfg.env.vars[var])
        if why:
            raise bad(f"env.vars.{var}", why)
    kernel = cfg.env.vars.get(switches.KERNEL)
    device = ranks_device(cfg)
    wrong = (
        kernel
        and device
        and switches.kernel_device_problem(switches.choice(switches.KERNEL, str(kernel)), device)
    )
    if wrong:
        keys = ("gpus_per_node", "ring.dist_backend", "backend")
        raise bad(
            f"env.vars.{switches.KERNEL}", f"{wrong} (gpus_per_node={cfg.gpus_per_node})", *keys
        )
    if not str(cfg.name).strip():
        raise bad("name", "must not be empty")
    _check_int64(cfg, bad)
    _check_env(cfg, bad)
    _check_numbers(cfg, bad)
    _check_ring(cfg, bad)
    for cls in config_sections().values():
        cls.check(cfg, bad)
    for key in ("output_dir", "job_dir"):
        value = OmegaConf.select(cfg, key)
        why = sbatch.path_problem(str(value)) if value is not None else None
        if why:
            raise bad(key, why)
    mounted = ("output_dir", "job_dir", "ssh.remote_dir")  # under the job directory pyxis mounts
    for key in mounted if cfg.env.container_image else ():
        value = OmegaConf.select(cfg, key)
        if value is not None and set(str(value)) & {",", ":"}:
            raise bad(key, "holds ',' or ':', which pyxis reads as --container-mounts separators")
    sbatch.check_config(cfg, bad)
    if cfg.slurm.signal and cfg.slurm.time:
        limit = slurm_time_seconds(cfg.slurm.time)
        _, seconds = sbatch.signal_lead(str(cfg.slurm.signal))
        if limit is not None and seconds >= limit:
            raise bad(
                "slurm.signal",
                f"{cfg.slurm.signal} would fire {seconds}s before a {cfg.slurm.time} time limit, "
                "i.e. at once; give a shorter lead or slurm.signal=null",
            )
    from . import tasks

    tasks.get_task(cfg.task.name).check(cfg, bad)


INT64 = 1 << 63  # an integer field is a 64-bit signed number: torch, numpy, json readers


def _check_int64(cfg: DictConfig, bad) -> None:
    """Every integer field within a 64-bit signed number, the widest any reader of the job
    holds (``torch.Generator.manual_seed`` failed on every rank past it); a task bounds its
    own sizes tighter (``task_params.int_problem``)."""
    for key, kind in _typed_slots(cfg, ""):
        value = OmegaConf.select(cfg, key) if kind is int else None
        if value is not None and not -INT64 <= value < INT64:
            raise bad(key, f"{value} is out of range (an integer field holds -2**63 to 2**63-1)")


def _check_env(cfg: DictConfig, bad) -> None:
    """Module names and the environment's paths as the batch script and the local backend
    read them alike."""
    for i, module in enumerate(cfg.env.modules):
        if str(module).startswith("-"):
            raise bad(
                f"env.modules[{i}]",
                f"{echo(module)} begins with '-', which `module load` reads as an option; "
                "give module names only",
            )
    for key in ("python", "venv", "conda"):
        value = cfg.env[key]
        if value is not None and _home_of_another(str(value)):
            raise bad(
                f"env.{key}",
                f"{echo(value)}: ~user is kept as written by the batch script (only ~ and ~/ "
                "are the home directory there) and read as that user's home on this machine; "
                "write the path in full",
            )


def _home_of_another(path: str) -> bool:
    """Whether ``path`` begins with ``~user`` (``render.quote_path`` reads only ``~``, ``~/``)."""
    return path.startswith("~") and path != "~" and not path.startswith("~/")


def _check_ring(cfg: DictConfig, bad) -> None:
    """ring.size / ulysses: null, auto or a count that divides the job; budgets positive."""
    world = world_size(cfg)
    for key in ("size", "ulysses"):
        value = cfg.ring[key]
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"ring.{key}", f"expected null, auto or a number of ranks, got {value!r}")
        if world % value:
            why = f"{value} does not divide the job's {world} ranks"
            raise bad(f"ring.{key}", why, "nodes", "tasks_per_node")
    if isinstance(cfg.ring.size, int) and cfg.ring.ulysses not in (None, 1):
        raise bad("ring.ulysses", "a Ulysses degree and a numeric ring.size cannot be combined")
    _check_budget(cfg, bad)
    rate = cfg.ring.network_gbps
    if rate is not None and not (math.isfinite(rate) and 0 < rate <= MAX_GBPS):
        raise bad(  # the placement's own cap (topology.links), found at submit, not queued
            "ring.network_gbps", f"must be a positive number up to {MAX_GBPS:g} Gbit/s, got {rate}"
        )


def job_layout(cfg) -> str:
    """The layout a job's sequences are sharded in: the task's own (``task.layout``) where
    its schema has one and it is set, else ``ring.layout``. The one rule of the tasks, the
    planner's workload and the budget check."""
    return str(OmegaConf.select(cfg, "task.layout", default=None) or cfg.ring.layout.value)


def _check_budget(cfg: DictConfig, bad) -> None:
    """ring.max_tokens_per_rank: at least the rows every rank of the job's layout holds
    (``ringattn.geometry.chunks_per_rank``: 2 for zigzag). Below it no ring holds a token, and
    the search for a ring that would (``ranks_needed``) once never ended: submit hung."""
    from ringattn.geometry import LAYOUTS, chunks_per_rank

    budget = cfg.ring.max_tokens_per_rank
    if budget is None:
        return
    layout = job_layout(cfg)
    least = chunks_per_rank(layout) if layout in LAYOUTS else 1  # another: the task refuses it
    if budget < least:
        raise bad(
            "ring.max_tokens_per_rank",
            f"must be at least {least} (or null): every rank of the {layout} layout holds "
            f"{least} rows or more, got {budget}",
        )


def _check_numbers(cfg: DictConfig, bad) -> None:
    """Counts, ports and timeouts: in range, and finite (a YAML `nan` or `inf` is a float)."""
    for key in ("nodes", "tasks_per_node"):
        if cfg[key] < 1:
            raise bad(key, f"must be at least 1, got {cfg[key]}")
    if cfg.nodes * cfg.tasks_per_node > MAX_RANKS:
        raise bad(
            "nodes",
            f"{cfg.nodes} nodes x {cfg.tasks_per_node} tasks is more than {MAX_RANKS:,} ranks",
        )
    if cfg.gpus_per_node < 0:
        raise bad("gpus_per_node", f"must be 0 or more, got {cfg.gpus_per_node}")
    if 0 < cfg.gpus_per_node < cfg.tasks_per_node:
        raise bad(
            "tasks_per_node",
            f"{cfg.tasks_per_node} ranks a node share {cfg.gpus_per_node} GPUs: each rank "
            "takes one GPU (NCCL refuses two ranks on one); set tasks_per_node <= "
            "gpus_per_node",
            "gpus_per_node",
        )
    if cfg.slurm.cpus_per_task is not None and cfg.slurm.cpus_per_task < 1:
        raise bad(
            "slurm.cpus_per_task", f"must be at least 1 (or null), got {cfg.slurm.cpus_per_task}"
        )
    seconds = [f"{name}.{key}" for name, cls in config_sections().items() for key in cls.seconds]
    for key in ("timeout", "rendezvous_timeout", *seconds):
        value = OmegaConf.select(cfg, key)
        if not (math.isfinite(value) and 1 <= value <= MAX_TIMEOUT_S):
            raise bad(key, f"must be a number of seconds from 1 to 365 days, got {value}")


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, _join(prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


def to_plain(cfg: DictConfig) -> dict:
    """The config as plain dicts/lists/str (enums as their names), e.g. for templates."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def safe_dir_name(name: str) -> str:
    """A job name turned into something safe for a directory name."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return cleaned[:80] or "job"
