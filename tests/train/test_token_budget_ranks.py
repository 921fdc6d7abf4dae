"""`train.micro_batch_tokens` on two real gloo processes (token_budget_worker.py): a rank whose short rows make
fewer micro-batches runs as many as the other (ddp's buffer broadcasts, fsdp2's gathers and reduce-scatters stay
paired), and the reduced gradients equal one micro-batch per rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("token_budget_worker.py"))


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    return run_two_ranks(WORKER, [tiny_checkpoint], tmp_path_factory.mktemp("token-budget"), timeout=240)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_ranks_run_the_same_number_of_micro_batches(ranks, backend):
    zero, one = ranks[0][backend], ranks[1][backend]
    assert zero["whole"]["run"] == one["whole"]["run"] == 1
    assert zero["budget"]["own"] < one["budget"]["own"]  # short rows: fewer micro-batches of rank 0's own
    assert zero["budget"]["run"] == one["budget"]["run"] == one["budget"]["own"]


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_the_gradients_equal_one_micro_batch_per_rank(ranks, backend):
    assert ranks[0][backend]["grads"] > 0
    assert ranks[0][backend]["max_diff"] < 1e-6 and ranks[1][backend]["max_diff"] < 1e-6
