"""Submitting a job: the layer between the verbs (ringctl/commands) and the machinery.

``submit_job`` loads a job file, lets its task prepare it, checks that this Python can import
what the task needs, sizes it once (``ringctl.sizing.Sizing``: the per-rank budget of
``ring.size=auto``, whether the ranks hold it, whether they hold its documents), renders the
batch script, creates the job directory (``JobDir``) and hands it to the backend; a refusal
creates nothing. ``resume_job`` submits an ended job again into its own directory.
``open_job_dir`` gives (job, cfg, backend) for an existing directory. The verbs parse
arguments and print; they import this module, never each other.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import __version__
from .atomic import atomic_write, atomic_write_json, default_dir_mode
from .backends import backend_class, backend_of, files_here
from .backends.base import Backend, JobState, JobStatus
from .config import load_job, load_job_from_dict, safe_dir_name, to_yaml
from .errors import Interrupted, NotSubmitted, SubmittedNotRecorded, UserError
from .jobdir import CONFIG, META, SCRIPT, JobDir
from .sizing import Sizing
from .tasks import get_task
from .tasks.base import engine_switches
from .terminal import visible

__all__ = [
    "NOT_RESUME_KEYS",
    "RESUME_KEYS",
    "check_documents",
    "check_model_state",
    "check_packages",
    "check_plan",
    "checked_for_submission",
    "get_backend",
    "open_job_dir",
    "resume_job",
    "submit_job",
    "with_ring_budget",
]


def get_backend(cfg, name: str | None = None) -> Backend:
    """The backend `name` (default: the config's) for a resolved job config."""
    name = name or cfg.backend.value
    try:
        cls = backend_class(name)
    except (KeyError, ModuleNotFoundError) as err:
        if isinstance(err, ModuleNotFoundError) and not (err.name or "").startswith("ringctl."):
            raise
        raise UserError(f"backend {name!r} is not available in this installation") from None
    return cls.create(cfg)


def open_job_dir(path: str | Path, *, checked: bool = False) -> tuple[JobDir, object, Backend]:
    """(job, cfg, backend) for an existing job directory (a one-line error if it is not).
    Its config by today's checks where ``checked`` (what runs it again: resume), else as its
    release wrote it where a rule added since refuses it, said (``config.load_recorded``)."""
    from .config import load_recorded, load_resolved

    job = JobDir.open(path)
    if checked:
        cfg = load_resolved(job.config)
    else:
        cfg, refused = load_recorded(job.config)
        if refused:
            print(f"note: {refused} (read as written; a resume checks it)", file=sys.stderr)
    return job, cfg, get_backend(cfg, _recorded_backend(job, cfg.backend.value))


def _recorded_backend(job: JobDir, configured: str) -> str:
    """The backend job.json records (the config's where it records none): the one the config
    names, else one line naming the file and key. A list there was a traceback in every verb,
    and "ssh" beside a local config said "ssh.host: is required"."""
    recorded = job.read_meta().get("backend")
    if recorded in (None, ""):
        return configured
    if recorded != configured:
        raise UserError(
            f"{job.meta_file}: backend: {recorded!r}, but {job.config.name} says "
            f"{configured!r} (a job keeps the backend it was submitted with)"
        )
    return recorded


def check_plan(sizing: Sizing, *, force: bool = False) -> None:
    """Refuse, with the plan's reason, a job whose ranks cannot hold their share."""
    verdict = sizing.preflight()
    if verdict is None:
        return
    est = verdict.estimate
    if not est.fits:
        if not force:
            raise UserError(
                f"ringctl plan ({verdict.device}): {verdict.reason}. Nothing was submitted; "
                "give more ranks, a shorter sequence, or --force to submit anyway"
            )
        print(f"warning: submitting despite the plan (--force): {verdict.reason}", file=sys.stderr)
    elif est.warnings:
        print(f"plan ({verdict.device}): {verdict.reason}", file=sys.stderr)


def refuse_unless_forced(why: str | None, *, force: bool, forced: str, anyway: str) -> None:
    """A submit check's verdict: nothing (``why`` None), a refusal saying --force would
    ``anyway``, or with --force a warning that it is submitted ``forced``."""
    if why is None:
        return
    if not force:
        raise UserError(f"{why}. Nothing was submitted; --force to submit {anyway}")
    print(f"warning: submitting {forced} (--force): {why}", file=sys.stderr)


def check_device(sizing: Sizing, *, force: bool = False) -> None:
    """Refuse a job whose device the planner's table does not know (``device_problem``);
    --force submits it unplanned (a device known on the cluster's side only)."""
    why = sizing.device_problem()
    refuse_unless_forced(why, force=force, forced="unplanned", anyway="it unplanned")


def check_model_state(sizing: Sizing, *, force: bool = False) -> None:
    """Refuse a job whose ranks could not hold its model (``Sizing.model_state_problem``:
    absurd sizes anywhere, more than this host has for local ranks) when no device entry plans
    it; --force submits anyway."""
    why = sizing.model_state_problem()
    refuse_unless_forced(why, force=force, forced="despite it", anyway="anyway")


def with_ring_budget(sizing: Sizing, source: str) -> Sizing:
    """ring.size=auto needs a per-rank token budget: the job's own, else the planner's for its
    `device` (written into the submitted config, and said), else a one-line refusal. Returns
    the sizing of the config as submitted."""
    from omegaconf import OmegaConf

    cfg = sizing.cfg
    ring = cfg.ring
    if ring.size != "auto" or ring.max_tokens_per_rank is not None:
        return sizing
    derived = sizing.budget()
    if derived is None:
        raise UserError(
            f"{source}: ring.max_tokens_per_rank: ring.size=auto needs a per-rank token budget: "
            "set it, or set device=... (a `ringctl plan` device) for the planner to derive one"
        )
    budget, device = derived
    if budget < 1:
        raise UserError(f"{source}: ring.size=auto: the model alone does not fit one {device}")
    print(f"ring.max_tokens_per_rank={budget} (from the planner: {device})", file=sys.stderr)
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    data["ring"]["max_tokens_per_rank"] = budget
    return sizing.with_config(load_job_from_dict(data, source=source))


def check_documents(sizing: Sizing, *, force: bool = False) -> None:
    """A job whose task lists its documents (a long-document job) with documents its device
    (or its own ring.max_tokens_per_rank) cannot hold is refused (--force to insist); one
    predicted to outlast slurm.time is warned about, and refused under
    ring.placement=required. With neither, what the longest document needs is said. Lengths
    are the task's ``document_lengths`` (``longdoc.schedule``: bytes, a byte-tokenizer's count;
    a model's tokenizer gives fewer tokens, and a document whose bytes no ring holds is counted
    with it: ``ring_fits``), the bundled samples included (a budget of 2,000 passed submit and
    failed on the ranks). A task with no documents (the attention task) lists none: nothing to
    check."""
    cfg = sizing.cfg
    lengths = get_task(str(cfg.task.name)).document_lengths(cfg, fits=sizing.ring_fits())
    if not lengths:
        return
    verdict = sizing.documents(lengths)
    if verdict is None:  # nothing says what a rank holds: said for the job's own inputs (the
        said = sizing.unchecked(lengths)  # bundled samples fit the demo, which said nothing)
        if said and cfg.task.get("inputs") is not None:
            print(f"warning: {said}", file=sys.stderr)
        return
    problems, warnings = verdict
    who = f"ringctl plan ({cfg.device})" if cfg.device else "ring.max_tokens_per_rank"
    strict = cfg.ring.placement.value == "required"
    for why in problems + (warnings if strict else []):
        if not force:
            raise UserError(f"{who}: {why}. Nothing was submitted; --force to submit anyway")
    for why in problems + warnings:
        print(f"warning: {who}: {why}", file=sys.stderr)


def check_packages(cfg) -> None:
    """Refuse a job whose task needs a package this Python cannot import, before anything is
    created. Only where the job runs this interpreter (a backend that sets up no environment,
    ``Backend.sets_up_env``, with no env.python, whatever else env names: ``unset_up_env``
    says so; slurm with no other env)."""
    from .backends.local import unset_up_env

    env = cfg.env
    set_up = backend_of(cfg).sets_up_env
    unused = "" if set_up else unset_up_env(cfg)
    if unused:
        print(f"warning: {unused}", file=sys.stderr)
    elsewhere = env.python or (set_up and (env.venv or env.conda or env.container_image))
    if files_here(cfg):  # the ranks inherit this shell's environment, whatever python runs
        engine_switches(cfg)
    if not files_here(cfg) or elsewhere:
        return
    missing = get_task(str(cfg.task.name)).missing_packages(cfg)
    if missing:
        module, install = missing[0]
        raise UserError(
            f"task {cfg.task.name} needs {module}, which {sys.executable} cannot import: "
            f"{install}. Nothing was submitted"
        )


def checked_for_submission(cfg, source: str, *, force: bool = False):
    """Every check a job passes before it is (re)submitted, and its config as it will run
    (with the planner's ring budget when it asked for one): the task's packages, the plan,
    the model's state, the documents. Submit and resume both call it, so a resume that
    changes how a job runs is refused in one line where a new job would be, not on its
    ranks; --force as for submit."""
    check_packages(cfg)
    sizing = Sizing(cfg)
    check_device(sizing, force=force)  # before a budget is derived from it
    sizing = with_ring_budget(sizing, source)  # the one sizing of this job (as it will run)
    check_plan(sizing, force=force)
    check_model_state(sizing, force=force)
    check_documents(sizing, force=force)
    return sizing.cfg


def _job_files(cfg, script: str, job_file: str, overrides: list[str], backend: Backend) -> dict:
    meta = {
        "backend": backend.name,
        "name": str(cfg.name),
        "source": str(job_file),
        "overrides": list(overrides),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ringctl_version": __version__,
    }
    return {
        CONFIG: to_yaml(cfg),
        SCRIPT: script,
        META: json.dumps(meta, indent=2, sort_keys=True) + "\n",
    }


def submit_job(job_file: str, overrides: list[str], *, force: bool = False):
    """Load, check, render, create the job directory, submit. Returns (job, job_id, backend).
    A submission that fails leaves no job directory behind, unless it may have queued the
    job (a timeout, no id printed, no exit status): the directory stays, marked."""
    from .render import render_script

    cfg = load_job(job_file, overrides)
    prepared = get_task(str(cfg.task.name)).prepare(cfg)
    if prepared is not cfg:  # re-validated: what is written is what was checked
        cfg = load_job_from_dict(prepared, source=str(job_file))
    cfg = checked_for_submission(cfg, str(job_file), force=force)
    script = render_script(cfg)  # before anything is written: a template error stops here
    backend = get_backend(cfg)
    backend.check_named_files(get_task(str(cfg.task.name)).named_files(cfg))
    target = Path(str(cfg.job_dir)).expanduser() if cfg.job_dir else None
    stem = f"{safe_dir_name(str(cfg.name))}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    job = JobDir.create(
        _job_files(cfg, script, job_file, overrides, backend),
        target=target,
        base=Path(str(cfg.output_dir)).expanduser(),
        stem=stem,
    )
    try:
        job.update_meta(local_dir=str(job.path))
        job_id = backend.submit(job.path)
    except SubmittedNotRecorded:
        raise  # queued: the job needs its directory
    except NotSubmitted:
        shutil.rmtree(job.path, ignore_errors=True)  # the backend started nothing
        raise
    except UserError as err:  # sbatch timing out, a connection dropped while it ran, no id
        job.mark_submission_unknown()
        kept = type(err)(  # a Ctrl-C while sbatch ran keeps its exit status (Interrupted)
            f"{err}; the job may have been queued: its directory {job.path} is kept, naming "
            "no job (look for it with squeue --me and cancel it if it is there, then `ringctl "
            f"resume --force {job.path}` runs it, or delete the directory)"
        )
        raise kept from None
    except BaseException as err:
        _drop_unless_named(job, err)
        raise
    job.record_submission(str(job_id), backend.cancel_command(job.path, str(job_id)))
    return job.path, str(job_id), backend


