"""One rank of the tool-calls-on-one-rank test (run by test_ranks_tool_calls.py, not collected by pytest): a vLLM
engine at tensor parallel 2 over both ranks (external launcher) under the agent loop, where a scripted tool parser
calls the calculator on one rank only, then a direct `generate` with a different `max_tokens` on each rank."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

# The prompts differ per rank (and in count), so a rank handed its peer's rows would be seen.
PROMPTS = {0: [[3, 4, 6, 7, 5], [3, 4, 8, 5]], 1: [[3, 4, 9, 10, 11, 5]]}
MAX_TOKENS = {0: 6, 1: 2}  # the direct call's per-rank max_tokens


def calls_on_one_rank(text: str) -> list[tuple[str, dict]]:
    """A tool parser (`agent.tool_parser`): every finished turn calls `calculator(2, 3)` on the rank named by
    `CALLER_RANK`, none on the others (so only that rank's trajectories go on to a second turn)."""
    return [("calculator", {"a": 2, "b": 3})] if os.environ["RANK"] == os.environ["CALLER_RANK"] else []


def _agent_round(agent, engine, caller: int, rank: int) -> dict:
    """One multi-turn generate with the calls on `caller`'s rank; each trajectory's shape, and the largest gap
    between its sampled tokens' logprobs and the engine's own scoring of (this rank's prompt + trajectory)."""
    from grpo_cli.rollout.base import SamplingParams

    os.environ["CALLER_RANK"] = str(caller)
    n = 2
    out = agent.generate(PROMPTS[rank], SamplingParams(n=n, max_tokens=40, seed=11 + caller))
    sequences = [PROMPTS[rank][j // n] + ids for j, ids in enumerate(out.completion_ids)]
    scored = engine.score(sequences)  # collective too: both ranks must still be in step here
    gap = 0.0
    for j, (ids, mask, lps) in enumerate(zip(out.completion_ids, out.loss_masks, out.sampler_logprobs, strict=True)):
        start = len(PROMPTS[rank][j // n]) - 1  # score[t] is the logprob of sequence[t + 1]
        gap = max([gap] + [abs(scored[j][start + t] - lps[t]) for t, m in enumerate(mask) if m])
    return {"prompts": out.prompt_ids, "turns": [len([m for m in t if m["role"] == "assistant"])
                                                 for t in out.trajectories],
            "tool_results": [[m["content"] for m in t if m["role"] == "tool"] for t in out.trajectories],
            "sampled": [sum(mask) for mask in out.loss_masks], "finish": out.finish_reasons, "gap": gap}


def main(checkpoint: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from grpo_cli.agent.rollout import wrap_engine
    from grpo_cli.config.agent import AgentConfig
    from grpo_cli.rollout.base import SamplingParams
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a rank left waiting fails, not hangs
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    # Every id stops generation: each turn is one sampled token ending by `stop`, so the parser decides every turn.
    engine = VLLMEngine(checkpoint, dtype="float32", tensor_parallel_size=2, max_model_len=96, max_num_seqs=8,
                        seed=0, kv_cache_space_gib=1.0, distributed=True, eos_token_ids=list(range(len(tok))),
                        timeout_minutes=1, multi_turn=True)
    agent = wrap_engine(engine, AgentConfig(tools=["calculator"], tool_isolation="inline", max_turns=3,
                                            tool_parser=f"{Path(__file__).resolve()}:calls_on_one_rank"), tok)
    result = {"rank": rank, "rounds": [_agent_round(agent, engine, caller, rank) for caller in (0, 1)]}
    engine.eos_token_ids = [tok.eos_token_id]  # now completions run to max_tokens (or, rarely, an <eos>)
    direct = engine.generate(PROMPTS[rank], SamplingParams(n=2, max_tokens=MAX_TOKENS[rank], seed=5))
    result["direct"] = {"lengths": [len(c) for c in direct.completion_ids], "finish": direct.finish_reasons}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1], sys.argv[2])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
