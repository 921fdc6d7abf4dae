"""Generative judge rewards (`{judge: URL_OR_PATH, prompt: FILE, parse: ...}`): each completion, with its prompt
and data columns, is rendered into the judge prompt template; the judge model answers (`rewards.judge_backends`);
`parse` turns the answer into the score. A failed request or an answer without a score is a missing reward (None:
left out of the means and of its group's statistics like any function's None), counted in `judge/<name>/missing`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from grpo_cli.config.judge import JudgeConfig
from grpo_cli.rewards.judge_backends import JudgeStats, make_backend
from grpo_cli.rewards.judge_parse import parsed_score


class Judge:
    """The reward function of one judge entry (built once per run: a local judge loads once). Answers are cached
    by rendered judge prompt, so a (prompt, completion) repeated within a step — identical samples of a group, or
    again in a dynamic-sampling round — is asked once; `pop_metrics` (once per step) empties the cache."""

    def __init__(self, cfg: JudgeConfig, parser: Callable[[str], float | None], label: str = "judge", *,
                 park: bool = False) -> None:
        """`park`: a local judge waits in host memory except while it answers (`rewards.model.placed`)."""
        import jinja2

        self.cfg, self.parser, self.label = cfg, parser, label
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        self.template = env.from_string(Path(cfg.prompt).read_text())
        self.stats = JudgeStats()
        self.backend = make_backend(cfg, self.stats, park=park)
        self.cache: dict[str, float] = {}
        self.lock = threading.Lock()

    def render(self, prompt: str, completion: str, messages, columns: dict) -> str:
        """The judge prompt of one completion; a variable the template uses that is neither built in nor a data
        column raises a ValueError naming it and the file (`rewards.resolve.score` reports it with the function)."""
        import jinja2

        try:
            return self.template.render({**columns, "prompt": prompt, "completion": completion,
                                         "prompt_messages": messages})
        except jinja2.UndefinedError as exc:
            raise ValueError(f"the judge prompt {self.cfg.prompt}: {exc.message}; it may use completion, prompt, "
                             f"prompt_messages and the data columns ({', '.join(columns) or 'none'}).") from None

    def __call__(self, prompts: list[str], completions: list[str], *, prompt_messages: list | None = None,
                 **columns) -> list[float | None]:
        """One score per completion, None where the judge's request failed or its answer has no score; only
        judge prompts not answered earlier in the step are sent, each once."""
        n = len(completions)
        messages = prompt_messages or [None] * n
        texts = [self.render(prompts[j], completions[j], messages[j], {k: v[j] for k, v in columns.items()})
                 for j in range(n)]
        with self.lock:
            known = {t: self.cache[t] for t in texts if t in self.cache}
        todo = list(dict.fromkeys(t for t in texts if t not in known))
        answers = dict(zip(todo, self.backend.answer(todo), strict=True))
        scores = {t: None if a is None else parsed_score(self.parser, a) for t, a in answers.items()}
        with self.lock:
            self.cache.update({t: s for t, s in scores.items() if s is not None})
        out = [known[t] if t in known else scores[t] for t in texts]
        self.stats.add(cache_hits=n - len(todo), missing=sum(v is None for v in out))
        return out

    def pop_metrics(self) -> dict[str, float]:
        """`judge/<label>/...` counts since the last call (`JudgeStats.pop`); the answer cache starts afresh."""
        with self.lock:
            self.cache.clear()
        return self.stats.pop(f"judge/{self.label}")
