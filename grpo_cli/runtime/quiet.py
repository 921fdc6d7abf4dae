"""Log hygiene for the libraries a grpo-cli process drives: no tokenizer fork warnings, no per-load progress bars,
no DeepSpeed accelerator probe on CPU."""

from __future__ import annotations

import os


def quiet_hf_stack() -> None:
    """Turn off tokenizers' parallelism (unless set), transformers' progress bars and its INFO/WARNING logs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    if not torch.cuda.is_available():
        # transformers' save_pretrained imports DeepSpeed when it is installed, whose accelerator probe otherwise
        # prints a warning to stdout in every process; on a machine without CUDA its answer is "cpu" anyway.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
