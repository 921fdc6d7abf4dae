"""Multi-turn rollouts around any engine, token-in token-out: turn k+1's input is the prompt, every sampled id so
far and the environment's new tokens (`template.ToolFraming` around the tool result), never a re-encoding of
decoded text. Environment tokens carry loss mask 0 and logprob 0; engines are only asked for sampled tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from grpo_cli.agent.execute import run_calls
from grpo_cli.agent.template import ToolFraming
from grpo_cli.agent.tools import Tool, ToolCall
from grpo_cli.config.agent import AgentConfig
from grpo_cli.rollout.base import EngineWrapper, RolloutBatch, SamplingParams, held_awake
from grpo_cli.rollout.seeds import turn_seed


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish: str = "stop"
    turns: int = 0
    pending: list[ToolCall] = field(default_factory=list)
    tools: dict[str, Tool] = field(default_factory=dict)
    env: object = None
    fresh: list[int] = field(default_factory=list)  # environment tokens added since the last turn


def _decode_all(tokenizer, seqs: list[list[int]], *, skip_special_tokens: bool) -> list[str]:
    """`batch_decode`, one text per sequence; none for none (transformers 5 decodes `[]` to `[""]`)."""
    return tokenizer.batch_decode(seqs, skip_special_tokens=skip_special_tokens) if seqs else []


class AgentEngine(EngineWrapper):
    """An engine whose `generate` runs up to `agent.max_turns` assistant turns per completion, executing the tool
    calls of each turn (concurrently across the batch) in between. A trajectory stops when a turn calls no tool,
    ends by length (a truncated call is not run), reaches `max_turns`, or spends `max_completion_length` tokens
    (every turn and every tool result counts; a result that would overflow is cut and ends the trajectory).
    It binds prompts itself (`bind_prompts`: an environment's rows); weight sync, sleep and close are the wrapped
    engine's (`EngineWrapper`), and it keeps no rows between calls itself (`continue_rows` is the inner engine's,
    used between turns)."""

    def __init__(self, engine, cfg: AgentConfig, tokenizer, *, tools: dict[str, Tool], parse, framing: ToolFraming,
                 environment: type | None = None):
        super().__init__(engine)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools, self.parse, self.framing, self.environment = tools, parse, framing, environment
        self.rows: list[dict] | None = None

    def bind_prompts(self, prompts) -> None:
        """The dataset rows of the prompts the next `generate` gets (an environment's `reset(**row)`)."""
        self.bind_rows([dict(p.columns) for p in prompts])

    def bind_rows(self, rows: list[dict]) -> None:
        self.rows = rows

    def _start(self, count: int, n: int) -> list[Trajectory]:
        """One trajectory per completion; with an environment, a fresh instance reset with its prompt's row."""
        trajs = [Trajectory(tools=self.tools) for _ in range(count)]
        if self.environment is not None:
            from grpo_cli.agent.tools import environment_tools

            for j, t in enumerate(trajs):
                t.env = self.environment()
                t.env.reset(**(self.rows[j // n] if self.rows else {}))
                t.tools = {**self.tools, **environment_tools(t.env, self.cfg.environment)}
        return trajs

    def _add_turns(self, turns: list[tuple[Trajectory, list[int], list[float] | None, str]]) -> None:
        """Append each (trajectory, sampled ids, their logprobs, finish reason); the calls of a turn that ended by
        `stop` are parsed from its text, decoded with special tokens, all turns in one batch. The message text
        (special tokens skipped) is decoded at the end, for every turn at once (`_decode_messages`)."""
        stopped = [i for i, (*_, finish) in enumerate(turns) if finish == "stop"]
        texts = _decode_all(self.tokenizer, [turns[i][1] for i in stopped], skip_special_tokens=False)
        text_of = dict(zip(stopped, texts, strict=True))
        for i, (t, ids, logprobs, finish) in enumerate(turns):
            t.ids += ids
            t.mask += [1] * len(ids)
            t.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
            t.messages.append({"role": "assistant", "content": list(ids)})  # ids until `_decode_messages`
            t.turns += 1
            t.finish = finish
            t.pending = self.parse(text_of[i]) if i in text_of else []

    def _decode_messages(self, trajs: list[Trajectory]) -> None:
        """Every assistant message's ids → its text (special tokens skipped), in one batch."""
        messages = [m for t in trajs for m in t.messages if m["role"] == "assistant"]
        texts = _decode_all(self.tokenizer, [m["content"] for m in messages], skip_special_tokens=True)
        for m, text in zip(messages, texts, strict=True):
            m["content"] = text

    def _add_results(self, answered: list[tuple[Trajectory, list[tuple[str, str]]]], budget: int) -> None:
        """Append each trajectory's tool results (its calls' texts joined by newlines, encoded in one batch, cut
        at `max_tool_output_tokens`) framed as the template frames a tool message; a result that leaves no room
        to answer is cut at the budget and ends the trajectory."""
        cap = self.cfg.max_tool_output_tokens
        joined = ["\n".join(text for text, _ in results) for _, results in answered]
        encoded = self.tokenizer(joined, add_special_tokens=False)["input_ids"] if joined else []
        for (t, results), result_ids in zip(answered, encoded, strict=True):
            for text, _ in results:
                t.messages.append({"role": "tool", "content": text})
            if len(result_ids) > cap:
                result_ids = result_ids[:cap] + self._ellipsis()
            env = self.framing.tokens(self.tokenizer, result_ids)
            room = budget - len(t.ids)
            if len(env) >= room:  # no room left to answer after the result: cut it, and the trajectory ends here
                env, t.finish = env[:room], "length"
            t.ids += env
            t.fresh = env
            t.mask += [0] * len(env)
            t.logprobs += [0.0] * len(env)

    def _ellipsis(self) -> list[int]:
        """The token that marks a cut tool result (the last of " …")."""
        if not hasattr(self, "_ellipsis_ids"):
            self._ellipsis_ids = self.tokenizer.encode(" …", add_special_tokens=False)[-1:]
        return self._ellipsis_ids

    def _turns(self, first: RolloutBatch, prompt_ids: list[list[int]], sampling: SamplingParams, resume):
        """Run the turns after `first`; returns (trajectories, tool-call counts, seconds in tool calls, the turns'
        engine metrics)."""
        n, budget = sampling.n, sampling.max_tokens
        trajs = self._start(len(first.completion_ids), n)
        self._add_turns([(t, first.completion_ids[j],
                          first.sampler_logprobs[j] if first.sampler_logprobs is not None else None,
                          first.finish_reasons[j]) for j, t in enumerate(trajs)])
        stats = {"calls": 0, "errors": 0, "timeouts": 0}
        tool_seconds = 0.0
        row = {j: j for j in range(len(trajs))}  # trajectory → row of the engine's last output
        metrics = [first.metrics]
        for turn in range(1, self.cfg.max_turns):
            active = [j for j, t in enumerate(trajs) if t.pending and t.finish == "stop"]
            tick = time.perf_counter()
            flat = [(j, call) for j in active for call in trajs[j].pending]
            results = run_calls([c for _, c in flat], [trajs[j].tools for j, _ in flat],
                                timeout=self.cfg.tool_timeout_s, isolation=self.cfg.tool_isolation)
            tool_seconds += time.perf_counter() - tick
            per_rollout: dict[int, list[tuple[str, str]]] = {j: [] for j in active}
            for (k, _), r in zip(flat, results, strict=True):
                per_rollout[k].append(r)
            for mine in per_rollout.values():
                stats["calls"] += len(mine)
                stats["errors"] += sum(outcome == "error" for _, outcome in mine)
                stats["timeouts"] += sum(outcome == "timeout" for _, outcome in mine)
            self._add_results([(trajs[j], mine) for j, mine in per_rollout.items()], budget)
            go = [j for j in active if trajs[j].finish == "stop"]
            # The engine's peers (a colocated vLLM TP group) generate together: the turn ends for all of them only
            # when none goes on; one with nothing left joins the call with no prompts (docs/distributed.md).
            if not self.engine.agree_any(bool(go)):
                break
            room = [budget - len(trajs[j].ids) for j in go]
            seed = None if sampling.seed is None else turn_seed(sampling.seed, turn)  # reproducible, not turn 0's
            params = SamplingParams(n=1, max_tokens=max(room, default=1), temperature=sampling.temperature,
                                    top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
            if resume is not None and self.engine.can_continue():
                out = resume([row[j] for j in go], [trajs[j].fresh for j in go], params)
            else:
                out = self.engine.generate_turn([prompt_ids[j // n] + trajs[j].ids for j in go], params,
                                                first=[j // n for j in go])
            metrics.append(out.metrics)
            row = {j: i for i, j in enumerate(go)}  # trajectory → row of the engine's last output
            sampled = []
            for i, j in enumerate(go):
                ids, finish = out.completion_ids[i][: room[i]], out.finish_reasons[i]
                if len(out.completion_ids[i]) > room[i]:
                    finish = "length"
                lps = out.sampler_logprobs[i][: room[i]] if out.sampler_logprobs is not None else None
                sampled.append((trajs[j], ids, lps, finish))
            self._add_turns(sampled)
        return trajs, stats, tool_seconds, metrics

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Turn 0 samples every completion; later turns sample the rollouts that called a tool, from the whole
        conversation so far. An engine with `continue_rows` (hf) keeps each row's KV between turns and reads only
        the new tokens; others get the conversation's ids as a prompt. The engine is held awake for all the turns
        (a colocated vLLM engine sleeps once, after the last)."""
        start = time.perf_counter()
        resume = self.engine.continue_rows if self.engine.continues_rows else None
        with held_awake(self.engine):
            try:
                first = (self.engine.generate(prompt_ids, sampling, keep_cache=True) if resume is not None
                         else self.engine.generate(prompt_ids, sampling))
                trajs, stats, tool_seconds, turn_metrics = self._turns(first, prompt_ids, sampling, resume)
            finally:
                if resume is not None:
                    self.engine.drop_cache()
        self._decode_messages(trajs)
        b = len(trajs)
        metrics = {"tools/calls_per_rollout": stats["calls"] / b, "tools/errors": float(stats["errors"]),
                   "tools/timeouts": float(stats["timeouts"]), "tools/turns": sum(t.turns for t in trajs) / b}
        for figures in turn_metrics:  # the engine's (rollout/server_load/*): the busiest turn's
            for key, value in figures.items():
                metrics[key] = max(metrics.get(key, value), value)
        return RolloutBatch(
            prompt_ids=first.prompt_ids, completion_ids=[t.ids for t in trajs],
            finish_reasons=[t.finish for t in trajs],
            sampler_logprobs=[t.logprobs for t in trajs] if first.sampler_logprobs is not None else None,
            weight_version=first.weight_version,
            timings={**first.timings, "tools": tool_seconds, "agent_total": time.perf_counter() - start},
            loss_masks=[t.mask for t in trajs], trajectories=[t.messages for t in trajs], metrics=metrics,
            environment_rewards=None if self.environment is None else [
                float(t.env.reward()) if callable(getattr(t.env, "reward", None)) else None for t in trajs])


def agent_tools(cfg: AgentConfig, tokenizer) -> tuple[dict[str, Tool], list[dict]]:
    """The configured tools and their schemas, after checking the chat template renders them and is
    prefix-preserving (a config-time refusal naming `agent.chat_template` otherwise)."""
    from grpo_cli.agent.template import check_template
    from grpo_cli.agent.tools import load_tools

    tools = load_tools(cfg.tools)
    shown = dict(tools)
    if cfg.environment is not None:
        from grpo_cli.agent.tools import environment_tools, load_environment

        shown.update(environment_tools(load_environment(cfg.environment), cfg.environment))
    schemas = [t.schema() for t in shown.values()]
    check_template(tokenizer, template=cfg.chat_template, tools=schemas)
    return tools, schemas


def wrap_engine(engine, cfg: AgentConfig, tokenizer) -> AgentEngine:
    """`engine` with multi-turn tool calling (`agent:`)."""
    from grpo_cli.agent.template import tool_framing
    from grpo_cli.agent.tools import load_parser

    tools, schemas = agent_tools(cfg, tokenizer)
    framing = tool_framing(tokenizer, template=cfg.chat_template, tools=schemas, end_of_turn=tokenizer.eos_token)
    from grpo_cli.agent.tools import load_environment

    environment = load_environment(cfg.environment) if cfg.environment else None
    return AgentEngine(engine, cfg, tokenizer, tools=tools, parse=load_parser(cfg.tool_parser), framing=framing,
                       environment=environment)
