"""vLLM in the training process (colocate; also what `grpo serve-rollout --engine vllm` wraps) and the checks of
the installed vLLM (`support`)."""
