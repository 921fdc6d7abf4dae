"""Launching: accelerate/torchrun command lines, `--rehearse`, `grpo doctor`. A command package (above train,
rollout and server, which it starts); imports those and the bottom layer, never cli."""
