"""The long-document task: score, embed or take gradients of documents with a causal LM.

The work lives in `ringctl.longdoc` (documents, tokenizer, model, scoring, shards); this module
is its face in a job config. Its parameters are `ringctl.longdoc.params.LongDocParams` (the
`task:` section; see that module for every key):

    task:
      name: longdoc
      mode: score            # score | embed | grad
      inputs: [docs/]        # a path or a list: .txt .md .jsonl .jsonl.gz .json, directories
      model_path: null       # a local HF model directory; null = the bundled tiny Llama

`check` runs at submit, before anything is created: impossible values, paths that do not exist,
a model that ring attention cannot run exactly (refused by name, from its config.json), a byte
tokenizer with a model of another vocabulary, and inputs that cannot be read. Relative input and
model paths are made absolute when the job is submitted (`prepare`), so ranks that run inside
the job directory (or on another node with the same filesystem) find them. Over ssh the paths
are the login node's (`files_here`): they must be absolute, are looked for there at submit
(`named_files`, `SSHBackend.check_named_files`), and none is read or sized on this machine.

`LongDocTask` is the task (`ringctl.tasks.base.Task`): its methods hold the code, it needs
transformers and tokenizers on the ranks, and its gather step is `ringctl.longdoc.output.gather`
(through `LongDocGatherer`, which reads the job's parameters from its config for it). Callers
ask the registry (`ringctl.tasks.get_task("longdoc")`) or the class, never this module.
"""

from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..backends import files_here
from ..config import job_layout
from ..errors import StoppedOnRequest
from ..longdoc.compute import SHARD_MODES
from ..longdoc.model.hub import OFFLINE_ENV
from ..longdoc.params import CorpusParams, LongDocParams, normalised_inputs
from .base import Gatherer, NamedFile, Task, importable, world_size

Params = LongDocParams


@dataclass
class ModelSection:
    """`model:` of a long-document job: how the model's weights are held."""

    shard: str = "none"  # none | ring (FSDP2 over each ring's ranks) | job (over all ranks)


HF_INSTALL = "pip install 'ringctl[hf]'"
# Tokens a document may have beyond its text's UTF-8 bytes: special tokens a tokenizer adds
# (BOS, EOS) and a prefix space (SentencePiece); documents this close to the trained context
# are tokenised to be sure.
SLACK = 16
# What submit tokenises at most to count the documents past the trained context (a corpus of
# books would otherwise be tokenised twice); past it, the rest are said in one line.
CONTEXT_CHECK_BYTES = 64 << 20
__all__ = ["CorpusTask", "LongDocGatherer", "LongDocTask", "ModelSection", "Params"]


