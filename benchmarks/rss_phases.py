"""Where a training process's memory peaks: a thread samples the resident set (/proc/self/statm) every few
milliseconds and tags each sample with the phase the model is in, set by module hooks (the forward and backward of
the embedding, each decoder layer and the output layer) and by the optimizer's step hook. Reports the largest sample
with its phase, and the resident set when the last train phase began (what the runtime, weights and optimizer
state hold before any activation). Linux only: elsewhere `RssPhases.start` reports nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

STATM = Path("/proc/self/statm")
INTERVAL_S = 0.002


def _rss_mb() -> float:
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssPhases:
    """Sampled RSS per phase of `model` (its hooks, installed by `start`) and of `optimizer` (its step)."""

    def __init__(self) -> None:
        self.phase = "load"
        self.peak = (0.0, "")
        self.maxima: dict[str, float] = {}
        """The largest sample of each phase (every train phase's together)."""
        self.step_base: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _tag(self, phase: str):
        def hook(*_args):
            self.phase = phase
        return hook

    def watch(self, model, optimizer) -> None:
        """Hooks naming the phase: `forward NAME` / `backward NAME` for the embedding, decoder layers and output
        layer, `optimizer step` for the step."""
        hf = getattr(model, "module", model)
        parts = {"embedding": hf.get_input_embeddings(), "output layer": hf.get_output_embeddings()}
        layers = [m for m in hf.modules() if type(m).__name__.endswith("DecoderLayer")]
        parts.update({f"layer {i}": m for i, m in enumerate(layers)})
        for name, module in parts.items():
            if module is None:
                continue
            module.register_forward_pre_hook(self._tag(f"forward {name}"))
            module.register_full_backward_pre_hook(self._tag(f"backward {name}"))
        optimizer.register_step_pre_hook(self._tag("optimizer step"))
        optimizer.register_step_post_hook(self._tag("after the step"))
        self._watch_detached_head()

    def _watch_detached_head(self) -> None:
        """The vocabulary-parallel forward (`models.vocab_parallel`) calls neither the embedding nor the output
        layer's module: its `DetachedHead`, made per forward, is tagged by wrapping the class's forward (this process
        only), and its backward by a hook on its result's gradient."""
        from grpo_cli.models import vocab_parallel

        forward = vocab_parallel.DetachedHead.forward

        def tagged(head, hidden):
            self.phase = "forward output layer"
            out = forward(head, hidden)
            if out.requires_grad:
                out.register_hook(lambda grad: self._tag("backward output layer")())
            return out

        vocab_parallel.DetachedHead.forward = tagged

    def step_begins(self) -> None:
        """Mark a train phase's start: the resident set now is its base."""
        self.phase = "old-policy logprobs"
        if STATM.exists():
            self.step_base = _rss_mb()

    def start(self) -> None:
        if not STATM.exists():
            return

        def sample() -> None:
            while not self._stop.is_set():
                mb, phase = _rss_mb(), self.phase
                if mb > self.peak[0]:
                    self.peak = (mb, phase)
                self.maxima[phase] = max(mb, self.maxima.get(phase, 0.0))
                time.sleep(INTERVAL_S)

        self._thread = threading.Thread(target=sample, name="rss-phases", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """{"sampled_peak_mb", "peak_phase", "step_base_mb", "phase_peaks_mb"} (None where not sampled)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sampled = self._thread is not None
        return {"sampled_peak_mb": self.peak[0] if sampled else None, "peak_phase": self.peak[1] or None,
                "step_base_mb": self.step_base, "phase_peaks_mb": dict(self.maxima) if sampled else None}
