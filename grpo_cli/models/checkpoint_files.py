"""Which file of a Hugging Face checkpoint folder holds each tensor, and the tensors' shapes, from the index or
the safetensors headers (no weights read)."""

from __future__ import annotations

import json
from pathlib import Path


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name → safetensors file holding it (single file or an index of shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: f for k in handle.keys()})
    return out


def stored_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a Hugging Face checkpoint folder, read from the safetensors headers only."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(Path(folder)).items():
        by_file.setdefault(path, []).append(name)
    shapes = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            shapes.update({n: tuple(handle.get_slice(n).get_shape()) for n in names})
    return shapes
