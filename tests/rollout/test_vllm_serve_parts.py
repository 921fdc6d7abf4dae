"""`rollout.engine: vllm-serve` without a server: config rules, the server facts check, the plugin's registration
and entry point, the `grpo_shm` engine's file checks (in process, on a /dev/shm file written as the trainer writes
it), and the NCCL transport's pure parts (rank offsets, bucket announcements). The real `vllm serve` runs in
tests/e2e/test_vllm_serve_run.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.vllm_serve.client import checksum_names, parse_version, tensor_digest
from grpo_cli.rollout.vllm_serve.server_facts import ServerFacts, serve_command
from grpo_cli.rollout.vllm_serve.weights import bucket_update_info, nccl_init_infos
from grpo_cli.rollout.transport.codec import write_stream


def _info(logprobs_mode="processed_logprobs", backend="grpo_shm", tp=1) -> dict:
    return {"vllm_config": {"model_config": {"dtype": "torch.bfloat16", "logprobs_mode": logprobs_mode,
                                             "max_model_len": 128},
                            "parallel_config": {"tensor_parallel_size": tp},
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


def test_versions_and_checksum_names():
    assert (parse_version("default"), parse_version("7"), parse_version("theirs")) == (0, 7, None)
    held = checksum_names({"dp0:pp0:pcp0:tp0:model.norm.weight": "a", "dp0:pp0:pcp0:tp1:model.norm.weight": "a"})
    assert held == {"model.norm.weight": {"a"}}
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
    push = base.create("nccl", link, client="vllm-serve", offered={"tp_size": lambda url: 1})
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
                       offered={"tp_size": lambda url: 1})
    push.comm, push.device = Comm(), torch.device("cpu")
    try:
        with pytest.raises(RolloutServerDown, match="did not confirm a NCCL bucket within 0.7 s"):
            push.send(iter([("w", torch.zeros(2))]), 1, chunk_bytes=1 << 20)
    finally:
        release.set()
        pool.shutdown(wait=True)
    assert "synchronize" not in order and "broadcast" in order and "abort" in order and push.comm is None
