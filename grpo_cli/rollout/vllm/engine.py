"""`vllm` engine (colocate): `vllm.LLM` inside each training process, tensor-parallel sub-groups over the
training ranks, in-place weight reloads with a version counter, and sleep/wake around training."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from grpo_cli.rollout.vllm import support as support
from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, RolloutError, SamplingParams, engine_dtype
from grpo_cli.rollout.seeds import derive_seed, request_seed

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

_ALL_TAGS = ("weights", "kv_cache")


class VLLMEngine(RolloutEngine):
    """Generates with an in-process `vllm.LLM`. `update_weights` reloads the trainer's tensors in place (one
    vLLM reload session per call, so a layer's tensors may arrive in any bucket), then resets the prefix cache.

    With `distributed=True` (world size > 1, torchrun/accelerate env set) every training rank creates an engine
    with `distributed_executor_backend="external_launcher"`; ranks `[k·tp, (k+1)·tp)` form one tensor-parallel
    group whose members all-gather their prompts, run the same requests in lockstep, and keep their own slice.
    Every call (generate, score, update_weights, sleep, wake_up) must therefore be made by all ranks together.

    Sleep (`sleep_level` 1/2, CUDA): every `generate` ends with a sleep (inside `hold_awake`, the block's end does),
    so the memory is the trainer's until the next generation; `update_weights` wakes the weights only, the next
    `generate` the KV cache. Level 2 discards the weights, so it is only right when a weight sync follows before the
    next generation: generations that no sync follows (evaluation) run inside `keeping_weights()` and sleep at
    level 1.
    """

    shares_policy_weights = False

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int,
        max_num_seqs: int | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        sleep_level: int = 0,
        kv_cache_space_gib: float = 1.0,
        distributed: bool = False,
        eos_token_ids: list[int] | None = None,
        device: torch.device | None = None,
        timeout_minutes: float | None = None,
        block_size: int | None = None,
        multi_turn: bool = False,
    ) -> None:
        """`device`: the trainer's resolved device (default: `distributed.device: auto` for this local rank);
        `timeout_minutes`: of a process group the engine creates itself (default `distributed.timeout_minutes`)."""
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_space_gib)))  # int-only env var
        vllm = support.import_vllm()
        import torch

        from grpo_cli.runtime import accel

        self.device = torch.device(device) if device is not None else accel.resolve_device(
            "auto", accel.local_rank_from_env())
        self.model_path, self.max_model_len, self.tp, self.seed = model_path, max_model_len, tensor_parallel_size, seed
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else None
        self.weight_version, self._calls = 0, 0
        self.rank, self.world_size = support.check_launch_env(tensor_parallel_size, distributed)
        # Before any group exists: a group this engine creates (here or in vLLM) is its own to destroy at close.
        self._owns_process_group = not torch.distributed.is_initialized()
        self.tp_group = (support.tp_subgroup(self.device, tensor_parallel_size, self.world_size, timeout_minutes)
                         if tensor_parallel_size > 1 else None)
        notice = support.sleep_notice(sleep_level)
        self.notices = [notice] if notice else []
        self.sleep_level = 0 if notice else sleep_level
        self._asleep: set[str] = set()
        self._weights_discarded, self._keep_weights = False, False
        self._held, self._sleep_due = 0, None  # `hold_awake` blocks open; the level their end sleeps at
        self._pending_probe: Callable[[], dict] | None = None
        self.last_probe: dict[str, float] = {}
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        self._start(vllm, support.llm_kwargs(
            model_path, dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            seed=seed, sleep=self.sleep_level > 0, kv_cache_space_gib=kv_cache_space_gib, distributed=distributed,
            block_size=block_size, multi_turn=multi_turn, cpu=cpu), cpu=cpu)

    def _start(self, vllm, kwargs: dict, *, cpu: bool) -> None:
        """Create `vllm.LLM(**kwargs)` and run one token through it; a failure closes what was made and raises the
        fix (`support.startup_error`)."""
        import torch

        if cpu and hasattr(torch.cpu, "_init_amx"):
            # vllm-cpu's bf16 attention kernel uses AMX tiles without asking Linux for them first
            # (crash: "Illegal instruction"); torch's helper requests the permission.
            torch.cpu._init_amx()
        self.llm = None
        try:
            with support.preserve_rng(self.device):
                self.llm = vllm.LLM(**kwargs)
                # Some refusals (e.g. an unsupported CPU attention head dim) only surface at the first forward.
                self._run([[self._warmup_token()]], [vllm.SamplingParams(max_tokens=1, seed=0, detokenize=False)])
        except Exception as exc:
            self.close()
            support.abandon_start(owns_process_group=self._owns_process_group)
            raise support.startup_error(exc, model_path=kwargs["model"], max_model_len=kwargs["max_model_len"]) \
                from exc
        self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype

    @classmethod
    def from_config(cls, cfg: GRPOConfig, ctx: EngineContext) -> VLLMEngine:
        """Engine for one training rank: sizes from `data`/`rollout`/`train`, `seed = train.seed + rank // tp`, on
        the device the trainer resolved from `distributed.device` (same rule: `accel.resolve_device`)."""
        from grpo_cli.runtime.accel import local_rank_from_env, resolve_device

        v = cfg.rollout.vllm
        if ctx.world_size % v.tensor_parallel_size:
            raise RolloutError(
                f"rollout.vllm.tensor_parallel_size={v.tensor_parallel_size} must divide the number of training "
                f"processes ({ctx.world_size}); change one of them."
            )
        prompts_per_rank = math.ceil(cfg.train.prompts_per_step / ctx.world_size)
        return cls(
            ctx.model_path,
            dtype=engine_dtype(cfg),
            tensor_parallel_size=v.tensor_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len or cfg.max_sequence_length,
            max_num_seqs=v.max_num_seqs
            or prompts_per_rank * cfg.train.generations_per_prompt * v.tensor_parallel_size,
            enforce_eager=v.enforce_eager,
            seed=cfg.train.seed + ctx.rank // v.tensor_parallel_size,
            sleep_level=v.sleep_level,
            kv_cache_space_gib=v.kv_cache_space_gib,
            distributed=ctx.world_size > 1,
            eos_token_ids=ctx.eos_token_ids,
            device=resolve_device(cfg.distributed.device, local_rank_from_env()),
            timeout_minutes=cfg.distributed.timeout_minutes,
            block_size=v.block_size,
            multi_turn=cfg.agent is not None or cfg.rollout.custom is not None,
        )

    # ---- process groups -------------------------------------------------------------------------------

    def _gather_tp(self, items: list) -> tuple[list, int]:
        """All-gather `items` inside the TP group; returns the concatenation and this rank's offset in it."""
        if self.tp_group is None:
            return items, 0
        import torch.distributed as dist

        parts: list = [None] * self.tp
        dist.all_gather_object(parts, items, group=self.tp_group)
        me = dist.get_rank(group=self.tp_group)
        return [x for part in parts for x in part], sum(len(p) for p in parts[:me])

    def agree_any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of this TP group (one all-reduce over it; `flag` itself at TP 1)."""
        return flag if self.tp_group is None else support.any_in_group(flag, self.tp_group)

    # ---- generation -----------------------------------------------------------------------------------

    def _warmup_token(self) -> int:
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def _fallback_seed(self) -> int:
        """A step seed for unseeded calls: same on every rank of a TP group, different on every call."""
        self._calls += 1
        return derive_seed("unseeded", self.seed, self._calls)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        if not prompts:  # the whole TP group came with nothing (a step with no prompts)
            return []
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        import vllm

        start = time.perf_counter()
        self._ensure_awake()
        if self._pending_probe is not None:  # a sync's verification probe, kept until the engine was awake anyway
            check, self._pending_probe = self._pending_probe, None
            self.last_probe = check()
        seed = sampling.seed if sampling.seed is not None else self._fallback_seed()
        # Requests carry their rank's settings (a later agent turn's max_tokens differs per rank; some bring none)
        # and their rank's seeds (rollout/seeds.py), so the same step on another rank or TP grouping differs. They
        # are always seeded: unseeded ones would draw from each process's global generator, and the ranks of a TP
        # group would sample differently.
        ask = (sampling.n, sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k)
        local = [(list(p), request_seed(seed, rank=self.rank, prompt=i), ask) for i, p in enumerate(prompt_ids)]
        everything, offset = self._gather_tp(local)
        params = support.request_params(vllm, everything, stop_token_ids=self.eos_token_ids)
        try:
            outputs = self._run([p for p, *_ in everything], params)[offset : offset + len(local)]
        except Exception as exc:
            raise RolloutError(f"vLLM generation failed: {type(exc).__name__}: {exc}") from exc
        completions, reasons, logprobs = [], [], []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                completions.append(ids)
                reasons.append("stop" if c.finish_reason == "stop" else (c.finish_reason or "length"))
                logprobs.append([c.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
        timings = {"generate": time.perf_counter() - start}
        if self.sleep_level:
            level = min(self.sleep_level, 1) if self._keep_weights else self.sleep_level
            if self._held:
                self._sleep_due = level
            else:
                timings["sleep"] = self._timed_sleep(level)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions, finish_reasons=reasons,
            sampler_logprobs=logprobs, weight_version=self.weight_version, timings=timings,
        )

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Prompt logprobs of `sequences` (wakes the engine fully: a forward needs the KV cache). The one token
        sampled per request is discarded, but its request is seeded all the same: vLLM's V2 model runner draws an
        unseeded request's seed from NumPy's global generator, which is the trainer's."""
        import vllm

        self._ensure_awake()
        mine = [list(s) for s in sequences]
        everything, offset = self._gather_tp(mine)
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False,
                                     seed=self.seed)
        outputs = self._run(everything, [params] * len(everything))[offset : offset + len(mine)]
        return [[d[s[t + 1]].logprob for t, d in enumerate(o.prompt_logprobs[1:])] for o, s in zip(outputs, mine)]

    # ---- weights ----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors in place (vLLM fuses/shards/repacks them itself), reset the prefix cache and
        record `version`. The iterable is consumed lazily, so a caller may gather its buckets on the fly. Wakes
        the weights only (the KV cache waits for the next `generate`); a pending probe of an earlier sync is void."""
        self._pending_probe = None
        if "weights" in self._asleep:
            self.wake_up(["weights"])
        stats = {"tensors": 0, "bytes": 0}
        names: set[str] = set()

        def counted(items) -> Iterator:
            for name, tensor in items:
                names.add(name)
                stats["tensors"] += 1
                stats["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor.detach()

        try:
            with support.quiet_reload_logger():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(named_tensors)})
        except (AttributeError, TypeError) as exc:
            # vLLM without the layerwise reload (no method) or with the old argument-less one (TypeError, nothing
            # consumed yet): plain load_weights, right where weights are not repacked (CUDA).
            if "reload_weights" not in str(exc) or stats["tensors"]:
                raise
            if not any("reload_weights" in n for n in self.notices):
                self.notices.append(support.old_reload_notice(exc))
            self.llm.apply_model(lambda model: model.load_weights(counted(named_tensors)))
        self.llm.apply_model(partial(support.repack_cpu_experts, updated=names))
        self.llm.reset_prefix_cache()
        self._weights_discarded = False
        self.weight_version = version
        self.last_update = stats

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (done after every weight update; exposed for the rollout server)."""
        self.llm.reset_prefix_cache()

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """CPU copies of the engine's parameters named `names` that it holds unfused (e.g. norm weights, the
        embedding, vocabulary-padded); others are left out. Used by weight-sync verification as an exact checksum,
        right after the sync, while the trainer's optimizer state is still on the device: wakes the weights only."""
        wanted = set(names)

        def grab(model) -> dict:
            params = model.named_parameters(remove_duplicate=False)  # a tied output projection under its name too
            return {n: p.detach().to("cpu", copy=True) for n, p in params if n in wanted and p.numel()}

        self._ensure_awake(["weights"])
        return self.llm.apply_model(grab)[0]

    def probe_when_awake(self, check: Callable[[], dict]) -> bool:
        """Weight-sync verification (`weight_sync._check_engine`) scores its probe right after the sync, before
        the trainer has offloaded its optimizer state; scoring needs the KV cache, and waking it then would hold
        the KV cache and the training state on the device at once (a peak `grpo plan` rules out). So while the
        KV cache sleeps, `check` (the probe and its judgement) is kept and run by the next `generate` right after
        its wake-up, when the trainer has offloaded: a failed check raises there, its figures go to `last_probe`.
        Returns whether the check was kept (False: the caller runs it now). A later `update_weights` voids it."""
        if "kv_cache" not in self._asleep:
            return False
        self._pending_probe = check
        return True

    # ---- sleep / wake -------------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Release memory while training: 1 = offload weights + drop KV cache, 2 = drop both. No-op when sleep
        is off or unsupported (CPU), so the loop can call it unconditionally."""
        if not self.sleep_level or not level or self._asleep:
            return
        self.llm.reset_prefix_cache()
        support.memory_changing()  # the device's peak so far includes the awake engine: read before the unmapping
        self.llm.sleep(level=level)
        self._asleep = set(_ALL_TAGS)
        self._weights_discarded = level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate `tags` (default all). Lifecycle: wake ["weights"] → update_weights → wake ["kv_cache"]."""
        todo = [t for t in (tags or _ALL_TAGS) if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)
            support.memory_changing()  # mapped again: the reading that spans the sleep ends here

    @contextlib.contextmanager
    def keeping_weights(self):
        """Generations that no weight sync follows (evaluation, between a step's sync and the next step's rollout)
        sleep at level 1 at most: level 2 would discard the weights the next generation needs."""
        self._keep_weights = True
        try:
            yield
        finally:
            self._keep_weights = False

    @contextlib.contextmanager
    def hold_awake(self):
        """The turns of one multi-turn rollout (`agent:`, `rollout.custom`) generate without sleeping in between;
        the engine sleeps once when the outermost block ends, at the level its last generation asked for. Else turn
        2 at sleep level 2 found the weights discarded, and at level 1 each turn moved them and lost the prefix
        cache."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held and self._sleep_due is not None:
                level, self._sleep_due = self._sleep_due, None
                self.sleep(level)

    def _timed_sleep(self, level: int) -> float:
        start = time.perf_counter()
        self.sleep(level)
        return time.perf_counter() - start

    def _ensure_awake(self, tags: list[str] | None = None) -> None:
        self.wake_up(tags)
        if self._weights_discarded:
            raise RolloutError(
                "the vLLM engine slept at level 2 (weights discarded) and no weight sync followed; call "
                "`sync_weights` after every optimizer step (also skipped ones) or use rollout.vllm.sleep_level 1."
            )

    def close(self) -> None:
        """Shut the engine down (keeping the trainer's process group alive under a launcher)."""
        self._pending_probe = None
        if getattr(self, "llm", None) is None:
            return
        try:
            support.shutdown(self.llm, owns_process_group=self._owns_process_group)
        finally:
            self.llm = None
            gc.collect()
