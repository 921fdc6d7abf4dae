"""Multi-turn rollouts with scripted engines and the tiny tool tokenizer: token-in token-out, the template's
tool framing, masks, stopping, and every kind of tool failure (the run goes on)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import torch
from agent_fixtures import ScriptedEngine

from grpo_cli.agent.execute import run_calls
from grpo_cli.agent.rollout import AgentEngine, wrap_engine
from grpo_cli.agent.template import ToolFraming, check_template
from grpo_cli.agent.tools import ToolCall, ToolError, load_tools, parse_hermes
from grpo_cli.config.agent import AgentConfig
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.seeds import turn_seed

HERE = Path(__file__).parent
TOOLS = str(HERE / "tools_for_tests.py")
CALL = '<tool_call> {"name": "calculator", "arguments": {"a": 2, "b": 3}} </tool_call> <eos>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from grpo_cli.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tools-tok"), tools=True)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _agent(tok, engine, **cfg) -> AgentEngine:
    return wrap_engine(engine, AgentConfig(tools=cfg.pop("tools", ["calculator"]), tool_isolation="inline", **cfg),
                       tok)


def test_ids_are_the_sampled_ones_and_equal_one_rendering_of_the_conversation(tok):
    schemas = [t.schema() for t in load_tools(["calculator"]).values()]
    user = [{"role": "user", "content": "what is two plus three ?"}]
    prompt = _ids(tok, tok.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True))
    turn1, turn2 = _ids(tok, CALL), _ids(tok, "5 <eos>")
    engine = ScriptedEngine([[turn1], [turn2]], eos=tok.eos_token_id)
    out = _agent(tok, engine).generate([prompt], SamplingParams(n=1, max_tokens=40, seed=1))
    whole = user + [{"role": "assistant", "content": CALL.removesuffix(" <eos>")}, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": "5"}]
    rendered = _ids(tok, tok.apply_chat_template(whole, tools=schemas, tokenize=False))
    assert prompt + out.completion_ids[0] == rendered
    env = [tok.convert_tokens_to_ids("<tool>"), *_ids(tok, "5"), tok.eos_token_id, tok.convert_tokens_to_ids("<assistant>")]
    assert out.completion_ids[0] == turn1 + env + turn2
    assert out.loss_masks[0] == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    assert out.sampler_logprobs[0] == [-0.5] * len(turn1) + [0.0] * len(env) + [-0.5] * len(turn2)
    assert engine.calls[1][0] == [prompt + turn1 + env]  # turn 2's input: ids, not a re-encoding of text
    assert engine.seeds == [1, turn_seed(1, 1)]  # rollout/seeds.py: turn 1's seed is no other call's
    assert out.trajectories[0][1] == {"role": "tool", "content": "5"} and out.metrics["tools/turns"] == 2.0


def test_later_turns_name_the_prompt_they_continue_and_keep_the_busiest_turns_load(tok):
    """A server client sends a later turn where its first turn went (rollout/routing.py): the agent loop tells it
    which prompt of the first call each continuing trajectory belongs to."""
    call, done = _ids(tok, CALL), _ids(tok, "5 <eos>")
    engine = ScriptedEngine([[done, call, done, call], [done, done]], eos=tok.eos_token_id)
    p0, p1 = _ids(tok, "one"), _ids(tok, "two")
    out = _agent(tok, engine).generate([p0, p1], SamplingParams(n=2, max_tokens=40))
    assert engine.firsts == [[0, 1]]  # trajectories 1 (prompt 0) and 3 (prompt 1) called a tool
    assert engine.calls[1][0][0][: len(p0)] == p0 and engine.calls[1][0][1][: len(p1)] == p1
    assert out.metrics["rollout/server_load/max"] == 4.0  # turn 0 had 4 requests, turn 1 two


def test_ids_a_bpe_would_merge_survive(tmp_path):
    """Sampled ids ["a", "b"] decode to "ab", which the tokenizer encodes as one merged id: the trajectory keeps
    the two sampled ids (re-tokenising text is what drifted for TRL and verl users)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "a": 1, "b": 2, "ab": 3, "x": 4}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    core.add_special_tokens(["<eos>"])
    bpe = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    assert bpe.encode("ab", add_special_tokens=False) == [3]
    engine = ScriptedEngine([[[1, 2, 0]]], eos=0)
    agent = AgentEngine(engine, AgentConfig(tools=["calculator"]), bpe, tools={}, parse=parse_hermes,
                        framing=ToolFraming([4], [4]))
    out = agent.generate([[4]], SamplingParams(n=1, max_tokens=8))
    assert out.completion_ids == [[1, 2, 0]]


