"""Hugging Face ``datasets`` folders written by ``save_to_disk``: which files are the data.

A ``Dataset`` folder holds ``state.json``, whose ``_data_files`` (``[{"filename": ...}]``) are
the Arrow files that hold its rows, in order, beside ``dataset_info.json``. Other Arrow files
may sit beside them: ``datasets`` writes ``cache-*.arrow`` there after ``.map()`` or
``.filter()`` (the result of another computation, not rows of this dataset). So only the files
``state.json`` lists are read, in its order, each resolved and kept inside the folder.

A ``DatasetDict`` folder holds ``dataset_dict.json`` (``{"splits": [...]}``) and a Dataset
folder per split. Which split to read is the job's ``task.split``: reading all of them would
score train and test rows as one corpus, so without it the folder is refused, naming its
splits. The JSON files are hostile input like any other: checked, and read only when small.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...bounded_read import read_regular
from .records import DocumentError

STATE = "state.json"
DATASET_DICT = "dataset_dict.json"
DATASET_INFO = "dataset_info.json"  # the features: metadata beside .arrow files, not a document
MAX_METADATA_BYTES = 16 << 20  # state.json lists file names: far below this


def saved_files(folder: Path, split: str | None) -> list[Path] | None:
    """The data files of a ``save_to_disk`` folder, in the dataset's order (None: ``folder``
    is not one). A DatasetDict is read by ``split``; without one it is refused."""
    if (folder / DATASET_DICT).is_file():
        return _split_files(folder, split)
    if (folder / STATE).is_file() and any(folder.glob("*.arrow")):
        return _state_files(folder)
    return None  # a state.json alone is a document like any .json file


def is_dataset_dict(folder: Path) -> bool:
    return (folder / DATASET_DICT).is_file()


def _read_json(path: Path):
    try:
        return json.loads(read_regular(path.resolve(), MAX_METADATA_BYTES))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        said = str(err).removeprefix(f"{path.resolve()}: ")  # read_regular names the file
        raise DocumentError(f"{path}: not valid JSON ({said})") from None


def _state_files(folder: Path) -> list[Path]:
    """The files ``state.json`` lists, in its order."""
    state = _read_json(folder / STATE)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list):
        raise DocumentError(
            f"{folder / STATE}: no _data_files list, so which of the .arrow files beside it "
            "hold the dataset's rows is unknown"
        )
    return [_data_file(folder, entry) for entry in files]


def _data_file(folder: Path, entry) -> Path:
    """One ``{"filename": ...}`` of ``_data_files``: an .arrow file inside the folder."""
    where = folder / STATE
    name = entry.get("filename") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        raise DocumentError(f"{where}: each _data_files entry needs a filename, not {entry!r}")
    root = folder.resolve()
    target = (folder / name).resolve()
    if root not in target.parents:
        raise DocumentError(f"{where}: data file {name!r} is not inside {folder}")
    if target.suffix != ".arrow" or not target.is_file():
        raise DocumentError(f"{where}: data file {name!r} is not an .arrow file in {folder}")
    return folder / target.relative_to(root)


def _split_files(folder: Path, split: str | None) -> list[Path]:
    where = folder / DATASET_DICT
    data = _read_json(where)
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) and s for s in splits):
        raise DocumentError(f"{where}: splits must be a list of names")
    available = ", ".join(splits) or "none"
    if split is None:
        raise DocumentError(
            f"{folder}: a DatasetDict ({DATASET_DICT}) with splits {available}: set "
            "task.split to the one to read"
        )
    if split not in splits:
        raise DocumentError(f"{folder}: no split {split!r} (split: one of {available})")
    sub = folder / split
    if sub.resolve().parent != folder.resolve() or not sub.is_dir():
        raise DocumentError(f"{where}: split {split!r} is not a folder inside {folder}")
    if not (sub / STATE).is_file():
        raise DocumentError(f"{sub}: no {STATE}: not a saved Dataset")
    return _state_files(sub)
