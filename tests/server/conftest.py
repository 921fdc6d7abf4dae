"""Helpers for server tests: real `python -m grpo_cli.cli.serve` subprocesses whose printed URL is parsed, and
served-tiny fixtures (threaded apps live in served_app.py). Every wait here is bounded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


class ServerProcess:
    """A `python -m grpo_cli.cli.serve` child; `url` parsed from its ready line."""

    def __init__(self, model: str, *, engine: str = "hf", port: int = 0, token: str | None = None,
                 extra: tuple[str, ...] = (), timeout_s: float = 60.0) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("GRPO_TEST_TOKEN", None)
        if token:
            env["GRPO_TEST_TOKEN"] = token
        cmd = [sys.executable, "-m", "grpo_cli.cli.serve", "--engine", engine, "--model", model,
               "--port", str(port), "--token-env", "GRPO_TEST_TOKEN", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.url = self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        from grpo_cli.server.launch import wait_ready_line

        url = wait_ready_line(self.proc, timeout_s, self.lines.append)
        if url is None:
            self.kill()
            log = "".join(self.lines)[-3000:]
            raise RuntimeError(f"server did not start within {timeout_s} s (exit code {self.proc.poll()}):\n{log}")
        return url

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def server_process(tiny_checkpoint):
    started: list[ServerProcess] = []

    def start(**kw) -> ServerProcess:
        kw.setdefault("model", tiny_checkpoint)
        p = ServerProcess(**kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture
def served_tiny(tiny_checkpoint):
    """The hf engine on the tiny checkpoint, as `grpo serve-rollout` builds it (in this process)."""
    from grpo_cli.server.engines import ServeOptions, build

    return build(ServeOptions(engine="hf", model=tiny_checkpoint))


@pytest.fixture(scope="session")
def served_vlm():
    """The hf engine on the built-in tiny VLM as `grpo serve-rollout` builds it (in this process), and two chat
    prompts with one image each, expanded as the trainer's data loader expands them: (served, ids, images)."""
    from transformers import AutoTokenizer

    from grpo_cli.data.images import ImageProcessor
    from grpo_cli.data.prompts import tokenize_prompts
    from grpo_cli.models.tiny import resolve_model_path
    from grpo_cli.server.engines import ServeOptions, build
    from served_app import image_of

    path = resolve_model_path("builtin:tiny-vlm")
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": image_of(s)},
                                                     {"type": "text", "text": "how many shapes are there ?"}]}]}
            for s in (1, 2)]
    prompts, _ = tokenize_prompts(rows, AutoTokenizer.from_pretrained(path), prompt_column="prompt",
                                  max_prompt_length=64, overlong_prompts="error",
                                  images=ImageProcessor.load(path, max_pixels=10**6))
    return build(ServeOptions(engine="hf", model=path)), [p.ids for p in prompts], [p.images for p in prompts]
