"""`python -m grpo_cli` (used by `accelerate launch -m grpo_cli` and torchrun workers)."""

from grpo_cli.cli.main import main

main()
