"""Training orchestration: the loop, the policy, weight sync, offload, checkpoints."""
