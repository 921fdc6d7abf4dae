"""Reward functions that misbehave, for the process-isolation tests."""

from __future__ import annotations

import os
import sys


def hang_on_cat(prompts, completions, **_):
    """Hangs for completions mentioning "cat", scores 1.0 otherwise."""
    if "cat" in completions[0]:
        while True:
            pass
    return [1.0]


def leave_a_child(prompts, completions, **_):
    """Starts a sleeping grandchild, then hangs: killing the process group must end both."""
    import subprocess

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    while True:
        pass


def where_am_i(prompts, completions, **_):
    """1.0 when it runs in a fresh empty folder with a scrubbed environment (no GRPO_SECRET)."""
    return [float(not os.listdir(".") and "GRPO_SECRET" not in os.environ)]


def always_hang(prompts, completions, **_):
    """Never returns."""
    while True:
        pass


def start_and_return(prompts, completions, **_):
    """Starts a sleeping process and returns its pid as the score (the call ends; the process must not stay)."""
    import subprocess

    return [float(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)]
