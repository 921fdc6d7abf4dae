"""rollout package."""
