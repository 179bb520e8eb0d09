"""The parameters of a long-document job: one class for the job file and for ``run_longdoc``.

It is the ``task:`` section of a job (``ringctl.tasks.longdoc.Params`` is this class), and what
``run_longdoc`` takes (from this class, a mapping of its fields, or any object with them).
Importing it imports neither torch nor transformers: ``ringctl submit`` validates with it.

    task:
      name: longdoc
      mode: score            # score | embed | grad
      inputs: [docs/]        # a path or a list of paths; null = the bundled samples
      split: null            # the split of a DatasetDict (save_to_disk) folder among inputs
      text_field: text       # the field holding the text in JSON records
      id_field: null         # a field holding each record's id (default: file#line)
      model_path: null       # a local HF model directory or a .json config; null = tiny Llama;
                             # bundled:demo-byte-llama = the bundled trained byte-level model
      tokenizer_path: null   # null: the model directory's tokenizer, else UTF-8 bytes
      model_overrides: {}    # fields of the model's config class, set on the loaded config
                             # (checked at submit: loader options such as trust_remote_code
                             # and keys that are no field are refused, by name)
      dtype: float32         # float32 | bfloat16 | float16 | float64
      layout: null           # zigzag | contiguous; null = ring.layout
      max_docs: null         # only the first N documents (N >= 1)
      on_missing: report     # a missing input: report it and go on | stop before anything runs
      on_bad_record: skip    # an unreadable record: report it and skip it | stop
      on_changed_input: redo # a resume finds a done document's input edited: compute it
                             # again | stop (refuse the resume, naming it)
      write_grads: false     # (mode grad) rank 0 writes each document's summed gradients
      chunk_size: 4096       # positions per output-head + log-softmax chunk

``run_longdoc`` callers may still say ``task`` for ``mode`` (the name before 0.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringattn.geometry import LAYOUTS

from ..task_params import MAX_SIZE, TaskParams, int_problem
from ..text import echo
from .compute import MODES

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
ON_MISSING = ("report", "stop")
ON_BAD_RECORD = ("skip", "stop")
ON_CHANGED_INPUT = ("redo", "stop")
BYTES = "bytes"  # tokenizer_path: UTF-8 bytes as ids, whatever the model directory holds
_ALIASES = {"task": "mode"}


@dataclass
class CorpusParams(TaskParams):
    """What a job over documents with a causal LM shares (the long-document job, the training
    job): its inputs and how they are read, the model and tokenizer, the dtype, the layout and
    the output-head chunk. Each job's class adds its own keys."""

    inputs: Any = None
    split: str | None = None
    text_field: str = "text"
    id_field: str | None = None
    model_path: str | None = None
    tokenizer_path: str | None = None
    model_overrides: Any = None
    dtype: str = "float32"
    layout: str | None = None
    max_docs: int | None = None
    on_missing: str = "report"
    on_bad_record: str = "skip"
    chunk_size: int = 4096

    @classmethod
    def from_any(cls, cfg: Any, *, validate: bool = True):
        """From this dataclass, a mapping (unknown keys are an error) or an object."""
        names = {f.name for f in dataclasses.fields(cls)}
        if isinstance(cfg, cls):
            values = {n: getattr(cfg, n) for n in names}
        elif isinstance(cfg, Mapping):
            values = {_ALIASES.get(k, k): v for k, v in cfg.items()}
            unknown = sorted(set(values) - names)
            if unknown:
                raise ValueError(
                    f"unknown {cls.name} parameter(s): {', '.join(unknown)}; known: "
                    f"{', '.join(sorted(names))}"
                )
        else:
            values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        params = cls(**values)
        params._normalise()
        if validate:
            params.validate()
        return params

    def _normalise(self) -> None:
        self.inputs = normalised_inputs(self.inputs)
        for name in ("model_path", "tokenizer_path", "id_field", "split"):
            value = getattr(self, name)
            setattr(self, name, None if value in (None, "") else str(value))
        from .model.names import resolve_model_path

        self.model_path = resolve_model_path(self.model_path)
        if self.model_overrides is not None and not isinstance(self.model_overrides, dict):
            try:
                self.model_overrides = dict(self.model_overrides.items())
            except AttributeError:
                pass  # problems() names it
        self.layout = self.layout or "zigzag"

    def tokenizer_dir(self) -> str | None:
        """The directory the job tokenizes with (``tokenizer_path``, else the model
        directory's tokenizer files, or a GGUF file's converted directory, made on first
        use; None: UTF-8 bytes): the one rule of the scoring and the training job, asked on
        the ranks (not at load)."""
        from .model.names import resolve_tokenizer_path

        return resolve_tokenizer_path(self.tokenizer_path, self.model_path)

    def resolve_tokenizer(self) -> None:
        """On the ranks, before the model is loaded: ``tokenizer_path`` becomes
        ``tokenizer_dir()``."""
        self.tokenizer_path = self.tokenizer_dir()

    def choices(self) -> dict[str, tuple]:
        """{key: its allowed values} (a job's class adds its own)."""
        return {
            "layout": LAYOUTS,
            "dtype": DTYPE_NAMES,
            "on_missing": ON_MISSING,
            "on_bad_record": ON_BAD_RECORD,
        }

    def problems(self) -> list[tuple[str, str]]:
        """(key, why) for every impossible value; empty when the parameters can run."""
        out: list[tuple[str, str]] = []
        for key, allowed in self.choices().items():
            if getattr(self, key) not in allowed:
                why = f"must be one of {', '.join(allowed)}, not {getattr(self, key)!r}"
                out.append((key, why))
        why = int_problem(self.chunk_size, 1, MAX_SIZE)  # rows of a tensor: a size
        if why:
            out.append(("chunk_size", why))
        if self.max_docs is not None and int(self.max_docs) < 1:  # 0: a job that reads nothing
            why = f"must be >= 1 (null: every document), not {self.max_docs}; no document to read"
            out.append(("max_docs", why))
        if self.model_overrides is not None and not isinstance(self.model_overrides, dict):
            out.append(("model_overrides", "must be a mapping of config fields to values"))
        paths = isinstance(self.inputs, list) and all(isinstance(p, str) for p in self.inputs)
        if self.inputs is not None and not paths:
            # left as given by _normalise: a mapping (its keys were read as paths), a number
            # ("'int' object is not iterable"), a list holding a list, a mapping or a bool
            why = f"must be a path or a list of paths, not {echo(self.inputs)}"
            out.append(("inputs", why))
        elif self.inputs is not None and not self.inputs:
            out.append(("inputs", "is an empty list (null means the bundled samples)"))
        return out

    def validate(self) -> None:
        for key, why in self.problems():
            raise ValueError(f"task.{key}: {why}")

    def input_paths(self) -> list[str]:
        """The job's input paths: its own, or the bundled samples (``inputs: null``)."""
        if self.inputs is not None:
            return list(self.inputs)
        from .model.names import samples_dir

        return [str(samples_dir())]

    def list_inputs(
        self, inputs=None, *, on_missing: str | None = None, on_bad_record: str | None = None
    ):
        """The documents of `inputs` (default: the job's own) read with this job's fields and
        limits; `on_missing` / `on_bad_record` override the job's policies."""
        from .inputs.documents import list_documents

        return list_documents(
            self.inputs if inputs is None else inputs,
            text_field=self.text_field,
            id_field=self.id_field,
            on_missing=on_missing or self.on_missing,
            on_bad_record=on_bad_record or self.on_bad_record,
            max_docs=self.max_docs,
            split=self.split,
        )


