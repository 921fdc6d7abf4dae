"""Launching: accelerate/torchrun command lines, `--rehearse`, `grpo doctor`. A command package (above train, rollout
and server, which it starts)."""