_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    """A warning on stderr, once per process (a submit loads and checks its config twice)."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(f"warning: {line}", file=sys.stderr)


def _longer_than(p: CorpusParams, docs: list, limit: int) -> tuple[list[tuple], int]:
    """((document, tokens) of the documents of more than ``limit`` tokens with the job's own
    tokenizer, how many were left uncounted past ``CONTEXT_CHECK_BYTES``): only those whose
    bound (``_token_bound``) passes the limit are tokenised (``_real_counts``)."""
    counts, uncounted = _real_counts(p, docs, lambda bound: bound > limit)
    return [(docs[i], n) for i, n in counts.items() if n > limit], uncounted


def _token_bound(raw: bytes) -> int:
    """The most tokens a text tokenizer makes of ``raw``: the UTF-8 bytes of the text it gets
    (U+FFFD, 3 bytes, for each invalid byte) plus ``SLACK`` (byte-level BPE, SentencePiece:
    every other token covers a byte; special tokens)."""
    return len(raw.decode("utf-8", "replace").encode("utf-8")) + SLACK


def _real_counts(p: CorpusParams, docs: list, uncertain=None) -> tuple[dict[int, int], int]:
    """({index: tokens} of the documents whose bound ``uncertain(bound)`` calls too long to
    take on trust (None: every one), counted with the job's own tokenizer (loaded only when
    one needs it), how many were left uncounted past ``CONTEXT_CHECK_BYTES``). One that
    cannot be read now is left out (the job names it when it runs)."""
    from ..longdoc.inputs.documents import DocumentError
    from ..longdoc.model.tokenize import load_tokenizer

    tokenizer, counts, budget = None, {}, CONTEXT_CHECK_BYTES
    for i, doc in enumerate(docs):
        if budget <= 0:
            return counts, len(docs) - i
        try:
            raw = doc.read_bytes()
        except (OSError, DocumentError):
            continue
        if uncertain is not None and not uncertain(_token_bound(raw)):
            continue
        if tokenizer is None:
            tokenizer = load_tokenizer(p.tokenizer_dir())
        budget -= len(raw)
        counts[i] = int(tokenizer.encode(raw).numel())
    return counts, 0


class CorpusTask(Task):
    """What a task over documents with a causal LM does alike (the long-document task, the
    training task): its parameters (a ``CorpusParams``), the model, tokenizer and input checks
    at submit, absolute paths for the ranks, and the model's shape for the planner."""

    params = CorpusParams
    packages = (("transformers", HF_INSTALL), ("tokenizers", HF_INSTALL))
    start_env = OFFLINE_ENV
    start_imports = (
        *Task.start_imports,
        "safetensors.torch",
        "transformers",
        "transformers.modeling_utils",
        "transformers.masking_utils",
        "transformers.modeling_layers",
        "transformers.models.auto.modeling_auto",
    )

    def params_of(self, cfg):
        """The job's parameters, the layout resolved (``task.layout`` or ``ring.layout``)."""
        params = self.params.from_any(
            OmegaConf.to_container(cfg.task, resolve=True), validate=False
        )
        params.layout = job_layout(cfg)
        params.validate()
        return params

    def check(self, cfg, bad) -> None:
        self.check_plain_rings(cfg, bad)
        here = files_here(cfg)
        self.check_model_name(cfg.task.get("model_path"), bad, installed_here=here)
        try:
            p = self.params.from_any(OmegaConf.to_container(cfg.task, resolve=True), validate=False)
        except (TypeError, ValueError) as err:
            raise bad("task", str(err)) from None
        for key, why in p.problems():
            raise bad(f"task.{key}", why)
        if not here:  # the login node's files: looked for there at submit, read by the ranks
            self.check_login_node_paths(p, bad)
            return
        for key in ("model_path", "tokenizer_path"):
            value = getattr(p, key)
            if value is not None and value != "bytes" and not Path(value).expanduser().exists():
                raise bad(f"task.{key}", f"{value} does not exist")
        tokenizer_dir = p.tokenizer_path and Path(p.tokenizer_path).expanduser()
        if p.tokenizer_path not in (None, "bytes") and not tokenizer_dir.is_dir():
            raise bad(  # a file passed here and was refused on every rank after the queue
                "task.tokenizer_path",
                f"{p.tokenizer_path} is not a directory (a tokenizer's folder, as "
                "save_pretrained writes it; `bytes` for UTF-8 bytes)",
            )
        self.check_gguf(p, bad)
        self.check_model(p, bad)
        self.check_inputs(p, bad)

    def listed_documents(self, cfg) -> tuple[list | None, str]:
        """(the documents the job's ranks would list now, as this machine sees its inputs,
        "") or (None, why the inputs cannot be listed, naming task.inputs): what a resume
        compares with the documents its job set out with."""
        from ..longdoc.inputs.documents import DocumentError

        params = self.params_of(cfg)
        try:
            return params.list_inputs(params.input_paths()).documents, ""
        except DocumentError as err:
            return None, f"task.inputs: {err}"

    def check_plain_rings(self, cfg, bad) -> None:
        """The corpus tasks (scoring, training) run plain rings (``ring.size``): ring.ulysses
        is refused by name rather than ignored, since the placement step would group ranks
        for a hybrid grid that no rank builds."""
        if cfg.ring.ulysses not in (None, 1):
            raise bad(
                "ring.ulysses",
                f"the {self.name} task runs plain rings and does not read it (got "
                f"{cfg.ring.ulysses!r}); leave it null (the attention task runs hybrid grids)",
            )

    @staticmethod
    def check_model_name(model_path, bad, *, installed_here: bool = True) -> None:
        """A reserved name (``bundled:``, ``package:``) that this install cannot resolve: an
        unknown name, or a packaged model whose package is missing (with its install line).
        ``installed_here`` False (ssh): the login node's install resolves it; only an unknown
        name is refused here."""
        from ..longdoc.model.names import resolve_model_path, unknown_reserved_name

        name = None if model_path is None else str(model_path)
        try:
            unknown = None if installed_here else unknown_reserved_name(name)
            if installed_here:
                resolve_model_path(name)
        except ValueError as err:
            unknown = str(err)
        if unknown:
            raise bad("task.model_path", unknown)

    def check_login_node_paths(self, p: CorpusParams, bad) -> None:
        """Paths of a job whose nodes do not see this machine's files (ssh) name the login
        node's, so they must be absolute there: a relative one was made absolute against this
        machine's working directory, and ``~`` against this machine's home."""
        for named in self.named_paths(p):
            if not posixpath.isabs(named.path):
                raise bad(
                    named.key,
                    f"{named.path} is not absolute: with backend=ssh the job's paths name the "
                    "login node's files (read by the ranks there), so give each as an absolute "
                    "path on the login node",
                )

    def named_files(self, cfg) -> list[NamedFile]:
        return self.named_paths(self.params_of(cfg))

    @staticmethod
    def named_paths(p: CorpusParams) -> list[NamedFile]:
        """The job's model, tokenizer and input paths as given (reserved model names and
        ``bytes`` are names, not paths); a missing input is required only under
        ``task.on_missing: stop``."""
        from ..longdoc.model.names import RESERVED

        named = [
            NamedFile(f"task.{key}", str(value))
            for key, value in (("model_path", p.model_path), ("tokenizer_path", p.tokenizer_path))
            if value is not None and value not in ("bytes", *RESERVED)
        ]
        inputs = [p.inputs] if isinstance(p.inputs, str) else list(p.inputs or ())
        stop = p.on_missing == "stop"
        return named + [NamedFile("task.inputs", str(path), required=stop) for path in inputs]

    @staticmethod
    def check_gguf(p: CorpusParams, bad) -> None:
        """A GGUF file needs transformers, gguf and accelerate to be converted (gguf_file.py);
        refused before the conversion is tried, with the install line."""
        from ..longdoc.model.gguf_file import GGUF_INSTALL, NEEDS, is_gguf

        missing = [m for m in NEEDS if not importable(m)] if is_gguf(p.model_path) else []
        if missing:
            raise bad(
                "task.model_path",
                f"{p.model_path} is a GGUF file; loading it needs {', '.join(missing)}, which "
                f"{sys.executable} cannot import: {GGUF_INSTALL}",
            )

    def check_model(self, p: CorpusParams, bad) -> None:
        """The model and tokenizer, from config.json (transformers only for overrides and for
        a directory with its own code: their fields and classes are transformers')."""
        from ..longdoc.model.compat import config_refusal, read_model_config
        from ..longdoc.model.directory import (
            TOKENIZER_FILES,
            check_model_directory,
            check_tokenizer_files,
        )
        from ..longdoc.model.overrides import merge, problem

        try:
            raw = read_model_config(p.model_path)
        except ValueError as err:
            raise bad("task.model_path", str(err)) from None
        found = problem(raw, p.model_overrides)
        if found:
            raise bad(*found)
        config = merge(raw, p.model_overrides)
        why = config_refusal(config)
        if why:
            raise bad("task.model_path", why)
        vocab = (config.get("text_config") or config).get("vocab_size")
        tokenizer = p.tokenizer_dir()
        if tokenizer is None and vocab is not None and int(vocab) != 256:
            where = "has no tokenizer files" if p.model_path else "is the bundled byte model"
            raise bad(
                "task.tokenizer_path",
                f"the model's vocabulary is {vocab} ids and the model directory {where} "
                f"({', '.join(TOKENIZER_FILES)}): UTF-8 bytes (256 ids) would score garbage; "
                "give the tokenizer's directory",
            )
        for key, where in (("task.model_path", p.model_path), ("task.tokenizer_path", tokenizer)):
            try:  # no file read from outside the directory (directory.py)
                if where:
                    check_model_directory(where)
                if where and key == "task.tokenizer_path":
                    check_tokenizer_files(where)
            except ValueError as err:
                raise bad(key, str(err)) from None
        self.check_custom_code(p, config, tokenizer, bad)

    @staticmethod
    def check_custom_code(p: CorpusParams, config: dict, tokenizer: str | None, bad) -> None:
        """A directory's own code (auto_map) is never run: say which built-in class runs
        instead, or refuse what transformers cannot load without it (custom_code.py)."""
        from ..longdoc.model.custom_code import model_note, tokenizer_note

        where = Path(p.model_path or "config.json")
        where = where / "config.json" if where.is_dir() else where
        try:
            notes = [model_note(config, str(where))]
        except ValueError as err:
            raise bad("task.model_path", str(err)) from None
        try:
            notes.append(tokenizer_note(tokenizer) if tokenizer else "")
        except ValueError as err:
            raise bad("task.tokenizer_path", str(err)) from None
        for line in filter(None, notes):
            _warn_once(line)

    @staticmethod
    def check_inputs(p: CorpusParams, bad) -> None:
        """Inputs that cannot be read are found at submit (missing ones follow on_missing)."""
        from ..longdoc.inputs.documents import DocumentError

        if p.inputs is None:
            return
        try:
            p.list_inputs()
        except DocumentError as err:
            raise bad("task.inputs", str(err)) from None

    def prepare(self, cfg):
        """Absolute paths, so ranks started in the job directory find the inputs and model."""
        from ..longdoc.model.names import RESERVED

        here = files_here(cfg)
        cfg = OmegaConf.to_container(cfg, resolve=True)
        t = cfg["task"]
        t["inputs"] = normalised_inputs(t["inputs"])  # the checks' reading: 2024 is "2024"
        if not here:  # the login node's paths: absolute already (check_login_node_paths)
            return cfg
        self.check_built_config(t["model_path"], t["model_overrides"])
        if t["inputs"]:
            t["inputs"] = [str(Path(p).expanduser().absolute()) for p in t["inputs"]]
        for key in ("model_path", "tokenizer_path"):
            if t[key] and t[key] not in ("bytes", *RESERVED):  # names, resolved where run
                t[key] = str(Path(t[key]).expanduser().absolute())
        return cfg

    @staticmethod
    def check_built_config(model_path, overrides) -> None:
        """A hand-written .json model config built by transformers' class as the ranks build
        it, once per submission (an import of transformers: not at every load, as ``check``):
        a field it refuses is a one-line refusal here, not every rank's traceback."""
        from ..errors import UserError
        from ..longdoc.model.compat import built_config_refusal
        from ..longdoc.model.load import builds_random

        if model_path is None or not builds_random(model_path):  # the bundled one: known good
            return
        try:
            why = built_config_refusal(model_path, overrides)
        except ImportError:  # no transformers here: the package check refuses the job
            return
        if why:
            raise UserError(f"task.model_path: {why}. Nothing was submitted")

    def job_model_shape(self, cfg):
        """``model_shape`` of the job's model, where this machine can read it: a UserError
        for a path on the login node (ssh), whose config.json is not here to price."""
        from ..errors import UserError
        from ..longdoc.model.names import RESERVED

        path = cfg.task.get("model_path")
        if not files_here(cfg) and path is not None and str(path) not in RESERVED:
            raise UserError(
                f"task.model_path: {path} is on the login node (backend=ssh): its config.json "
                "is not read here, so the job is not sized; give ring.max_tokens_per_rank "
                "(`ringctl plan --model` prices a copy of that config)"
            )
        return self.model_shape(cfg.task)

    @staticmethod
    def model_shape(task):
        """The shape of the model the job runs (a planner ``ModelShape``): its config.json
        with task.model_overrides checked and set, read by the job's own reader
        (``longdoc.compat.read_model_config``)."""
        from ..longdoc.model.compat import model_shape as read_shape
        from ..longdoc.model.names import resolve_model_path

        path = resolve_model_path(str(task.model_path) if task.get("model_path") else None)
        overrides = task.get("model_overrides")
        if OmegaConf.is_config(overrides):
            overrides = OmegaConf.to_container(overrides, resolve=True)
        return read_shape(str(path) if path else None, overrides)