def test_a_think_stripping_template_is_refused(tok):
    strip = ("{% for m in messages %}<{{ m['role'] }}> {% if m['role'] == 'assistant' and not loop.last %}"
             "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %} <eos> {% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}{% for t in tools or [] %}{{ t['function']['name'] }}"
             "{% endfor %}")
    schemas = [t.schema() for t in load_tools(["calculator"]).values()]
    with pytest.raises(ToolError, match="not prefix-preserving"):
        check_template(tok, template=strip, tools=schemas)
    no_tools = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    with pytest.raises(ToolError, match="does not render `tools`"):
        check_template(tok, template=no_tools, tools=schemas)


def test_tool_tokens_take_no_part_in_loss_or_gradient(tok):
    """Logprobs (and the old/sampler logprobs) at environment positions can be anything: the loss and every
    gradient stay the same, and the gradient there is 0."""
    from grpo_cli.config.algorithm import AlgorithmConfig
    from grpo_cli.rollout.base import RolloutBatch
    from grpo_cli.train.batch import build_batch
    from grpo_cli.train.loss import compute_loss

    masks = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1, 1]]
    rollout = RolloutBatch(prompt_ids=[[5, 6]], completion_ids=[[7] * 7, [8] * 7], finish_reasons=["stop"] * 2,
                           sampler_logprobs=[[-1.0] * 7] * 2, loss_masks=masks)
    batch = build_batch(rollout, group_size=2, pad_token_id=0)
    assert batch.completion_mask.tolist() == [[float(m) for m in row] for row in masks]
    g = torch.Generator().manual_seed(0)
    base = -torch.rand(2, 7, generator=g, dtype=torch.float64)
    tool = batch.completion_mask == 0

    def loss_and_grad(noise: float):
        lp = (base + noise * tool).requires_grad_(True)
        loss, _ = compute_loss(logprobs=lp, old_logprobs=(base - 0.1) + 3 * noise * tool, ref_logprobs=None,
                               sampler_logprobs=batch.sampler_logprobs.double() - 7 * noise * tool,
                               advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
                               completion_mask=batch.completion_mask.double(), algorithm=AlgorithmConfig(),
                               num_items_in_batch=float(batch.completion_mask.sum()), num_sequences_in_batch=2,
                               max_completion_length=7)
        loss.backward()
        return loss.detach(), lp.grad

    (l0, g0), (l1, g1) = loss_and_grad(0.0), loss_and_grad(25.0)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert torch.all(g0[tool] == 0) and torch.any(g0[~tool] != 0)


def test_max_turns_truncated_turns_and_overflowing_results(tok):
    call, eos = _ids(tok, CALL), tok.eos_token_id
    # max_turns 2: the second turn calls again, and that call is not run
    engine = ScriptedEngine([[call], [call]], eos=eos)
    out = _agent(tok, engine, max_turns=2).generate([[9]], SamplingParams(n=1, max_tokens=200))
    assert len(engine.calls) == 2 and out.metrics["tools/calls_per_rollout"] == 1.0
    # a turn cut by length: its (partial) call is not run
    engine = ScriptedEngine([[call[:-3]]], eos=eos)
    out = _agent(tok, engine).generate([[9]], SamplingParams(n=1, max_tokens=len(call) - 3))
    assert out.finish_reasons == ["length"] and len(engine.calls) == 1
    assert out.metrics["tools/calls_per_rollout"] == 0.0
    # a result longer than max_tool_output_tokens is cut; one that overflows the budget ends the trajectory
    engine = ScriptedEngine([[call], [_ids(tok, "5 <eos>")]], eos=eos)
    out = _agent(tok, engine, max_tool_output_tokens=4).generate([[9]], SamplingParams(n=1, max_tokens=200))
    assert sum(1 for m in out.loss_masks[0] if m == 0) <= 4 + 1 + 3  # cut result + "…" + framing
    engine = ScriptedEngine([[call]], eos=eos)
    out = _agent(tok, engine).generate([[9]], SamplingParams(n=1, max_tokens=len(call) + 2))
    assert out.finish_reasons == ["length"] and len(out.completion_ids[0]) == len(call) + 2
    assert len(engine.calls) == 1  # no room left to answer: no second turn


@pytest.mark.parametrize("text,expected", [
    ('<tool_call> {"name": "nope", "arguments": {}} </tool_call>', "unknown tool 'nope'"),
    ("<tool_call> {not json} </tool_call>", "not valid JSON"),
    ('<tool_call> {"name": "add", "arguments": {"a": 1}} </tool_call>', "bad arguments for add"),
    ('<tool_call> {"name": "boom", "arguments": {"x": 1}} </tool_call>', "RuntimeError: tool exploded"),
])
@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_each_tool_error_goes_back_to_the_model(text, expected, isolation):
    tools = load_tools([f"{TOOLS}:add", f"{TOOLS}:boom"])
    [(result, outcome)] = run_calls(parse_hermes(text), tools, timeout=20, isolation=isolation)
    assert outcome == "error" and result.startswith("error:") and expected in result, result


