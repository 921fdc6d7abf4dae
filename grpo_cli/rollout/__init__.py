"""Rollout engines behind one protocol (`base.RolloutEngine`): hf, vllm, the server and SGLang clients, the
Ray actors of async mode; `factory` picks one. The middle layer: imports server (wire format), algo, config,
runtime; never train."""
