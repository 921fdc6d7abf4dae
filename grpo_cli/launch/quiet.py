"""Log hygiene for the libraries a grpo-cli process drives: no tokenizer fork warnings, no per-load progress bars."""

from __future__ import annotations

import os


def quiet_hf_stack() -> None:
    """Turn off tokenizers' parallelism (unless set), transformers' progress bars and its INFO/WARNING logs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
