"""Long context before any model loads: `grpo plan` divides the activations and the head's logits chunk by the
sequence-parallel size (megatron: the context-parallel size) and names the longest sequence one GPU fits at each
size; megatron's `context_parallel_size` enters the grid, is modelled by the plan and `--rehearse`, and is refused by
`grpo train` with megatron-core's reason (checked against megatron-core itself)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from grpo_cli.algo.chunk_size import chunk_bytes
from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.config.model_shape import model_shape
from grpo_cli.config.rules_megatron import megatron_layout
from grpo_cli.planner.plan import GIB, memory_plan, peak_bytes
from grpo_cli.planner.plan_render import render_plan
from grpo_cli.planner.plan_sequence import longest_sequence, sharded_rows
from grpo_cli.planner.plan_tokens import micro_batch_positions
from grpo_cli.launch.rehearse import plan_rehearsal

PRESET = "qwen3-8b-long-sp4"
MEG = ["distributed.backend=megatron", "rollout.engine=vllm", "train.micro_batch_size=1", "distributed.device=cuda",
       "distributed.num_processes=8", "train.prompts_per_step=8", "model.name_or_path=Qwen/Qwen3-8B",
       "rollout.max_completion_length=16384", "model.dtype=bfloat16", "distributed.megatron.recompute=selective",
       "distributed.megatron.tensor_parallel=2", "rollout.vllm.sleep_level=2"]


def _longest(text: str) -> dict[int, int]:
    return {int(n): int(v) for n, v in re.findall(r"longest_sequence_(?:sp|cp)(\d) +(\d+)", text)}


def test_sequence_parallel_divides_the_activations_and_the_head_chunk():
    """At sp 4 each GPU keeps a quarter of the micro-batch's positions (rounded up): the activations row divides by
    4 exactly and the head chunk holds a quarter of the positions (fewer bytes once that is below one CUDA chunk's
    rows); the rest of the plan is unchanged."""
    sp4 = build_config(PRESET)
    sp1 = build_config(PRESET, overrides=["distributed.sequence_parallel.size=1"])
    a, b = memory_plan(sp4, 80 * GIB), memory_plan(sp1, 80 * GIB)
    assert a["activations"] * 4 == pytest.approx(b["activations"])
    positions = micro_batch_positions(sp4)
    assert a["head_chunk"] == chunk_bytes(model_shape(sp4.model.name_or_path).vocab, -(-positions // 4), device="cuda")
    short = ["data.max_prompt_length=256", "rollout.max_completion_length=1024",  # 1280 positions < a chunk's 1766
             "train.micro_batch_tokens=1280"]
    assert memory_plan(build_config(PRESET, overrides=short), 80 * GIB)["head_chunk"] * 4 == pytest.approx(
        memory_plan(build_config(PRESET, overrides=[*short, "distributed.sequence_parallel.size=1"]),
                    80 * GIB)["head_chunk"])
    assert {k: v for k, v in a.items() if k not in ("activations", "head_chunk")} == \
        {k: v for k, v in b.items() if k not in ("activations", "head_chunk")}


def test_preset_needs_sequence_parallel_4_and_plan_names_the_longest_sequences():
    """The long-context preset: its 33,792-position sequence fits one 80 GiB GPU at sp 4 but not at 1 or 2 (what its
    header says), each doubling of sp about doubles the longest sequence, and the token-budget rows count a GPU's
    share."""
    cfg = build_config(PRESET)
    text = render_plan(cfg, gpu_mem=80 * GIB)
    longest = _longest(text)
    assert sorted(longest) == [1, 2, 4, 8]
    assert longest[1] < longest[2] < cfg.max_sequence_length <= longest[4] < longest[8]
    assert longest[8] >= 2 * longest[4] - 512 and longest[2] >= 2 * longest[1] - 512
    assert "longest_sequence_sp4" in text and re.search(r"longest_sequence_sp4 +\d+ \(configured\)", text)
    assert "positions_per_gpu            8448 of the micro-batch's 33792" in text
    one = build_config(PRESET, overrides=["distributed.sequence_parallel.size=1"])
    per = re.search(r"activations_per_position +([\d.]+) MiB", text).group(1)
    per1 = re.search(r"activations_per_position +([\d.]+) MiB", render_plan(one, gpu_mem=80 * GIB)).group(1)
    assert float(per) * 4 == pytest.approx(float(per1), abs=2e-3)


def test_longest_sequence_is_the_boundary_of_the_fit():
    """The search's answer fits and 256 more positions do not."""
    cfg = build_config(PRESET)
    mem, shape, limit = memory_plan(cfg, 80 * GIB), model_shape(cfg.model.name_or_path), 76 * GIB
    plan = {"max_sequence_length": cfg.max_sequence_length, "gradient_accumulation": 1}
    found = longest_sequence(cfg, mem, plan, 2, limit, device="cuda", peak=peak_bytes)

    def peak(n):
        return peak_bytes(cfg, mem | sharded_rows(cfg, shape, plan, device="cuda", shards=2, length=n))

    assert peak(found) <= limit < peak(found + 256)