@dataclass
class LongDocParams(CorpusParams):
    """The long-document job's ``task:`` (the module docstring lists every key)."""

    name: str = "longdoc"
    mode: str = "score"
    on_changed_input: str = "redo"
    write_grads: bool = False

    def choices(self) -> dict[str, tuple]:
        return {**super().choices(), "mode": MODES, "on_changed_input": ON_CHANGED_INPUT}

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.write_grads and self.mode != "grad":
            out.append(("write_grads", "only applies to mode=grad"))
        return out

    def signature(self) -> dict:
        """What a rerun in the same output directory must keep (outputs would not match).

        The key ``task`` (the mode) is the output format's name for it (``run.json``).
        """
        return {
            "task": self.mode,
            "layout": self.layout,
            "dtype": self.dtype,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "text_field": self.text_field,
            **({"id_field": self.id_field} if self.id_field else {}),
            **({"model_overrides": self.model_overrides} if self.model_overrides else {}),
        }


def normalised_inputs(inputs):
    """``task.inputs`` as a list of path texts where it names paths (a path, a number: a
    folder named 2024, or a list of these; a ListConfig too): the one reading of the job's
    checks, its submit (``CorpusTask.prepare``) and its ranks. Anything else as given, for
    ``problems`` to name."""
    if _is_path(inputs):
        return [str(inputs)]
    if _is_sequence(inputs) and all(_is_path(p) for p in inputs):
        return [str(p) for p in inputs]
    return inputs


def _is_path(value) -> bool:
    """A path as a config gives one: text, or a number (a folder named 2024)."""
    number = isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (str, Path)) or number


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
