"""`rollout.engine: vllm-serve`: the client of a stock `vllm serve` (`client`, with `server_facts`: what it checks at
connect) and grpo-cli's vLLM plugin (`plugin`, `shm_engine`: the `grpo_shm` weight-transfer backend, imported only
inside vLLM). Its weight pushes over vLLM's RL API are transports beside the others (`transport/vllm_rl.py`)."""