def _drop_unless_named(job: JobDir, err: BaseException) -> None:
    """After a submission failed unexpectedly (a Ctrl-C, a disk that filled, a bug): remove
    the job directory, unless job.json already names the job the backend queued (Slurm's id
    is recorded before the cluster's clock is read): then it stays, and a Ctrl-C says which
    job runs (a Ctrl-C there removed the directory of a job Slurm went on to run)."""
    try:
        job_id = job.read_meta().get("job_id")
    except (OSError, UserError):
        job_id = None
    if not job_id:
        shutil.rmtree(job.path, ignore_errors=True)
        return
    if isinstance(err, KeyboardInterrupt):
        raise Interrupted(
            f"interrupted after job {job_id} was submitted: {job.path} names it (`ringctl "
            f"cancel {job.path}` if it is unwanted)"
        ) from None


# What a resume may change: how the job runs, never what it computes or where it lives.
# NOT_RESUME_KEYS are the exceptions inside those prefixes.
RESUME_KEYS = (
    "nodes",
    "tasks_per_node",
    "gpus_per_node",
    "device",
    "timeout",
    "rendezvous_timeout",
    "ring.",
    "slurm.",
    "env.",
    "task.on_changed_input",  # a resume may ask to refuse changed inputs instead of redoing
)
# What the outputs already written depend on: the layout is in a long-document job's run.json
# (its signature), and a resume with another layout failed on every rank, for good.
NOT_RESUME_KEYS = ("ring.layout",)


