"""`vllm.LLM`'s arguments of the colocated engine (`rollout.vllm.support.llm_kwargs`, pure): the CPU-only ones (KV
bytes, whole prefills, the multi-turn block size) on CPU only, so the CUDA branch is driven here too."""

from __future__ import annotations

import pytest

from grpo_cli.rollout.vllm.support import CPU_MULTI_TURN_BLOCK_SIZE, llm_kwargs

BASE = dict(dtype="float32", tensor_parallel_size=2, gpu_memory_utilization=0.3, max_model_len=8192,
            max_num_seqs=None, enforce_eager=True, seed=3, sleep=True, kv_cache_space_gib=1.5, distributed=True,
            block_size=None, multi_turn=True)


@pytest.mark.parametrize("cpu", [True, False])
def test_cpu_only_arguments_on_cpu_only(cpu):
    kwargs = llm_kwargs("m", **BASE, cpu=cpu)
    assert kwargs["max_num_batched_tokens"] == 8192 and kwargs["enable_sleep_mode"] is True
    assert kwargs["distributed_executor_backend"] == "external_launcher" and "max_num_seqs" not in kwargs
    cpu_only = {"kv_cache_memory_bytes": int(1.5 * 2**30), "enable_chunked_prefill": False,
                "block_size": CPU_MULTI_TURN_BLOCK_SIZE}
    assert {k: kwargs[k] for k in cpu_only if k in kwargs} == (cpu_only if cpu else {})


def test_a_set_block_size_wins_and_one_process_has_no_launcher():
    kwargs = llm_kwargs("m", **{**BASE, "block_size": 64, "distributed": False, "max_num_seqs": 4}, cpu=True)
    assert kwargs["block_size"] == 64 and kwargs["max_num_seqs"] == 4
    assert "distributed_executor_backend" not in kwargs
