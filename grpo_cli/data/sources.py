"""Read prompt rows (list of dicts) from JSONL, Parquet, a saved `datasets` folder, a hub cache or a built-in."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.data.tasks import BUILTIN_TASKS, SPLITS


class DataError(UserError):
    """Bad or missing prompt data; the message names the file and the fix."""


def _jsonl(path: Path) -> list[dict]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}); each line must be one JSON object.") from None
    return rows


def load_rows(source: str, *, seed: int = 0) -> list[dict]:
    """Rows of `data.source`: `builtin:NAME` (or `builtin:NAME:heldout`, its evaluation split), `hf:ID` (from the
    local hub cache), a .jsonl/.parquet file, or a folder written by `datasets.Dataset.save_to_disk`."""
    if source.startswith("builtin:"):
        name, _, split = source.removeprefix("builtin:").partition(":")
        if name not in BUILTIN_TASKS or split not in ("", *SPLITS):
            raise DataError(f"data.source: unknown built-in task '{source}'; choose one of {sorted(BUILTIN_TASKS)}, "
                            "optionally with ':heldout' (the evaluation split).")
        return BUILTIN_TASKS[name](seed=seed, split=split or "train")
    if source.startswith("hf:"):
        import datasets

        try:
            return list(datasets.load_dataset(source.removeprefix("hf:"), split="train"))
        except Exception as exc:  # noqa: BLE001 - any loader failure becomes a user-facing message
            raise DataError(f"data.source '{source}' could not be loaded ({exc}); download it first or point "
                            "data.source at a local .jsonl/.parquet file or a saved datasets folder.") from None
    path = Path(source)
    if not path.exists():
        raise DataError(f"data.source '{source}' does not exist; give a .jsonl or .parquet file, a saved datasets "
                        "folder, or builtin:words / builtin:arith.")
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return list(ds)
    if path.suffix == ".jsonl":
        return _jsonl(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DataError(f"data.source '{source}': unsupported file type '{path.suffix}'; use .jsonl or .parquet.")