def test_a_hanging_tool_times_out_and_leaves_no_process():
    tools = load_tools([f"{TOOLS}:spin", f"{TOOLS}:add"])
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    start = time.perf_counter()
    results = run_calls([ToolCall("spin", {"x": 1}), ToolCall("add", {"a": 2, "b": 3})], tools, timeout=1.0,
                        isolation="process")
    took = time.perf_counter() - start
    assert results[0] == ("error: spin timed out after 1 s", "timeout") and results[1] == ("5", "ok")
    assert took < 3.0, took
    from grpo_cli.agent import execute

    running = [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.pid not in before]
    assert all(p.status() != psutil.STATUS_RUNNING or p.cpu_percent(0.2) < 50 for p in running)  # no spinner
    execute._POOL.close()  # what the trainer does at exit
    assert [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.pid not in before] == []


def test_calls_sent_together_keep_their_own_timeouts(monkeypatch):
    """Process isolation sends each interpreter its share of a turn's calls in one message (here all 4 to one): the
    hanging second call times out after its own 1 s and its interpreter is killed, the calls before and after it
    still answer (the rest on a fresh interpreter), and no spinner is left."""
    from grpo_cli.agent import execute

    monkeypatch.setattr(execute, "POOL_SIZE", 1)  # one chunk: every call in one message
    tools = load_tools([f"{TOOLS}:spin", f"{TOOLS}:add"])
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    calls = [ToolCall("add", {"a": 1, "b": 1}), ToolCall("spin", {"x": 1}), ToolCall("add", {"a": 2, "b": 3}),
             ToolCall("add", {"a": 4, "b": 4})]
    start = time.perf_counter()
    results = run_calls(calls, tools, timeout=1.0, isolation="process")
    took = time.perf_counter() - start
    assert results == [("2", "ok"), ("error: spin timed out after 1 s", "timeout"), ("5", "ok"), ("8", "ok")]
    assert took < 3.0, took
    running = [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.pid not in before]
    assert all(p.status() != psutil.STATUS_RUNNING or p.cpu_percent(0.2) < 50 for p in running)  # no spinner


def test_inline_calls_run_together_on_threads_started_once():
    """A late inline call times out on its own clock and leaves the pool serving; a turn's calls run at once; the
    threads are kept for the next turn (the pool does not grow when the same number of calls comes again)."""
    from grpo_cli.agent.inline import InlinePool

    pool = InlinePool()
    tools = load_tools([f"{TOOLS}:nap", f"{TOOLS}:add"])
    start = time.perf_counter()
    late = run_calls([ToolCall("nap", {"seconds": 30}), ToolCall("add", {"a": 2, "b": 3})], tools, timeout=0.5,
                     isolation="inline")
    assert late == [("error: nap timed out after 0.5 s", "timeout"), ("5", "ok")]
    assert time.perf_counter() - start < 2.0
    naps = [lambda: tools["nap"].fn(seconds=0.3)] * 16
    start = time.perf_counter()
    assert pool.run(naps, timeout=10) == [("awake", False)] * 16
    assert time.perf_counter() - start < 3.0  # one after another: 4.8 s
    started = pool.threads
    assert pool.run(naps, timeout=10) == [("awake", False)] * 16 and pool.threads == started == 16


def test_tool_schemas_come_from_hints_and_docstrings():
    [add] = load_tools([f"{TOOLS}:add"]).values()
    fn = add.schema()["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two numbers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer", "description": "first"},
                                              "b": {"type": "integer", "description": "second"}}
    assert fn["parameters"]["required"] == ["a", "b"]


def test_an_environment_per_rollout_is_reset_with_its_row_and_rewards(tok):
    """Each trajectory gets its own instance, reset with its prompt's row; its methods are tools (bound: calls
    change that instance only); `reward()` comes back per trajectory."""
    from types import SimpleNamespace

    guess = _ids(tok, '<tool_call> {"name": "calculator", "arguments": {"a": 2, "b": 3}} </tool_call> <eos>')
    engine = ScriptedEngine([[guess, guess], [_ids(tok, "5 <eos>")] * 2], eos=tok.eos_token_id)
    cfg = AgentConfig(tools=["calculator"], environment=f"{TOOLS}:Counter", tool_isolation="inline",
                      tool_parser=f"{TOOLS}:always_guess", max_turns=2)
    agent = wrap_engine(engine, cfg, tok)
    agent.bind_prompts([SimpleNamespace(columns={"answer_number": 5}), SimpleNamespace(columns={"answer_number": 9})])
    out = agent.generate([[9], [9]], SamplingParams(n=1, max_tokens=100))
    assert [m["content"] for m in out.trajectories[0] if m["role"] == "tool"] == ["right"]
    assert [m["content"] for m in out.trajectories[1] if m["role"] == "tool"] == ["higher"]
    assert out.environment_rewards == [1.0, 1.0]  # one guess each, counted by its own instance


def test_environment_config_needs_inline_and_something_to_call():
    with pytest.raises(ValueError, match="tool_isolation: inline"):
        AgentConfig(environment=f"{TOOLS}:Counter")
    with pytest.raises(ValueError, match="needs tools"):
        AgentConfig()
