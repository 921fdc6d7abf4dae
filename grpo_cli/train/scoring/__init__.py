"""The reward phase of a step: rewards of a rollout, step (process) rewards, dynamic sampling. Imports
rewards, algo, config, runtime."""