def _resume_key_problem(item: str, cfg=None) -> str | None:
    """Why resume may not take the override ``item`` (key=value), or None; the keys it may
    change named as ``cfg`` (the job's config, when given) has them."""

    key = item.split("=", 1)[0].strip()
    own = get_task(str(cfg.task.name)).resume_keys if cfg is not None else ()
    if key in own:  # how this task's runs may change, its results the same
        return None
    if key in NOT_RESUME_KEYS:
        return (
            f"override {item!r}: a resume may not change {key}: the outputs already written "
            "were computed with the job's; run a new job for another"
        )
    if not key.startswith(RESUME_KEYS) and key not in RESUME_KEYS:
        names = [k.rstrip(".") for k in RESUME_KEYS] + list(own)
        if cfg is not None:  # task.on_changed_input is a long-document job's alone
            names = [k for k in names if _has_key(cfg, k)]
        more = (  # a training run's schedule is over max_steps: more steps are another run
            "; to train further, `ringctl gather` it and run a new job with "
            "task.model_path=JOBDIR/gathered/model (the optimizer's state starts afresh)"
            if key == "task.max_steps"
            else ""
        )
        return (
            f"override {item!r}: a resume may change how the job runs "
            f"({', '.join(names)}), not {key}; the outputs must stay those of the same run" + more
        )
    return None


