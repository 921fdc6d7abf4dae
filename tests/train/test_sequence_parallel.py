"""`distributed.sequence_parallel` at size 2 on two real gloo processes (sequence_parallel_worker.py, one launch):
logprobs, entropy, loss and gradients of a micro-batch cut across the ranks equal the whole micro-batch's, for
Ulysses (each inner attention: the packed layout, causal query chunks, plain causal) and ring (the CPU's fused
flash-attention blocks, and the hand-written ones CUDA runs), grpo (with KL), dapo (with an entropy bonus), gspo,
cispo and LoRA, on a packed row of two prompt groups whose length is odd and on one sequence; and one optimizer step through ddp and fsdp2 (the ranks' batches gathered, token-budget micro-batches, KL
to the reference) reduces the whole batch's gradient, and the no-grad passes (old policy, reference) give the whole
batch's logprobs; under fsdp2 through the vocabulary-parallel embedding and output layer (untied and tied), and
after a plain forward that gathered them."""

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


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "fsdp2-tied"])
def test_backend_step_reduces_the_whole_batch_gradient(ranks, backend):
    """fsdp2 (the group is the whole mesh) runs its embedding and output layer vocabulary-parallel: every pass
    (the no-grad passes and the step's budgeted micro-batches) goes through it, and the shard is never gathered."""
    for rank in ranks:
        got = rank[f"backend/{backend}"]
        assert got["rows"] == 9 and got["names"]  # rank 0's 6 rows and rank 1's 3, gathered
        assert got["grads"] < TOL and got["logprobs"] < TOL, got
        assert got["widened"] < TOL, got  # a rank's rows, widened by the gather, keep their own logprobs
        vocab, own = got["paths"]["_vocab_parallel"], got["paths"]["_own_positions"]
        assert (own if backend == "ddp" else vocab) >= 4 and (vocab if backend == "ddp" else own) == 0, got
        assert got["embedding_sharded"] == (backend != "ddp") and got["tied"] == (backend == "fsdp2-tied")


def test_fsdp2_bf16_compute_casts_the_vocabulary_rows(ranks):
    """model.dtype=bfloat16 (FSDP2's mixed precision: float32 masters, bf16 compute, as on a GPU): the vocabulary
    rows are cast to bf16 like the gathered weights FSDP2 computes with, and the step's float32 gradient and the
    logprobs stay within bf16's rounding of the float32 whole batch's."""
    for rank in ranks:
        got = rank["backend/fsdp2-bf16"]
        assert got["rows_dtypes"] == ["torch.bfloat16"] and got["paths"]["_own_positions"] == 0, got
        assert got["names"] and got["grads"] < 0.05 and got["logprobs"] < 0.02, got  # measured 0.015, 0.0035


def test_fsdp2_step_after_a_plain_forward(ranks):
    """A plain forward of the fsdp2 policy (the model called whole, not cut) gathers the vocabulary unit like any
    FSDP2 unit, tied output layer included, and gives the whole batch's logprobs; the step's first micro-batch then
    runs on the gathered weight (the whole-weight path), FSDP2 reshards the unit after its backward, and the next
    micro-batches run vocabulary-parallel: the reduced gradient is still the whole batch's."""
    for rank in ranks:
        got = rank["backend/fsdp2-gathered"]
        assert got["plain"] < TOL and got["grads"] < TOL and got["logprobs"] < TOL, got
        assert got["step_paths"] == {"_own_positions": 1, "_vocab_parallel": 1}, got  # 2 budgeted micro-batches
        assert got["tied"] and got["embedding_sharded"]


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_a_shard_that_predicts_no_token(ranks, backend):
    """[prompt | 1 token | 1 token] cut in two: the first shard is all prompt. Under ddp its rank still runs the
    output layer (at weight 0), so DDP's reducer gets every gradient; under fsdp2's vocabulary-parallel head it
    contributes no hidden state to the gather but projects the other rank's; either way the step equals the whole
    batch's."""
    for rank in ranks:
        got = rank[f"backend/{backend}-empty-shard"]
        assert got["rows"] == 4 and got["names"]
        assert got["grads"] < TOL and got["logprobs"] < TOL, got