class LongDocGatherer(Gatherer):
    """`ringctl gather` of a long-document job: ringctl.longdoc.output.gather, imported when
    used. The job's config becomes its parameters here, as for `run`, so that the output
    package never reads a config."""

    @staticmethod
    def _module():
        from ..longdoc.output import gather

        return gather

    def gather(self, job_dir, out, *, job_config=None, **options):
        params, problem = None, ""
        if job_config is not None:
            task = OmegaConf.to_container(job_config.task, resolve=True)
            try:
                params = LongDocParams.from_any(task, validate=False)
            except ValueError as err:
                problem = str(err)
        options.update(job_params=params, job_params_problem=problem)
        return self._module().gather(job_dir, out, **options)

    def recognises(self, path) -> bool:
        return self._module().recognises(path)

    def replaces_partial(self, job_dir, out) -> bool:
        return self._module().replaces_partial(job_dir, out)

    def show(self, result, console) -> None:
        self._module().show(result, console)


class LongDocTask(CorpusTask):
    """Score, embed or take gradients of long documents with a causal LM."""

    name = "longdoc"
    params = LongDocParams
    start_imports = (*CorpusTask.start_imports, "ringctl.longdoc.run")
    sections = {"model": ModelSection}

    def check(self, cfg, bad) -> None:
        self.check_world(cfg, bad)
        super().check(cfg, bad)
        self.check_shard(cfg, bad)

    @staticmethod
    def check_world(cfg, bad) -> None:
        """No more ranks than run.json may record (``manifest.MAX_WORLD_SIZE``, fewer than a
        job's ``MAX_RANKS``): a larger job ran, then gather and resume refused its run.json."""
        from ..longdoc.output.manifest import MAX_WORLD_SIZE

        world = world_size(cfg)
        if world > MAX_WORLD_SIZE:
            raise bad(
                "nodes",
                f"{cfg.nodes} nodes x {cfg.tasks_per_node} tasks is {world:,} ranks; a "
                f"long-document job's outputs record at most {MAX_WORLD_SIZE:,}",
            )

    def prepare(self, cfg):
        """As every corpus task's; and, once per submission (not at every load of the config,
        as ``check``), the documents scored past the model's trained context."""
        if files_here(cfg):  # over ssh the documents and the model are the login node's
            self.check_context(cfg)
        return super().prepare(cfg)

    def check_context(self, cfg) -> None:
        """Say, for each document longer than the model's trained context, that it is scored
        past it, with the numbers (a warning: the ring scores it exactly all the same), counted
        with the job's own tokenizer (``_longer_than``: only documents that may be longer are
        tokenised). Without transformers nothing is said here: the package check that follows
        refuses the job."""
        from ..longdoc.model.compat import context_note, read_model_config, trained_context
        from ..longdoc.schedule import document_bytes

        p = self.params.from_any(OmegaConf.to_container(cfg.task, resolve=True), validate=False)
        config = read_model_config(p.model_path, p.model_overrides)  # checked by check_model
        limit = trained_context(config)
        if limit is None:
            return
        listing = p.list_inputs(p.input_paths(), on_missing="report", on_bad_record="skip")
        maybe = [d for d in listing.documents if 3 * document_bytes(d) + SLACK > limit]
        try:
            longer, uncounted = _longer_than(p, maybe, limit)
        except ImportError:
            return
        for doc, n in longer:
            _warn_once(f"document {doc.id!r}: {context_note(config, n)}")
        if uncounted:
            _warn_once(
                f"{uncounted} more document(s) may be longer than the model's trained context "
                f"({limit} tokens): submit tokenises {CONTEXT_CHECK_BYTES >> 20} MiB at most; "
                "gather's summary.json marks every document past it"
            )

    def resume_problem(self, cfg, job_dir: Path) -> str | None:
        """Inputs that list other documents than the job set out to compute (its
        expected.json): every rank refused the resume after the queue. Checked where this
        machine sees the inputs (not over ssh), as the ranks list them."""
        from ..jobdir import task_output
        from ..longdoc.output.expected import check_expected
        from ..longdoc.output.names import RUN_FILE, SUBDIR

        root = task_output(Path(job_dir), SUBDIR, RUN_FILE)
        if root is None or not files_here(cfg):  # nothing written yet, or not readable here
            return None
        documents, refused = self.listed_documents(cfg)
        if documents is None:
            return refused
        return check_expected(root, documents) or None

    @staticmethod
    def check_shard(cfg, bad) -> None:
        """model.shard needs one ring size (the model is loaded once, sharded over the ring or
        the job); with several rings, model.shard=job runs them in lockstep (longdoc/run.py)."""
        shard = str(cfg.model.shard)
        if shard not in SHARD_MODES:
            raise bad("model.shard", f"expected one of {', '.join(SHARD_MODES)}, got {shard!r}")
        if shard == "none":
            return
        if cfg.ring.size == "auto":
            why = "size would need its own sharded copy of the model); give ring.size=N"
            raise bad(
                "model.shard",
                f"{shard} cannot be combined with ring.size=auto (each ring {why}",
                "ring.size",
            )
        if shard == "job" and str(cfg.task.mode) == "grad":  # FSDP would sum documents
            raise bad("model.shard", "job cannot run mode=grad; use model.shard=ring", "task.mode")

    def workload(self, cfg):
        """What the planner sizes for this job: its model (``task.model_path``: its
        config.json) and mode, with ``seq_len`` 0 (documents differ; see ringctl.sizing's
        budget)."""
        from ..planner.cost import Workload

        m = self.job_model_shape(cfg)
        mode = {"score": "score", "embed": "embed", "grad": "train"}[str(cfg.task.mode)]
        return Workload(
            seq_len=0,
            heads=m.heads,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            model=m,
            dtype=str(cfg.task.dtype),
            mode=mode,
            backward=mode == "train",
            layout=job_layout(cfg),
            lm_head_chunk=int(cfg.task.chunk_size),
        )

    def document_lengths(self, cfg, *, fits=None) -> list[tuple[str, int]]:
        """(id, tokens) of each document of the job, as listed (missing inputs and bad
        records left out, as the job leaves them; with no ``task.inputs``, the bundled
        samples): ``longdoc.schedule``'s estimate in bytes, exact for the byte-level tokenizer
        and an upper bound for a model's. ``fits(tokens)``: whether a ring of the job holds
        that many; a document whose bound it refuses is tokenised for its real count (within
        ``CONTEXT_CHECK_BYTES``), so that a bound is never what refuses a job that runs
        (29,800 bytes refused where SmolLM2 makes 7,860 tokens)."""
        from ..longdoc.schedule import estimated_tokens

        if not files_here(cfg):  # the login node's documents: not read from here
            return []
        params = LongDocParams.from_any(
            OmegaConf.to_container(cfg.task, resolve=True), validate=False
        )
        inputs = params.inputs
        if inputs is None:
            from ..longdoc.model.names import samples_dir  # no torch

            inputs = [str(samples_dir())]
        listing = params.list_inputs(inputs, on_missing="report", on_bad_record="skip")
        docs = listing.documents
        tokens = estimated_tokens(docs)
        if fits is not None and params.tokenizer_dir() is not None:  # bytes: exact already
            tokens = self._counted_where_too_long(params, docs, tokens, fits)
        return list(zip((d.id for d in docs), tokens, strict=True))

    @staticmethod
    def _counted_where_too_long(params, docs, tokens: list[int], fits) -> list[int]:
        """``tokens`` with the real count of each document whose estimate ``fits`` refuses."""
        too_long = [i for i, n in enumerate(tokens) if not fits(n)]
        try:
            counts, _ = _real_counts(params, [docs[i] for i in too_long])
        except ImportError:  # no transformers here (the job names its own env): bounds stand
            return tokens
        out = list(tokens)
        for j, n in counts.items():
            out[too_long[j]] = n
        return out

    @staticmethod
    def options_of(cfg, ctx):
        """How the worker drives the run (``longdoc.run.LongDocOptions``): its progress and
        stop request, its device, the job's rings, schedule file and model sharding."""
        from ..jobdir import JobDir
        from ..longdoc.run import LongDocOptions
        from ..longdoc.schedule import RingOptions
        from ..progress import write_record

        job = JobDir(ctx.job_dir)

        def ring_progress(label: str, record: dict) -> None:
            write_record(job.ring_progress(label), record)

        return LongDocOptions(
            progress=ctx.progress,
            should_stop=ctx.stop_requested,
            device=ctx.device,
            rings=RingOptions.of(cfg),
            schedule_path=job.schedule,
            ring_progress=ring_progress,
            shard=str(cfg.model.shard),
            timeout=ctx.timeout,
        )

    def run(self, cfg, ctx) -> dict:
        from ..longdoc.run import run_longdoc

        options = self.options_of(cfg, ctx)
        summary = run_longdoc(
            self.params_of(cfg), ctx.rank, ctx.world_size, ctx.group, ctx.out_dir, ctx.log, options
        )
        if summary.stopped:  # a preemption signal: the job is not done, and must not look done
            left = summary.total - summary.skipped - summary.done
            raise StoppedOnRequest(
                f"stopped on request before the end: {left} of {summary.total} documents left "
                "(finished ones are written); `ringctl resume` continues"
            )
        return {"documents": summary.done, "tokens": summary.tokens}

    def gatherer(self) -> Gatherer:
        return LongDocGatherer()