def _has_key(cfg, key: str) -> bool:
    """Whether the config has ``key`` (dotted), whatever its value (None included)."""
    from omegaconf import OmegaConf

    absent = object()
    return bool(key) and OmegaConf.select(cfg, key, default=absent) is not absent


def _check_resume_key(job: JobDir, cfg, item: str) -> None:
    """Refuse an override resume may not take (``cfg``: the job's config as it stands). The
    whitelist is for keys the job has: an unknown one (`nodez=2`) gets load_job's own refusal
    and its "did you mean nodes?", not the list of what a resume may change."""
    why = _resume_key_problem(item, cfg)
    if not why:
        return
    if not _has_key(cfg, item.split("=", 1)[0].strip()):
        load_job(job.config, [item])  # its one line for an unknown key, with a suggestion
    raise UserError(why)


def resumed_config(job: JobDir, overrides: list[str], *, force: bool = False):
    """The job's config with resume's overrides, checked like a new job (the config's checks
    and submit's: ``checked_for_submission``) before anything is written; None without any."""
    from .render import render_script

    if not overrides:
        return None
    standing = load_job(job.config)
    for item in overrides:
        _check_resume_key(job, standing, item)
    cfg = load_job(job.config, overrides)  # every check of a new job, the task's included
    cfg = checked_for_submission(cfg, str(job.config), force=force)
    return cfg, render_script(cfg)


@dataclass(frozen=True)
class _ResumeUndo:
    """What a resume changes before its submission, kept to be put back when the backend
    started nothing (``NotSubmitted``: sbatch refusing a partition or a time limit, a login
    node's copy that could not be prepared) or the resume stopped before submitting: the
    attempt moved to attempts/<n>, config.yaml and job.sh rewritten and job.json's id
    cleared left a directory no verb could reach ("no job id in job.json"), a training job's
    checkpoints included."""

    meta: dict
    files: dict  # path -> bytes of config.yaml and job.sh

    @classmethod
    def taken(cls, job: JobDir) -> _ResumeUndo:
        return cls(job.read_meta(), {p: p.read_bytes() for p in (job.config, job.script)})

    def undone(self, job: JobDir, backend, previous: Path, err: BaseException) -> UserError:
        """Put the directory back as it was; the error to raise, saying so (or what was not
        put back)."""
        said = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
        left = self.put_back(job, backend, previous)
        if left:
            return UserError(f"{said}; the resume was not submitted ({'; '.join(left)})")
        return UserError(f"{said}; the resume was not submitted, nothing changed")

    def put_back(self, job: JobDir, backend, previous: Path) -> list[str]:
        """Restore what the resume changed; what could not be, said."""
        left = []
        try:
            for path, data in self.files.items():
                atomic_write(path, data)
            atomic_write_json(job.meta_file, self.meta)
            kept = job.restore_attempt(previous)
            if kept:
                left.append(f"{', '.join(kept)} stay in {previous}")
            left += backend.undo_resume(job, previous.name)
        except OSError as undo_err:
            left.append(f"putting the directory back failed: {undo_err}")
        return left


