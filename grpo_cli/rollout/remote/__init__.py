"""The HTTP client of a rollout server (`grpo serve-rollout`): generation, weight pushes, sleep/wake."""
