"""A stand-in for `vllm.LLM` for the engine's bookkeeping tests (sleep levels, wake-up tags, seeds, fallbacks):
the `VLLMEngine` methods under test are the real ones, built with `VLLMEngine.__new__` around this object.

`FakeLLM` holds a copy of an HF model as "the engine's weights": `reload_weights` copies tensors into it by name,
`apply_model` runs on it, prompt logprobs are the model's own (`score_sequences`), and generation returns one
stop token per sample. Like vLLM's V2 model runner (`v1/worker/gpu/sample/states.py`), an unseeded request draws
its seed from NumPy's global generator."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

STOP = 1


class FakeLLM:
    def __init__(self, model: torch.nn.Module | None = None, *, reload_error: Exception | None = None):
        self.model, self.reload_error = model, reload_error
        self.calls: list[tuple] = []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    # ---- sleep mode ----
    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self) -> None:
        pass

    def sleeps(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "sleep"]

    def wakes(self) -> list[tuple]:
        return [c[1] for c in self.calls if c[0] == "wake_up"]

    # ---- weights ----
    def collective_rpc(self, method: str, kwargs: dict):
        assert method == "reload_weights"
        if self.reload_error is not None:
            raise self.reload_error
        self.calls.append(("reload",))
        self.load_weights(kwargs["weights_iterator"])

    def load_weights(self, items) -> None:
        params = dict(self.model.named_parameters()) if self.model is not None else {}
        with torch.no_grad():
            for name, tensor in items:
                if name in params:
                    params[name].copy_(tensor)

    def apply_model(self, fn):
        return [fn(self)]

    def named_parameters(self, remove_duplicate: bool = True):
        return self.model.named_parameters(remove_duplicate=remove_duplicate)

    def named_modules(self):
        return self.model.named_modules() if self.model is not None else iter(())

    # ---- generation ----
    def generate(self, requests, params, use_tqdm=False):
        from grpo_cli.models.logprobs import score_sequences

        out = []
        for request, p in zip(requests, params, strict=True):
            if p.seed is None:
                np.random.randint(-(2**63), 2**63 - 1)  # vLLM's V2 runner: the seed of an unseeded request
            ids = request["prompt_token_ids"]
            if p.prompt_logprobs is not None:
                lps = score_sequences(self.model, [ids], pad_token_id=0)[0]
                prompt_lp = [None, *({tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(ids[1:], lps))]
                out.append(SimpleNamespace(prompt_logprobs=prompt_lp, outputs=[]))
                continue
            samples = [SimpleNamespace(index=i, token_ids=[STOP], finish_reason="stop",
                                       logprobs=[{STOP: SimpleNamespace(logprob=-1.0)}]) for i in range(p.n)]
            out.append(SimpleNamespace(prompt_logprobs=None, outputs=samples))
        return out


def bare_engine(llm: FakeLLM, *, sleep_level: int, seed: int = 0):
    """A `VLLMEngine` around `llm` with the state `__init__` leaves (single process, awake, version 0)."""
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.llm, eng.sleep_level, eng.seed, eng.device = llm, sleep_level, seed, torch.device("cpu")
    eng.model_path, eng.max_model_len, eng.tp, eng.tp_group, eng.rank, eng.world_size = "fake", 64, 1, None, 0, 1
    eng.eos_token_ids, eng.weight_version, eng._calls, eng.notices = [STOP], 0, 0, []
    eng._asleep, eng._weights_discarded, eng._keep_weights = set(), False, False
    eng._held, eng._sleep_due = 0, None
    eng._pending_probe, eng.last_probe, eng._owns_process_group = None, {}, False
    eng.dtype = torch.float32
    return eng
