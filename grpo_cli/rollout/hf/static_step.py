"""Static shapes for the lean decode step: the active rows are padded to a bucket size (`bucket_size`), the KV
cache's rows live in buffers allocated once per decode and compacted in place, and the step's inputs are copied into
fixed buffers, so every step of a bucket has the same shapes and addresses. On CUDA each bucket's step is captured
once as a CUDA graph and replayed (`runtime.accel.StepGraph`), by later decodes of the same shape too (`StepStore`);
elsewhere the same step is called."""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from grpo_cli.runtime.accel import StepGraph


def bucket_size(n: int) -> int:
    """The smallest bucket ≥ n among 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, …: powers of two and 1.5 × powers of two,
    so padding wastes under a third of a batch and a decode of B rows uses at most 2·log₂B graphs."""
    if n <= 2:
        return max(n, 1)
    power = 1 << (n - 1).bit_length()
    return 3 * power // 4 if 3 * power // 4 >= n else power


def _padding(rows: int, size: int, device) -> torch.Tensor:
    """Row indices 0 … rows − 1, then row 0 again up to `size` (padding rows whose results are dropped)."""
    return torch.cat([torch.arange(rows, device=device), torch.zeros(size - rows, dtype=torch.long, device=device)])


class StaticStep:
    """One decode's static-shape step over `cache` (its layers' keys/values (n, KV, S, D), n active rows): the rows
    are padded to `bucket_size(n)` (copies of row 0, whose results are dropped), `compact` moves the kept rows to
    the front of the same buffers, `__call__` runs `step` on the first `bucket_size(rows)` rows of every buffer.

    `step(plan, keys, values, tokens, positions, slot, bias, noise)` is `decode_step.decode_sample` (with its
    sampling knobs bound), eager or compiled; `tensor_slot` passes the slot as a (1,) tensor (a compiled or captured
    step, for which an int would be a new constant every step), else as an int (eager: a slice copy)."""

    def __init__(self, step, plan, cache, *, vocab: int, tensor_slot: bool, prepare=None) -> None:
        rows = cache.layers[0].keys.shape[0]
        size = bucket_size(rows)
        keys0 = cache.layers[0].keys
        device, slots = keys0.device, keys0.shape[2]
        self.cache, self.plan, self.step, self.prepare, self.capacity = cache, plan, step, prepare, size
        if size == rows:  # no padding row: the cache's own tensors are the buffers (no copy of the whole cache)
            self.keys = [layer.keys for layer in cache.layers]
            self.values = [layer.values for layer in cache.layers]
        else:
            pad = _padding(rows, size, device)
            self.keys = [layer.keys.index_select(0, pad) for layer in cache.layers]
            self.values = [layer.values.index_select(0, pad) for layer in cache.layers]
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.bias = torch.zeros((size, 1, 1, slots), dtype=torch.float32, device=device)
        self.noise = torch.full((size, vocab), 0.5, dtype=torch.float32, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device) if tensor_slot else None
        self.graphs: dict[int, StepGraph] = {}
        self.capture_on: torch.device | None = device  # where StepGraph captures (CUDA); None: never
        self.pool = None
        self._view(size)

    def load(self, cache) -> None:
        """Take the next decode's `cache` (as many layers, rows in the same bucket, the same slots) into this step's
        buffers, where the graphs captured so far read them: one copy of its KV, against a capture per bucket."""
        rows = cache.layers[0].keys.shape[0]
        pad = _padding(rows, self.capacity, self.tokens.device)
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            torch.index_select(layer.keys, 0, pad, out=keys)
            torch.index_select(layer.values, 0, pad, out=values)
        self.tokens.zero_()  # the padding rows as __init__ left them: the last decode's rows must not leak in
        self.positions.zero_()
        self.bias.zero_()
        self.noise.fill_(0.5)
        self.cache = cache
        self._view(self.capacity)

    def captured(self) -> bool:
        """Whether a step of this decode was captured as a CUDA graph (what keeping this step is worth)."""
        return any(graph.graph is not None for graph in self.graphs.values())

    def _view(self, size: int) -> None:
        """Point the cache's layers at the first `size` rows of the buffers (what `_stash` and the step read)."""
        self.size = size
        for layer, keys, values in zip(self.cache.layers, self.keys, self.values, strict=True):
            layer.keys, layer.values = keys[:size], values[:size]

    def compact(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` (sorted active rows), moved to the front of the buffers, in the next smaller bucket."""
        size = bucket_size(len(keep))
        index = torch.cat([keep, keep.new_zeros(size - len(keep))])
        for buffer in (*self.keys, *self.values):
            buffer[:size].copy_(buffer.index_select(0, index))
        self._view(size)

    def inputs(self, size: int, slot) -> tuple:
        return (self.plan, [k[:size] for k in self.keys], [v[:size] for v in self.values], self.tokens[:size],
                self.positions[:size], slot, self.bias[:size], self.noise[:size])

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, bias: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logprobs) of the n active rows: their inputs copied into the buffers, uniform noise (n, V) drawn
        into its buffer from `generator` (the same draws as `sampling.draw_noise`), the bucket's step run (on CUDA
        with a tensor slot: its graph, captured at the bucket's first step and replayed after)."""
        n, size = len(tokens), self.size
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.bias[:n].copy_(bias)
        torch.rand((n, self.noise.shape[1]), generator=generator, out=self.noise[:n])
        if self.slot is None:
            return tuple(t[:n] for t in self.step(*self.inputs(size, slot)))
        self.slot.fill_(slot)
        graph = self.graphs.get(size)
        if graph is None:
            args = self.inputs(size, self.slot)
            if self.prepare is not None:
                self.prepare(*args)
            graph = self.graphs[size] = self._graph(functools.partial(self.step, *args))
        return tuple(t[:n] for t in graph())

    def _graph(self, fn) -> StepGraph:
        """`fn` captured on the step's device (CUDA); a step CUDA cannot capture runs uncaptured from then on, with
        a warning naming the failure (the same tokens, without the graph's launch savings)."""
        try:
            graph = StepGraph(fn, self.capture_on, pool=self.pool)
        except RuntimeError as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            warnings.warn(f"hf engine: the decode step could not be captured as a CUDA graph ({reason}); this decode "
                          "runs it uncaptured.", RuntimeWarning, stacklevel=3)
            self.capture_on = None  # StepGraph then captures nothing: it calls the step
            return StepGraph(fn, self.capture_on)
        self.pool = self.pool if self.pool is not None else graph.pool()
        return graph


def weight_addresses(model) -> tuple[int, ...] | None:
    """The addresses of `model`'s parameters and buffers, which a captured step reads: a graph kept across decodes
    stays valid while they are the same tensors, updated in place (an optimizer step, weight sync); None where
    they are not plain tensors (DTensor shards), whose memory a capture cannot pin down."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return None
    return tuple(t.data_ptr() for t in tensors)


class StepStore:
    """An engine's last `StaticStep` whose buckets were captured as CUDA graphs, kept between decodes: the next
    decode of the same shape (`key`: bucket, slots, sampling knobs…) over the same weight tensors
    (`weight_addresses`) takes it back, loads its KV into the step's buffers (`StaticStep.load`) and the weights into
    its plan's fused copies (`DecodePlan.refresh`), and replays the graphs instead of capturing each bucket again.
    It holds one decode's KV buffers and the graphs' memory pool until a decode of another shape replaces it or
    `clear` (the engine's `sleep` and `close`) drops it; a decode that keeps its rows' KV (multi-turn) is not kept,
    since those rows are views of its buffers."""

    def __init__(self) -> None:
        self._held: tuple[tuple, StaticStep] | None = None
        self._lock = threading.Lock()  # a server may decode on several threads: one of them takes the step

    def take(self, key: tuple, weights: tuple | None, cache, build) -> StaticStep:
        """The kept step loaded with `cache` when it was built for (`key`, `weights`), else `build()` (the kept
        one dropped first, so its memory is free for the new one)."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None and weights is not None and held[0] == (key, weights):
            step = held[1]
            step.load(cache)
            step.plan.refresh()
            return step
        del held
        return build()

    def put(self, key: tuple, weights: tuple | None, step: StaticStep) -> None:
        if weights is not None and step.captured():
            with self._lock:
                self._held = ((key, weights), step)

    def clear(self) -> None:
        with self._lock:
            self._held = None
