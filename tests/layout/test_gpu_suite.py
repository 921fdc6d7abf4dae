"""The GPU suite runs on a CUDA machine with torch alone: collected as pytest collects it, only the tests that need
vLLM carry a vLLM-dependent skip condition, and every other one runs there (issue 36: the old module-level condition
skipped the whole suite on such a machine)."""

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
