"""`rollout.engine: vllm-serve`: the client of a stock `vllm serve` (`client`), its weight pushes through vLLM's RL
API (`weights`), and grpo-cli's vLLM plugin (`plugin`, `shm_engine`: the `grpo_shm` weight-transfer backend, imported
only inside vLLM)."""
