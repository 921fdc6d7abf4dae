"""What a stock `vllm serve` must offer `rollout.engine: vllm-serve`, read from its dev-mode `/server_info`
(vLLM's resolved config as JSON) and checked at connect, each refusal naming the flag that fixes it."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.rollout.base import RolloutError

WEIGHT_BACKENDS = {"shm": "grpo_shm", "nccl": "nccl"}
"""`rollout.server.weight_transport` → the `vllm serve --weight-transfer-config` backend it needs."""


def serve_command(model: str, transport: str, *, port: int | None = None) -> str:
    """The `vllm serve` command line that a `vllm-serve` run with `transport` trains against (docs/server-mode.md)."""
    backend = WEIGHT_BACKENDS.get(transport, "grpo_shm")
    return (f"VLLM_SERVER_DEV_MODE=1 vllm serve {model} --host 127.0.0.1 --port {port or 8000} --enable-scale-out "
            f"--logprobs-mode processed_logprobs --weight-transfer-config '{{\"backend\": \"{backend}\"}}'")


@dataclass(frozen=True)
class ServerFacts:
    """The facts of one server the client relies on."""

    dtype: str
    """The dtype vLLM holds the weights in (`float32`, `bfloat16`, ...)."""
    logprobs_mode: str
    weight_backend: str | None
    max_model_len: int | None
    tensor_parallel_size: int

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
                   tensor_parallel_size=int(parallel.get("tensor_parallel_size") or 1))

    def check(self, url: str, transport: str, hint: str) -> None:
        """Refuse a server whose sampled logprobs are not the processed ones, or that was started without the
        weight-transfer backend the trainer's transport needs."""
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
