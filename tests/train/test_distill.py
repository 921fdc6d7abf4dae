"""`algorithm.distill` around the math: a teacher of another tokenizer refused at start (exit 2, both paths named),
the config rules, `grpo plan` counting a local teacher like the reference, and the phase that writes the (B, T)
distilled advantages from the teacher's and the student's logprobs."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError
from grpo_cli.config.load import build_config
from grpo_cli.config.model_shape import BYTES, model_shape
from grpo_cli.planner.plan import memory_plan, resident_while_generating
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.distill import distill_phase, tokenizer_difference

runner = CliRunner()


def test_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, tiny_checkpoint):
    from grpo_cli.models.tiny import build_tiny_checkpoint

    chars = build_tiny_checkpoint(tmp_path / "chars", chars=True)  # same architecture, a character tokenizer
    result = runner.invoke(app, ["train", "--set", f"model.name_or_path={tiny_checkpoint}", "--set",
                                 f"algorithm.distill.teacher={chars}", "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert str(chars) in text and tiny_checkpoint in text and "vocabularies differ" in text
    assert "Traceback" not in result.output


def test_the_distill_preset_without_its_teacher_names_the_command_that_makes_it(tmp_path, monkeypatch):
    """Issue 46 (4.9): a new user runs the preset from the list, not its YAML header. The list says a teacher is
    trained first and how; without it the run stops (exit 2, before the policy loads) naming that command."""
    monkeypatch.chdir(tmp_path)
    listed = runner.invoke(app, ["presets", "list"])
    line = next(row for row in listed.output.splitlines() if row.startswith("tiny-cpu-distill "))
    assert "teacher" in line and "grpo train --output-dir runs/tiny-teacher" in line
    result = runner.invoke(app, ["train", "--preset", "tiny-cpu-distill", "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "runs/tiny-teacher/final-model is not a folder" in text and "Traceback" not in result.output
    assert "Train the teacher first: `grpo train --output-dir runs/tiny-teacher`" in text


def test_tokenizer_difference_sees_special_tokens(tiny_checkpoint):
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert tokenizer_difference(a, b) is None
    b.eos_token = "<pad>"  # same vocabulary, another EOS
    diff = tokenizer_difference(a, b)
    assert diff is not None and "special" in diff and "<eos>" in diff


@pytest.mark.parametrize("sets,needle", [
    (["algorithm.distill.teacher=http://127.0.0.1:9", "rollout.temperature=0.7"], "rollout.temperature: 1.0"),
    (["algorithm.distill.teacher=builtin:tiny", "distributed.backend=megatron", "distributed.num_processes=1"],
     "megatron backend does not load"),
    (["algorithm.distill.teacher=builtin:tiny", "algorithm.distill.mode=sum"], "mode"),
    (["algorithm.distill.coef=1"], "teacher"),
    (["algorithm.distill.teacher=builtin:tiny", "algorithm.distill.token_env=T"], "remove token_env"),
])
def test_config_rules(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config("tiny-cpu", overrides=sets)


def test_plan_counts_a_local_teacher_like_the_reference():
    base = build_config("qwen-1.5b-colocate")
    cfg = build_config("qwen-1.5b-colocate", overrides=["algorithm.distill.teacher=Qwen/Qwen2.5-7B-Instruct"])
    mem, before = memory_plan(cfg, 80 * 1024**3), memory_plan(base, 80 * 1024**3)
    want = model_shape("Qwen/Qwen2.5-7B-Instruct").params * BYTES[cfg.model.dtype]
    assert mem["teacher"] == pytest.approx(want) and "teacher" not in before
    assert resident_while_generating(cfg, mem)["teacher"] == mem["teacher"]
    served = build_config("qwen-1.5b-colocate", overrides=["algorithm.distill.teacher=http://10.0.0.1:8000"])
    assert "teacher" not in memory_plan(served, 80 * 1024**3)  # a served teacher holds no memory here


def _batch(adv: torch.Tensor) -> TrainBatch:
    cmask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ids = torch.zeros(2, 5, dtype=torch.long)
    return TrainBatch(ids, torch.ones(2, 5, dtype=torch.long), cmask, advantages=adv,
                      truncated=torch.tensor([False, True]))


@pytest.mark.parametrize("mu", [1, 2])
def test_phase_uses_behaviour_logprobs_and_trained_mask(mu):
    cfg = build_config("tiny-cpu", overrides=["algorithm.distill.teacher=builtin:tiny", "algorithm.distill.clip=1.0",
                                              "algorithm.distill.coef=0.5",
                                              "algorithm.mask_truncated_completions=true"])
    batch = _batch(torch.tensor([1.0, -1.0]))
    student = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-1.5, -0.5, -9.0], [-3.0, -3.0, -3.0]])
    calls = []
    if mu == 2:
        batch.old_logprobs = student
    metrics = distill_phase(cfg, batch, lambda b: teacher, lambda: calls.append(1) or student,
                            info=DistInfo())
    assert calls == ([1] if mu == 1 else [])  # μ > 1 reuses the old logprobs: no second student pass
    # row 0: x = 0.5, -1.5 (clipped to -1), masked; row 1 truncated: out of the trained mask
    torch.testing.assert_close(batch.advantages, torch.tensor([[1.0 - 0.25, 1.0 + 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.5)
    assert metrics["distill/teacher_logprob"] == pytest.approx(-1.0)
    assert metrics["distill/clipped_frac"] == pytest.approx(0.5)
    assert metrics["distill/advantage_share"] == pytest.approx(0.75 / 2.75)


def test_a_server_without_serve_rollouts_routes_is_refused_with_the_fix(tiny_checkpoint):
    """A stock `vllm serve` answers /health but has no /info or /score: refused at start, naming the fix."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo_cli.config.errors import UserError
    from grpo_cli.train.distill import served_teacher

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        cfg = build_config("tiny-cpu", overrides=[f"algorithm.distill.teacher={url}"])
        with pytest.raises(UserError, match="grpo serve-rollout --model TEACHER") as err:
            served_teacher(cfg, tiny_checkpoint, None)
        assert url in str(err.value) and "vllm serve" in str(err.value)
    finally:
        httpd.shutdown()


def test_a_dumped_distill_config_validates_again():
    """Ray actors and resumed runs rebuild the config from its full dump (every field set)."""
    from grpo_cli.config.schema import GRPOConfig

    cfg = build_config("tiny-cpu", overrides=["algorithm.distill.teacher=builtin:tiny"])
    assert GRPOConfig.model_validate(cfg.model_dump(mode="json")) == cfg
