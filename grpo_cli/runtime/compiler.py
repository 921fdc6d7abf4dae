"""Whether `torch.compile`'s inductor backend can build kernels on this machine (`rollout.compile`)."""

from __future__ import annotations

import os
import sysconfig

import torch

from grpo_cli.config.errors import UserError


def compiler_problem(device: torch.device) -> str | None:
    """Why inductor cannot build kernels for `device` here (no C++ compiler or no Python headers on CPU), or None."""
    if device.type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - inductor raises its own InvalidCxxCompiler (or an import error)
        return f"no C++ compiler found (inductor looks for $CXX or g++; CXX={os.environ.get('CXX', 'unset')})"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"the Python headers are missing ({include}/Python.h; install the python3-dev package)"
    return None


def require_compiler(device: torch.device, *, setting: str = "rollout.compile") -> None:
    """Raise a UserError naming the fix when `setting` (which asks for a compiled decode step) cannot build kernels
    for `device`."""
    problem = compiler_problem(device)
    if problem is not None:
        raise UserError(f"{setting} needs inductor to build CPU kernels, but {problem}. Install a C++ compiler and "
                        f"the Python headers, or {turn_off(setting)}.")


def turn_off(setting: str) -> str:
    """How to turn `setting` off: `drop --flag` for a command-line flag, `set key=false` for a config key."""
    return f"drop {setting}" if setting.startswith("--") else f"set {setting}=false"
