"""Pure tensor math of GRPO: advantages, objectives, aggregation, KL, IS correction, mismatch metrics; torch and the
standard library only."""
