"""Held-out evaluation: during training (`eval.every_steps`) with the run's own engine, and `grpo eval`. The
middle layer, beside train: imports train, rollout, rewards, data, algo, config, runtime."""
