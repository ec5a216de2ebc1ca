"""Data that read.py does not read line by line: Hugging Face `datasets` (a hub dataset id, a
local .parquet or .arrow file, a folder of data files or one written by `save_to_disk`) and
JSON files holding one array of records (as alpaca_data.json does).

    --data ORG/NAME          the hub dataset's "train" split (ORG/NAME:SPLIT for another),
                             from the local HF cache first (offline-safe), else downloaded
    --data FILE.parquet | FILE.arrow | FOLDER

Rows stream (`streaming=True`): memory stays bounded, nothing is written to datasets' cache.
`datasets` is an optional dependency (pip install 'lorac[datasets]'); it is imported only here.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import LoracError
from ..model.hub import is_repo_id, resolve_hub_dataset

DATASET_SUFFIXES = (".parquet", ".arrow")


def is_dataset_source(path: str) -> bool:
    """Whether --data names something this module reads rather than read.py's line reader."""
    p = Path(path)
    return p.suffix in DATASET_SUFFIXES or p.is_dir() or (not p.exists() and is_repo_id(path)) or _json_array(p)


def _json_array(p: Path) -> bool:
    if p.suffix != ".json" or not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(256).lstrip()[:1] == b"["


def dataset_records(path: str):
    """Yield (row number, record dict) from a dataset source."""
    p = Path(path)
    if _json_array(p):
        rows = _load_json_array(p)
    else:
        rows = _hf_rows(path, p)
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise LoracError(f"{path}:{i}: a record (JSON object) is expected, got {type(row).__name__}")
        yield i, {k: v for k, v in row.items() if v is not None}  # a table's null is an absent key


def _load_json_array(p: Path):
    from ..files import read_json
    return read_json(p)


def _hf_rows(path: str, p: Path):
    try:
        import datasets
    except ImportError:
        raise LoracError(f"--data {path} needs the `datasets` package: pip install 'lorac[datasets]'") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
            data = datasets.load_from_disk(str(p))
            return data["train"] if isinstance(data, datasets.DatasetDict) else data
        if p.is_file():
            return datasets.load_dataset(p.suffix[1:], data_files=str(p), split="train", streaming=True)
        if p.is_dir():
            return datasets.load_dataset(str(p), split="train", streaming=True)
        repo, _, split = path.partition(":")
        return datasets.load_dataset(str(resolve_hub_dataset(repo, path)), split=split or "train", streaming=True)
    except LoracError:
        raise
    except Exception as e:  # datasets raises many kinds (missing split, bad file, no data files)
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise LoracError(f"{path}: cannot read it as a dataset ({type(e).__name__}: {reason})") from None