def _last_state(job: JobDir, backend, *, force: bool) -> JobStatus:
    """The job's state before a resume. A resume whose submission may have queued the job
    left job.json naming none (``_submitted``): with --force (the user looked, and cancelled
    it if it was there) it reads UNKNOWN and the resume goes on; else the backend's refusal
    says what to do."""
    if force and job.submission_unknown():
        return JobStatus("", JobState.UNKNOWN, "the last submission is unknown")
    return backend.status(job.path)


def _submitted(job: JobDir, backend, undo: _ResumeUndo, previous: Path) -> str:
    """The resumed job's id; the directory put back where the backend started nothing
    (``NotSubmitted``). Any other failure may have queued the job (sbatch timing out, the
    connection dropping while it ran, an id it did not print): nothing is put back, which
    would hide a queued job behind the last attempt's state, and the error says so."""
    try:
        return backend.submit(job.path)
    except NotSubmitted as err:
        raise undo.undone(job, backend, previous, err) from None
    except SubmittedNotRecorded:
        raise  # queued: the job runs, and the message says how to cancel it
    except UserError as err:  # (a Ctrl-C while sbatch ran keeps its exit status)
        raise type(err)(
            f"{err}; the resume may have been queued: job.json names no job (look for it "
            "with squeue --me; cancel it if it is there, then `ringctl resume --force "
            f"{job.path}`); the last attempt's files are in {previous}"
        ) from None


def resume_job(path: Path, *, force: bool = False, overrides: list[str] | tuple[str, ...] = ()):
    """Submit an ended job (failed, cancelled, timed out) again into its own directory.

    Its outputs stay; tasks skip work already complete (the long-document task skips
    documents whose shards are all written and verified). The previous attempt's logs and
    placement move to attempts/<n>/. Under the directory's lock; a refusal changes nothing.
    """
    job, cfg, backend = open_job_dir(path, checked=True)
    changed = resumed_config(job, list(overrides), force=force)  # before anything moves
    backend.refuse_unstartable(cfg if changed is None else changed[0])
    with job.lock("resume"):
        before = _last_state(job, backend, force=force)
        if not before.state.finished and before.state.value != "UNKNOWN":
            raise UserError(
                f"{job.path}: job {before.job_id} is {before.state.value}; cancel it first "
                f"(`ringctl cancel {job.path}`) or wait for it to end"
            )
        if before.state.value == "COMPLETED" and not force:
            raise UserError(
                f"{job.path}: job {before.job_id} already COMPLETED; pass --force to run it "
                "again (finished work is still kept)"
            )
        running = backend.still_running(job)  # whatever state.json says (the job writes it)
        if running:
            raise UserError(f"{job.path}: {running}; cancel it first, or wait for it to end")
        backend.refuse_resume(job)
        why = get_task(str(cfg.task.name)).resume_problem(cfg, job.path)  # a running job: above
        if why:
            raise UserError(f"{why}. Nothing was resumed")
        history = job.read_meta().get("attempts", [])
        if not isinstance(history, list):  # checked before anything moves
            raise UserError(f"{job.meta_file}: attempts must be a list")
        backend.stop_leftovers(job)  # while state.json still names them
        undo = _ResumeUndo.taken(job)
        previous = job.archive_attempt()
        try:
            job.remove_stale_temporaries()
            if changed is not None:
                atomic_write(job.config, to_yaml(changed[0]))
                atomic_write(job.script, changed[1])
                job.script.chmod(default_dir_mode())  # as JobDir.create: the umask's say
            entry = {"job_id": before.job_id, "state": before.state.value, "dir": str(previous)}
            job.update_meta(attempts=[*history, entry])
            backend.prepare_resume(job)
        except KeyboardInterrupt:
            for left in undo.put_back(job, backend, previous):
                print(f"warning: interrupted, and {left}", file=sys.stderr)
            raise
        except Exception as err:
            raise undo.undone(job, backend, previous, err) from None
        job_id = _submitted(job, backend, undo, previous)
        job.record_submission(str(job_id), backend.cancel_command(job.path, str(job_id)))
    # said once all is recorded (a reader gone away cannot leave it half done); the names
    # are the job's to make: shown, never obeyed
    moved = ", ".join(sorted(e.name + "/" * e.is_dir() for e in previous.iterdir()))
    print(f"the last attempt's files moved to {previous}: {visible(moved)}", file=sys.stderr)
    return job.path, str(job_id), backend
