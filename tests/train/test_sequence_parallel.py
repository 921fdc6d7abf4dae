"""`distributed.sequence_parallel` at size 2 on two real gloo processes (sequence_parallel_worker.py, one launch):
logprobs, entropy, loss and gradients of a micro-batch cut across the ranks equal the whole micro-batch's, for
Ulysses (each inner attention: the packed layout, causal query chunks, plain causal) and ring (the CPU's fused
flash-attention blocks, and the hand-written ones CUDA runs), grpo (with KL), dapo (with an entropy bonus), gspo,
cispo and LoRA, on a packed row of two prompt groups whose length is odd and on one sequence; and one optimizer step through ddp and fsdp2 (the ranks' batches gathered, token-budget micro-batches, KL
to the reference) reduces the whole batch's gradient, and the no-grad passes (old policy, reference) give the whole
batch's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("sequence_parallel_worker.py"))
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    return run_two_ranks(WORKER, [tiny_checkpoint], tmp_path_factory.mktemp("sequence-parallel"), timeout=240)


@pytest.mark.parametrize("style", ["ulysses", "ulysses-chunks", "ring", "ring-math"])
@pytest.mark.parametrize("case", ["grpo", "dapo", "gspo", "cispo", "dapo+lora", "one-sequence"])
def test_sharded_micro_batch_equals_the_whole(ranks, style, case):
    for rank in ranks:
        got = rank[f"{style}/{case}"]
        assert got["names"] and got["grad_scale"] > 0
        assert got["logprobs"] < TOL and got["entropy"] < TOL and got["loss"] < TOL, got
        assert got["grads"] < TOL, got


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_backend_step_reduces_the_whole_batch_gradient(ranks, backend):
    for rank in ranks:
        got = rank[f"backend/{backend}"]
        assert got["rows"] == 9 and got["names"]  # rank 0's 6 rows and rank 1's 3, gathered
        assert got["grads"] < TOL and got["logprobs"] < TOL, got
        assert got["widened"] < TOL, got  # a rank's rows, widened by the gather, keep their own logprobs


def test_a_shard_that_predicts_no_token(ranks):
    """[prompt | 1 token | 1 token] cut in two: the first shard is all prompt. Its rank still runs the output layer
    (at weight 0), so DDP's reducer gets every gradient and the step equals the whole batch's."""
    for rank in ranks:
        got = rank["backend/ddp-empty-shard"]
        assert got["rows"] == 4 and got["names"]
        assert got["grads"] < TOL and got["logprobs"] < TOL, got
