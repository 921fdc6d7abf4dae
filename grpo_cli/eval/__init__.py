"""`grpo eval`: a saved checkpoint evaluated held-out with an engine of its own, as the run's own evaluation does
(`train.evaluation`)."""
