"""`grpo plan` and `grpo train --dry-run`'s figures, from the config alone: the batch plan and per-GPU and host memory
(`plan.py`, the megatron rows `plan_megatron.py`, token budgets `plan_tokens.py`, reward models `plan_rewards.py`),
their text (`plan_render.py`) and the DeepSpeed JSON (`deepspeed.py`)."""
