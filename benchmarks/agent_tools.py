"""What tool calling adds to a rollout step: 128 rollouts (16 prompts × 8) of exactly 4 assistant turns, against
the same engine sampling the same number of tokens per rollout in one `generate` (no tools).

With tools: the agent loop (`agent.rollout.AgentEngine`) on the built-in tiny tool model, every turn read as a
`calculator` call (a parser that always calls: the random-init model seldom writes one) and every turn exactly
`--turn-tokens` sampled tokens ending in the end-of-turn token (`TurnCapped`: the engine samples with EOS
suppressed and the turn's last token becomes `<eos>`, so the turn ends by `stop` and its call is run; a turn that
ended by length would end the rollout). Tool isolation `inline` and `process`.
Without tools, two baselines, each one `generate` of the same engine (EOS suppressed) for the same prompts:
"no tools" samples `turns × turn_tokens` tokens per rollout (the same sampled-token count, checked); "no tools,
same length" samples as many tokens as the tool run's sequences hold (the tool results' positions too), so that
its train phase runs over sequences of the same length: the same tokens without the tool machinery.

Reported (medians of alternated rounds, the order rotating each round): rollout wall time with and without tools
and the overhead; its split into the engine's extra time (turn k reads the tool results on top of the earlier
turns: the hf engine keeps each row's KV between turns and reads only the new tokens, vLLM re-reads the
conversation through its prefix cache; 4 engine calls instead of 1), tool calls (`run_calls`), parsing (`parse`),
decoding text (the rest of `_add_turns`: each turn's text for the parser, all rows in one batch; and
`_decode_messages`: every assistant message's text, once at the end) and framing (`_add_results`: encoding the
results in one batch, template tokens); and, for the whole-step figure, a train-phase proxy (one
forward + backward over the batch as the trainer lays it out: left-padded prompt, right-padded completion, the
tool run's completions 3 × 4 environment tokens longer). Engines: `hf` (our decode loop on the policy) and, with
`--vllm`, an in-process vLLM colocate engine (`VLLMEngine`, EOS ignored through `ignore_eos`).

Run: `python -m benchmarks.agent_tools [--rounds 7] [--vllm]`. Results: benchmarks/results/agent_tools.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import defaultdict

from benchmarks.compare import RESULTS_DIR, fmt_table, machine_info

CALLS = "benchmarks.agent_tools:always_calculate"
SAME = "no tools, same length"
"""The second baseline: every token of the tool run's sequences sampled (the tool results' positions too)."""
BASES = ("no tools", SAME)


def always_calculate(text: str) -> list[tuple[str, dict]]:
    return [("calculator", {"a": 2, "b": 3})]


class Clock:
    """Seconds spent in named sections (accumulated until `reset`)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.s.clear()
        self.calls.clear()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed


class TurnCapped:
    """An engine whose every answer is exactly `turn_tokens` sampled tokens ending in `eos` (finish reason `stop`):
    the inner engine samples with EOS suppressed, the last sampled token is replaced by `eos` (also in the hf
    engine's kept KV rows, whose last token the next turn feeds first). Its `generate`/`continue_rows` time is
    `clock.s["engine"]`."""

    def __init__(self, engine, turn_tokens: int, eos: int, clock: Clock) -> None:
        self.engine, self.turn_tokens, self.eos = engine, turn_tokens, eos
        self.generate_inner = clock.wrap("engine", engine.generate)
        if hasattr(engine, "continue_rows"):  # only then: the agent loop looks for it
            inner = clock.wrap("engine", engine.continue_rows)
            self.continue_rows = lambda rows, new_ids, sampling: self._cap(inner(rows, new_ids, self._max(sampling)))

    def __getattr__(self, name):
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def _max(self, sampling):
        from dataclasses import replace

        return replace(sampling, max_tokens=min(self.turn_tokens, sampling.max_tokens))

    def _cap(self, out):
        assert all(len(c) == self.turn_tokens for c in out.completion_ids), "EOS was not suppressed"
        out.completion_ids = [c[:-1] + [self.eos] for c in out.completion_ids]
        out.finish_reasons = ["stop"] * len(out.completion_ids)
        for row in getattr(self.engine, "_kept", None) or []:
            row.last_token = self.eos
        return out

    def generate(self, prompt_ids, sampling, **kwargs):
        return self._cap(self.generate_inner(prompt_ids, self._max(sampling), **kwargs))


