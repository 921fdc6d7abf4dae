"""What tests/gpu/make_wheels.sh carries to a CUDA machine that has torch and transformers alone: the closure of
what grpo-cli and the GPU suite import, minus what such a machine holds (`ON_IMAGE`, the one list of it), pinned to
the versions installed here. `python tests/gpu/wheel_set.py` prints the pins, one `name==version` a line."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]

ON_IMAGE = frozenset({
    # the premise of the suite's machine: torch, transformers, and what they need at every version pyproject admits
    "torch", "transformers", "triton", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2",
    "markupsafe", "fsspec", "setuptools", "huggingface-hub", "hf-xet", "numpy", "packaging", "pyyaml", "regex",
    "requests", "charset-normalizer", "idna", "urllib3", "certifi", "tokenizers", "safetensors", "tqdm",
    # compiled and large: pyarrow's wheel alone is ~42 MB of the 64 MiB a device call carries (datasets needs both)
    "pyarrow", "pandas", "python-dateutil", "six", "tzdata", "pytz",
})
"""Distributions the CUDA machine is assumed to hold: none of them is carried, nor walked for requirements."""

EXTRAS = ("lora", "deepspeed", "megatron")
"""pyproject extras the GPU suite runs (LoRA's head, ZeRO-2/3, megatron); vllm, sglang and ray are far too large
to carry, and the suite's tests that need vLLM skip without it."""

SUITE = ("pytest", "psutil", "pillow")
"""What the suite itself needs beyond the runtime: pytest and psutil (pyproject's `test` extra), pillow (vision rows:
`data/images.py` and transformers' image processors; the tiny VLM's images)."""

BUILT = frozenset({"deepspeed"})
"""An sdist whose build imports torch: make_wheels.sh builds its wheel here (ops off), pip downloads the rest."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


def wanted() -> list[str]:
    """The top-level distributions: pyproject's `dependencies`, the `EXTRAS`' and `SUITE`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [_name(r) for r in project["dependencies"]]
    names += [_name(r) for extra in EXTRAS for r in project["optional-dependencies"][extra]]
    return list(dict.fromkeys([*names, *SUITE]))


def requires(name: str) -> list[str]:
    """The unconditional requirements of the installed distribution `name` (its extras' left out)."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(canonical(req.name))
    return out


def closure(names: list[str]) -> dict[str, str]:
    """{distribution: installed version} of `names` and everything they require, `ON_IMAGE` excluded."""
    found: dict[str, str] = {}
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found or name in ON_IMAGE:
            continue
        found[name] = metadata.version(name)
        todo += requires(name)
    return dict(sorted(found.items()))


def pins() -> list[str]:
    """`name==version` of every wheel pip downloads (the `BUILT` ones are built by make_wheels.sh)."""
    return [f"{name}=={version}" for name, version in closure(wanted()).items() if name not in BUILT]


if __name__ == "__main__":
    print("\n".join(pins()))