def test_splits_the_grid_cannot_run_are_marked():
    """Ulysses needs the size to divide the heads (Qwen2.5-7B's 28: not 8); any size must divide the processes."""
    cfg = build_config(PRESET, overrides=["model.name_or_path=Qwen/Qwen2.5-7B-Instruct"])
    text = render_plan(cfg, gpu_mem=80 * GIB)
    assert re.search(r"longest_sequence_sp8 .*\[ulysses: does not divide the 28 attention heads \(ring can\)\]", text)
    ring = render_plan(build_config(PRESET, overrides=["distributed.sequence_parallel.style=ring",
                                                       "model.name_or_path=Qwen/Qwen2.5-7B-Instruct"]), gpu_mem=80 * GIB)
    assert not re.search(r"longest_sequence_sp8 .*\[", ring)
    four = render_plan(build_config(PRESET, overrides=["distributed.num_processes=4", "train.prompts_per_step=4"]),
                       gpu_mem=80 * GIB)
    assert re.search(r"longest_sequence_sp8 .*\[does not divide the 4 processes\]", four)


def test_megatron_context_parallel_in_the_grid_and_the_plan():
    """cp 2 halves data parallel (the distributed optimizer still shards over dp·cp, so the state is unchanged) and
    halves the per-layer activations; the plan says `grpo train` refuses it."""
    cp1 = build_config(overrides=MEG)
    cp2 = build_config(overrides=[*MEG, "distributed.megatron.context_parallel_size=2"])
    assert megatron_layout(cp2)["dp"] == 2 and megatron_layout(cp1)["dp"] == 4
    a, b = memory_plan(cp2, 80 * GIB), memory_plan(cp1, 80 * GIB)
    assert (a["weights"], a["gradients"], a["optimizer"]) == (b["weights"], b["gradients"], b["optimizer"])
    vocab = model_shape(cp1.model.name_or_path).vocab // 2  # the head's shard at tp 2
    head1 = chunk_bytes(vocab, cp1.max_sequence_length, device="cuda")
    head2 = chunk_bytes(vocab, cp1.max_sequence_length // 2, device="cuda")
    assert a["activations"] - head2 == pytest.approx((b["activations"] - head1) / 2)
    text = render_plan(cp2, gpu_mem=80 * GIB)
    assert "megatron context_parallel_size 2" in text and "`grpo train` refuses context_parallel_size > 1" in text
    assert "dense 1/(tp x pp x dp 2 x cp 2)" in text
    longest = _longest(text)
    assert sorted(longest) == [1, 2, 4, 8] and longest[1] < cp2.max_sequence_length < longest[2] < longest[4]
    assert re.search(r"longest_sequence_cp8 .*\[tp x pp x 8 does not divide the 8 processes\]", text)
    with pytest.raises(ConfigError, match=r"context_parallel_size=3 = 6 does not divide the 8 training processes.*"
                                          r"valid context_parallel_size values: \[1, 2, 4\]"):
        build_config(overrides=[*MEG, "distributed.megatron.context_parallel_size=3"])


def test_grpo_train_refuses_megatron_context_parallel_with_the_reason(tmp_path):
    """Exit 2 before any worker starts, the message naming megatron-core's file and function; `--dry-run` and
    `grpo plan` still show the plan."""
    sets = [x for kv in ("distributed.backend=megatron", "rollout.engine=vllm", "distributed.num_processes=2",
                         "train.prompts_per_step=2", "train.micro_batch_size=1",
                         "distributed.megatron.context_parallel_size=2") for x in ("--set", kv)]
    out = CliRunner().invoke(app, ["train", "tiny-cpu", *sets, "--output-dir", str(tmp_path)])
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    assert "context_parallel_size=2 cannot train" in text and "TEDotProductAttention" in text
    assert "DotProductAttention.__init__, megatron/core/transformer/dot_product_attention.py" in text
    assert "Traceback" not in out.output
    dry = CliRunner().invoke(app, ["train", "tiny-cpu", *sets, "--dry-run"])
    assert dry.exit_code == 0 and "context_parallel_size: 2" in dry.output
    assert CliRunner().invoke(app, ["plan", "tiny-cpu", *sets]).exit_code == 0


def test_rehearsal_drops_context_parallel_and_says_so():
    src = build_config(overrides=[*MEG, "distributed.megatron.context_parallel_size=4", "train.steps=20"])
    reh = plan_rehearsal(src, deepspeed_ready=True)
    assert reh.config.distributed.megatron.context_parallel_size == 1
    assert any("context_parallel_size 4 NOT rehearsed" in n for n in reh.notes)
    assert any(w == "megatron context parallel" and "refused by `grpo train`" in why for w, why in reh.gpu_only)


def test_rehearsal_shrinks_sequence_parallel_to_the_processes():
    reh = plan_rehearsal(build_config(PRESET), deepspeed_ready=True)
    sp = reh.config.distributed.sequence_parallel
    assert (sp.size, sp.style, reh.config.distributed.num_processes) == (2, "ulysses", 2)
    assert "sequence_parallel size 4 → 2 (ulysses; the process count): one sequence shared by 2 process(es) " \
           "instead of 4" in reh.notes
    assert any(w == "long sequences" for w, _ in reh.gpu_only)


def test_megatron_core_still_refuses_context_parallel_without_transformer_engine():
    """The refusal's reason, checked against the installed megatron-core: its pure-torch attention (the spec the
    backend builds) asserts context_parallel_size == 1. When a megatron-core release lifts that, this fails and the
    refusal (config/rules_megatron.py) should go."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, context_parallel_size=2)
    with pytest.raises(AssertionError, match="only supported by TEDotProductAttention"):
        DotProductAttention(config, 1, AttnMaskType.causal, "self")


def test_backend_refuses_context_parallel_before_any_process_group():
    """Any caller of the megatron backend (not only `grpo train`) gets the refusal before a group is made."""
    pytest.importorskip("megatron.core")
    import torch

    from grpo_cli.config.errors import UserError
    from grpo_cli.train.backends.megatron.build import init_parallel_state

    cfg = build_config(overrides=[*MEG[:3], "distributed.num_processes=2", "train.prompts_per_step=2",
                                  "distributed.megatron.context_parallel_size=2"])
    with pytest.raises(UserError, match="context_parallel_size=2 cannot train"):
        init_parallel_state(cfg, 2, torch.device("cpu"))
    assert not torch.distributed.is_initialized()


def test_a_group_over_the_whole_mesh_never_gathers_the_vocabulary():
    """fsdp2 with the sequence-parallel group as the whole mesh (4 processes, sp 4) keeps the embedding and output
    layer as shards (`models.vocab_parallel`): the gathered root is the final norm alone, and the transient gradients
    add the rows' float32 gradient (a quarter of the vocabulary's parameters); at data parallel 2 (the preset's 8
    processes) they are gathered as before."""
    four = ["distributed.num_processes=4", "train.prompts_per_step=4"]
    whole = memory_plan(build_config(PRESET, overrides=four), 80 * GIB)
    split = memory_plan(build_config(PRESET, overrides=[*four, "distributed.sequence_parallel.size=2"]), 80 * GIB)
    shape = model_shape(build_config(PRESET).model.name_or_path)
    vocabulary = shape.root_params - shape.hidden
    assert vocabulary == 151_936 * 4096 * 2  # Qwen3-8B: untied
    assert split["weights_gathered"] - whole["weights_gathered"] == pytest.approx(vocabulary * 2)
    layer = shape.layer_params
    assert whole["gradients_transient"] == pytest.approx(shape.hidden * 2 + layer * (2 + 4) + vocabulary / 4 * 4)


def test_the_vocabulary_parallel_head_chunk_divides_its_columns():
    """Under the vocabulary-parallel head every rank projects every position of the group onto V/sp columns, a
    chunk holding the whole vocabulary's rows (`models.sequence_logprobs._vocab_parallel`): the plan's head chunk is
    1/sp of the unsharded one once the micro-batch fills a chunk."""
    four = ["distributed.num_processes=4", "train.prompts_per_step=4"]
    sp4 = build_config(PRESET, overrides=four)
    sp1 = build_config(PRESET, overrides=[*four, "distributed.sequence_parallel.size=1"])
    vocab = model_shape(sp4.model.name_or_path).vocab
    rows = chunk_bytes(vocab, 1 << 30, device="cuda") // (vocab * 4 * 3)  # positions per chunk: 1,766
    assert memory_plan(sp4, 80 * GIB)["head_chunk"] == rows * (-(-vocab // 4)) * 4 * 3
    assert memory_plan(sp1, 80 * GIB)["head_chunk"] == chunk_bytes(vocab, 1 << 30, device="cuda") == rows * vocab * 12
