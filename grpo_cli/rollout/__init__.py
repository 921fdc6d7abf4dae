"""Rollout engines behind one contract (`base.RolloutEngine`), one folder per engine family: `hf/` (grpo-cli's own
decode loop over the transformers model), `vllm/` (vLLM in the training process), `remote/` (the HTTP client of `grpo
serve-rollout`), `sglang/` (an SGLang server's client), `ray/` (the actors of async mode); `factory` picks one. The
weight transports of the server clients (http, shm, nccl, SGLang disk/tensor) and their wire code are in `transport/`,
behind one interface and registry. The trainer's own logprob code lives in `models/`."""
