"""grpo-cli: post-train language models with GRPO from the command line."""

__version__ = "0.1.0"
