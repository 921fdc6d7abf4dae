"""benchmarks/rss_phases.py names the phase the memory peaked in: on the tiny Llama, a 400 MB buffer held only while
the output layer's backward runs puts the peak there, and the base is the resident set before the train phase."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.rss_phases import STATM, RssPhases  # noqa: E402

BIG = 400 << 20


@pytest.mark.skipif(not STATM.exists(), reason="rss_phases reads /proc/self/statm (Linux)")
def test_the_peak_is_named_by_the_phase_it_fell_in(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    phases = RssPhases()
    phases.watch(model, optimizer)
    held: list[torch.Tensor] = []

    def hold_while_running(_module, _grad):  # runs after the phase hook: a peak inside "backward output layer"
        held.append(torch.ones(BIG // 4))
        import time

        time.sleep(0.2)
        held.clear()

    model.get_output_embeddings().register_full_backward_pre_hook(hold_while_running)
    phases.start()
    phases.step_begins()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    got = phases.stop()
    assert got["peak_phase"] == "backward output layer", got
    assert got["sampled_peak_mb"] - got["step_base_mb"] > 0.8 * BIG / 2**20, got
    assert phases.phase == "after the step"