class IgnoreEos:
    """A `VLLMEngine` whose requests carry `ignore_eos=True` (vLLM stops on the tokenizer's EOS otherwise)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def generate(self, prompt_ids, sampling):
        import vllm

        original = vllm.SamplingParams
        vllm.SamplingParams = functools.partial(original, ignore_eos=True)
        try:
            return self.engine.generate(prompt_ids, sampling)
        finally:
            vllm.SamplingParams = original


def model_path(hidden: int, layers: int) -> str:
    from grpo_cli.models.tiny import (
        TOOLS_NAME,
        build_tiny_checkpoint,
        resolve_model_path,
    )

    if (hidden, layers) == (64, 2):
        return resolve_model_path(TOOLS_NAME)
    path = os.path.join(os.environ.get("GRPO_BENCH_CACHE", "/tmp/grpo-bench"), f"tiny-tools-h{hidden}-l{layers}")
    if not os.path.exists(os.path.join(path, "grpo_cli_tiny.json")):
        build_tiny_checkpoint(path, hidden_size=hidden, num_layers=layers, tools=True)
    return path


def train_proxy(model, prompts: list[list[int]], completions: list[list[int]], masks: list[list[int]], n: int,
                pad: int) -> float:
    """Seconds of one forward + backward over the batch laid out as the trainer does (left-padded prompt,
    right-padded completion; loss on the masked-in completion tokens), no optimizer step."""
    import torch

    from grpo_cli.models.logprobs import completion_logprobs

    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    b = len(completions)
    ids = torch.full((b, width_p + width_c), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros((b, width_c))
    for j, (c, m) in enumerate(zip(completions, masks, strict=True)):
        p = prompts[j // n]
        ids[j, width_p - len(p): width_p + len(c)] = torch.tensor(p + c)
        attn[j, width_p - len(p): width_p + len(c)] = 1
        loss_mask[j, : len(m)] = torch.tensor(m, dtype=torch.float32)
    model.train()
    start = time.perf_counter()
    lp = completion_logprobs(model, ids, attn, logits_to_keep=width_c, temperature=1.0)
    loss = -(lp * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.eval()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16, help="sampled tokens per assistant turn (EOS included)")
    ap.add_argument("--hidden", type=int, default=64, help="tiny tool model width (64 = builtin:tiny-tools)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also the in-process vLLM colocate engine")
    ap.add_argument("--no-hf", action="store_true", help="leave the hf engine out (with --vllm)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM KV block size (default: vLLM's, 128 on CPU; prefix caching reuses whole blocks only)")
    ap.add_argument("--no-train", action="store_true", help="skip the train-phase proxy")
    ap.add_argument("--out", default=str(RESULTS_DIR / "agent_tools.json"))
    args = ap.parse_args()
    if args.vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_cli.agent.rollout import wrap_engine
    from grpo_cli.config.agent import AgentConfig
    from grpo_cli.data.tasks import arith_task
    from grpo_cli.rollout.base import SamplingParams
    from grpo_cli.rollout.hf.engine import HFEngine

    path = model_path(args.hidden, args.layers)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = {iso: AgentConfig(tools=["calculator"], tool_parser=CALLS, max_turns=args.turns, tool_isolation=iso)
           for iso in ("inline", "process")}
    probe = wrap_engine(None, cfg["inline"], tok)
    schemas = [t.schema() for t in probe.tools.values()]
    prompts = [tok.encode(tok.apply_chat_template(r["prompt"], tools=schemas, tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for r in arith_task(args.prompts)]
    env_tokens = len(probe.framing.tokens(tok, tok.encode("5", add_special_tokens=False)))
    sampled = args.turns * args.turn_tokens
    budget = sampled + (args.turns - 1) * env_tokens  # max_completion_length: exactly what 4 turns + 3 results use
    tool_sampling = SamplingParams(n=args.gens, max_tokens=budget, seed=0)
    plain_sampling = SamplingParams(n=args.gens, max_tokens=sampled, seed=0)
    same_sampling = SamplingParams(n=args.gens, max_tokens=budget, seed=0)

    engines = {} if args.no_hf else {
        "hf": HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, shares_policy_weights=True)}
    if args.vllm:
        from grpo_cli.rollout.vllm.engine import VLLMEngine

        start = time.perf_counter()
        engines["vllm"] = IgnoreEos(VLLMEngine(
            path, dtype="float32", max_model_len=max(map(len, prompts)) + budget + 8,
            max_num_seqs=args.prompts * args.gens, kv_cache_space_gib=1.0, block_size=args.block_size,
            multi_turn=True))
        print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")

    clock = Clock()
    runs: dict[tuple[str, str], callable] = {}
    for name, inner in engines.items():
        plain = clock.wrap("engine", inner.generate)
        runs[(name, "no tools")] = functools.partial(plain, prompts, plain_sampling)
        runs[(name, SAME)] = functools.partial(plain, prompts, same_sampling)
        for iso in ("inline", "process"):
            agent = wrap_engine(TurnCapped(inner, args.turn_tokens, tok.eos_token_id, clock), cfg[iso], tok)
            agent._add_turns = clock.wrap("add_turn", agent._add_turns)  # batch decode + parse
            agent._decode_messages = clock.wrap("messages", agent._decode_messages)  # batch decode, at the end
            agent._add_results = clock.wrap("framing", agent._add_results)  # encode result + template tokens
            agent.parse = clock.wrap("parse", agent.parse)
            runs[(name, f"tools, {iso}")] = functools.partial(agent.generate, prompts, tool_sampling)

    def run(key) -> tuple[dict, object]:
        clock.reset()
        start = time.perf_counter()
        out = runs[key]()
        total = time.perf_counter() - start
        masks = out.loss_masks or [[1] * len(c) for c in out.completion_ids]
        row = {"total_s": total, "engine_s": clock.s["engine"], "engine_calls": clock.calls["engine"],
               "tools_s": out.timings.get("tools", 0.0), "parse_s": clock.s["parse"],
               "decode_s": clock.s["add_turn"] - clock.s["parse"] + clock.s["messages"],
               "framing_s": clock.s["framing"],
               "turns": out.metrics.get("tools/turns", 1.0),
               "calls_per_rollout": out.metrics.get("tools/calls_per_rollout", 0.0),
               "sampled_per_rollout": sorted({sum(m) for m in masks}),
               "completion_len": max(map(len, out.completion_ids))}
        row["other_s"] = (total - row["engine_s"] - row["tools_s"] - clock.s["add_turn"] - clock.s["messages"]
                          - row["framing_s"])
        return row, out

    keys = list(runs)
    batches = {}
    for key in keys:  # warm-up (the tool process pool starts here); the batches feed the train proxy
        row, batches[key] = run(key)
        print(f"warm-up {key}: {row['total_s']:.3f} s, turns {row['turns']}, sampled/rollout "
              f"{row['sampled_per_rollout']}, completion length {row['completion_len']}")
        assert row["sampled_per_rollout"] == [budget if key[1] == SAME else sampled], (key, row)
        assert key[1] in BASES or row["turns"] == args.turns, (key, row)

    first = next(iter(engines))
    layouts = {v: batches[(first, v)] for v in (*BASES, "tools, inline")}
    results: dict[str, list[dict]] = {f"{e} | {v}": [] for e, v in keys}
    train: dict[str, list[float]] = {k: [] for k in layouts}
    for r in range(args.rounds):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            results[f"{key[0]} | {key[1]}"].append(run(key)[0])
        if not args.no_train:
            names = list(layouts)
            for k in names[r % len(names):] + names[: r % len(names)]:
                b = layouts[k]
                train[k].append(train_proxy(model, prompts, b.completion_ids, b.loss_masks or
                                            [[1] * len(c) for c in b.completion_ids], args.gens, tok.pad_token_id))

    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if isinstance(v[0][f], (int, float))}
           for k, v in results.items()}
    train_med = {k: statistics.median(v) for k, v in train.items() if v}
    table = [["engine", "rollout", "wall s", "over no-tools", "over same length", "engine s (calls)",
              "engine extra s", "tool calls s", "parse s", "decode text s", "framing s", "other s"]]
    summary = {}
    for key in keys:
        e, v = key
        m, base, same = med[f"{e} | {v}"], med[f"{e} | no tools"], med[f"{e} | {SAME}"]
        over = (m["total_s"] - base["total_s"]) / base["total_s"]
        over_same = (m["total_s"] - same["total_s"]) / same["total_s"]
        summary[f"{e} | {v}"] = {"overhead": over, "overhead_same_length": over_same,
                                 "engine_extra_s": m["engine_s"] - base["engine_s"], **m}
        tools = v not in BASES
        table.append([e, v, f"{m['total_s']:.3f}", f"{over:+.1%}" if v != "no tools" else "-",
                      f"{over_same:+.1%}" if tools else "-", f"{m['engine_s']:.3f} ({m['engine_calls']:.0f})",
                      f"{m['engine_s'] - base['engine_s']:+.3f}" if tools else "-",
                      *(f"{m[f]:.3f}" if tools else "-" for f in ("tools_s", "parse_s", "decode_s", "framing_s")),
                      f"{m['other_s']:.3f}"])
    print(f"\n{args.prompts * args.gens} rollouts ({args.prompts} prompts × {args.gens}), {args.turns} turns × "
          f"{args.turn_tokens} sampled tokens (= {sampled} per rollout, {env_tokens} environment tokens per tool "
          f"result; the same-length baseline samples all {budget}), model hidden {args.hidden} × {args.layers} "
          f"layers ({n_params / 1e6:.2f}M params), {args.rounds} alternated rounds, medians\n")
    print(fmt_table(table))
    step_rows = []
    if train_med:
        step_rows = [["engine", "rollout", "rollout s", "train proxy s", "step s", "over no-tools step",
                      "over same-length step"]]
        for key in keys:
            e, v = key
            t = train_med[v if v in BASES else "tools, inline"]
            step = med[f"{e} | {v}"]["total_s"] + t
            over = {b: (step - (med[f"{e} | {b}"]["total_s"] + train_med[b])) / (med[f"{e} | {b}"]["total_s"]
                                                                               + train_med[b]) for b in BASES}
            summary[f"{e} | {v}"].update(step_proxy_s=step, step_overhead=over["no tools"],
                                         step_overhead_same_length=over[SAME])
            step_rows.append([e, v, f"{med[f'{e} | {v}']['total_s']:.3f}", f"{t:.3f}", f"{step:.3f}",
                              f"{over['no tools']:+.1%}" if v != "no tools" else "-",
                              f"{over[SAME]:+.1%}" if v not in BASES else "-"])
        print("\nWhole step ≈ rollout + train proxy (one forward + backward, no optimizer, reward, old logprobs)\n")
        print(fmt_table(step_rows))
    out = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
           "settings": {**vars(args), "params": n_params, "env_tokens_per_result": env_tokens,
                        "sampled_per_rollout": sampled, "max_completion_length": budget},
           "summary": summary, "train_proxy_s": train, "train_proxy_median_s": train_med, "rounds": results,
           "table": table, "step_table": step_rows,
           "note": "shared 2-core CPU: timings are noisy; medians over alternated rounds (order rotating)"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwritten: {args.out}")
    for e in engines.values():
        getattr(e, "close", lambda: None)()


if __name__ == "__main__":
    main()
