"""The GPU suite runs on a CUDA machine with torch alone: collected as pytest collects it, only the tests that need
vLLM carry a vLLM-dependent skip condition, and every other one runs there (issue 36: the old module-level condition
skipped the whole suite on such a machine), with the wheels of everything else it imports (tests/gpu/make_wheels.sh,
issue 46: it carried neither typer, rich, httpx, xxhash, accelerate, pytest, peft nor pillow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).parents[1] / "gpu"
NEEDS_VLLM = {"test_gpu_vllm.py", "test_vllm_server_with_nccl_weight_transport",
              "test_first_used_by_preset_runs_three_steps"}
"""Files or test functions that generate with vLLM."""

COLLECT = """
import json, sys, pytest
class Grab:
    def pytest_collection_finish(self, session):
        self.rows = [(i.nodeid, [str(m.kwargs.get("reason", "")) + str(m.args) for m in i.iter_markers("skipif")])
                     for i in session.items]
grab = Grab()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]], plugins=[grab])
print("ROWS " + json.dumps(grab.rows))
"""


def test_only_the_vllm_tests_carry_the_vllm_condition():
    proc = subprocess.run([sys.executable, "-c", COLLECT, str(GPU)], capture_output=True, text=True, timeout=120,
                          cwd=GPU.parents[1])
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ROWS "))[5:])
    torch_only = [nodeid for nodeid, conditions in rows if not any("vllm" in c for c in conditions)]
    for nodeid, conditions in rows:
        wants_vllm = any(part in nodeid for part in NEEDS_VLLM)
        assert wants_vllm == any("vllm" in c for c in conditions), (nodeid, conditions)
    names = " ".join(torch_only)
    for backend in ("ddp", "fsdp2", "zero2", "zero3", "megatron"):
        assert f"resumes[{backend}]" in names
    for feature in ("tiny-cpu-lora", "tiny-cpu-tools", "reward_model", "diagnose_mismatch_with_the_hf_engine",
                    "memory_figures", "offload_lowers", "hf_server_on_the_same_gpu[http]", "same_gpu[shm]"):
        assert feature in names, feature


ISSUE_46 = ("typer", "rich", "httpx", "xxhash", "accelerate", "pytest", "peft", "pillow")
"""What make_wheels.sh did not carry, so that the suite stopped at its first import on a torch + transformers machine."""


def _wheel_set():
    sys.path.insert(0, str(GPU))
    try:
        import wheel_set
    finally:
        sys.path.remove(str(GPU))
    return wheel_set


def test_make_wheels_carries_pyproject_dependencies_and_the_suite_extras():
    """make_wheels.sh downloads tests/gpu/wheel_set.py's pins: each of pyproject's dependencies, of the extras the
    suite runs (lora, deepspeed, megatron) and of its test needs (pytest, psutil, pillow) is carried or on the image
    (`wheel_set.ON_IMAGE`, the one list of it), and so is everything a carried package requires. Nothing downloads."""
    import tomllib

    ws = _wheel_set()
    assert "tests/gpu/wheel_set.py" in (GPU / "make_wheels.sh").read_text()
    project = tomllib.loads((GPU.parents[1] / "pyproject.toml").read_text())["project"]
    needed = [*project["dependencies"], *(r for e in ("lora", "deepspeed", "megatron")
                                          for r in project["optional-dependencies"][e])]
    needed += [r for r in project["optional-dependencies"]["test"] if r.startswith(("pytest", "psutil"))]
    carried = {pin.split("==")[0] for pin in ws.pins()} | ws.BUILT
    for requirement in [*needed, "pillow"]:
        name = ws.canonical(requirement.split(">")[0].split("=")[0].split("<")[0].strip())
        assert name in carried or name in ws.ON_IMAGE, name
    assert set(ISSUE_46) <= carried and not set(ISSUE_46) & ws.ON_IMAGE
    for name in carried:
        missing = [r for r in ws.requires(name) if r not in carried and r not in ws.ON_IMAGE]
        assert not missing, (name, missing)


def test_what_the_gpu_suite_imports_travels_or_is_on_the_image():
    """Every distribution a tests/gpu module imports (at the top or inside a test) is carried, on the image, or
    vLLM's (whose tests skip without it); the suite's own modules and grpo_cli travel with the checkout."""
    import ast
    import importlib.metadata as metadata

    ws = _wheel_set()
    carried = {pin.split("==")[0] for pin in ws.pins()} | ws.BUILT
    local = {p.stem for p in GPU.parent.rglob("*.py")} | {"grpo_cli", "benchmarks", "tests"}
    owners = metadata.packages_distributions()
    for path in GPU.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - local - set(sys.stdlib_module_names) - {"vllm"}:
                dists = {ws.canonical(d) for d in owners.get(top, [top])}
                assert dists & (carried | ws.ON_IMAGE), (path.name, top, dists)
