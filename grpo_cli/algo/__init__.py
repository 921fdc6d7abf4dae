"""Pure tensor math of GRPO: advantages, objectives, aggregation, KL, IS correction, mismatch metrics.
The bottom layer: imports torch and the standard library only, nothing else of grpo_cli."""
