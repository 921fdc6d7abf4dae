"""SGLang's two weight transports, through its native API: `disk` (a safetensors checkpoint in a folder both sides
read, then `/update_weights_from_disk`) and `tensor` (`/update_weights_from_tensor` per bucket, CUDA IPC handles in
the payload of `sglang_payload`, inside a `/begin_weight_update` … `/end_weight_update` session from sglang 0.5.21)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport

CONFIG_FILES = ("config.json", "generation_config.json")


def sglang_serializer(named_tensors: list) -> str:
    """SGLang's wire format for `/update_weights_from_tensor` (CUDA IPC handles, the device as its UUID):
    `sglang_payload.sglang_serializer`, imported when a tensor update runs (it imports torch)."""
    from grpo_cli.rollout.transport.sglang_payload import sglang_serializer as serialize

    return serialize(named_tensors)


class DiskTransport(WeightTransport):
    """Writes a safetensors checkpoint (+ the model's config files from `model_path`) into a new folder under
    `sync_dir` (default: the system temp dir), then `/update_weights_from_disk` (which also flushes the radix cache).
    SGLang then reports that folder as its model path (`tokenizer_manager._update_model_path_info`), so it lives until
    the next update or close()."""

    name = "disk"
    takes = ("model_path", "sync_dir")

    def __init__(self, link: Link, *, model_path: str | None = None, sync_dir: str | None = None) -> None:
        super().__init__(link)
        self.model_path, self.sync_dir = model_path, sync_dir
        self.loaded_folder: Path | None = None

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        from safetensors.torch import save_file

        root = Path(self.sync_dir or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"grpo-weights-v{version}-", dir=root))
        replies = []
        try:
            tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in named_tensors}
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            for name in CONFIG_FILES:
                src = Path(self.model_path or "") / name
                if self.model_path and src.is_file():
                    shutil.copy(src, folder / name)
            for url in self.link.urls:
                res = self.link.http.call(url, "POST", "/update_weights_from_disk", idempotent=False, json={
                    "model_path": str(folder), "weight_version": str(version), "flush_cache": True,
                    "abort_all_requests": False}).json()
                if not res.get("success", False):
                    raise RolloutError(f"SGLang server {url} refused the weights: {res.get('message')}")
                replies.append(res)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.close()
        self.loaded_folder = folder
        return replies

    def close(self) -> None:
        if self.loaded_folder is not None:
            shutil.rmtree(self.loaded_folder, ignore_errors=True)
            self.loaded_folder = None


class TensorTransport(WeightTransport):
    """`/update_weights_from_tensor` per bucket of `chunk_bytes`, posted to every server as soon as it is full, so the
    trainer holds one bucket (plus the tensor that overflowed it), never the whole model. Each carries one payload
    serialized per TP rank of the server (`tp_size(url)`; each rank deserializes its own index:
    `managers/tp_worker.py`); the cache is flushed and the version set on the last bucket only (SGLang does both per
    call, when asked: `scheduler_components/weight_updater.py` update_weights_from_tensor). On sglang >= 0.5.21 the
    buckets run inside a weight-update session on each server (that file refuses them outside one)."""

    name = "tensor"
    takes = ("tp_size", "serializer")

    def __init__(self, link: Link, *, tp_size: Callable[[str], int], serializer: Callable[[list], str] | None = None
                 ) -> None:
        super().__init__(link)
        self.tp_size = tp_size
        self.serializer = serializer or sglang_serializer
        self.sessions: dict[str, bool] = {}  # url -> has /begin_weight_update (sglang >= 0.5.21)

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        from grpo_cli.rollout.transport.codec import size_buckets

        http, urls = self.link.http, self.link.urls
        sessions: list[str] = []
        replies: list[dict] = []
        try:
            for url in urls:
                if self._begin_session(url):
                    sessions.append(url)
            for k, (bucket, last) in enumerate(size_buckets(named_tensors, chunk_bytes=chunk_bytes)):
                replies = [self._post_bucket(url, bucket, k, last, version) for url in urls]
                bucket.clear()  # the generator fills the next bucket while the loop still names this list
        finally:
            for url in sessions:
                http.call(url, "POST", "/end_weight_update", idempotent=False, json={})
        return replies

    def _post_bucket(self, url: str, bucket: list, k: int, last: bool, version: int) -> dict:
        payloads = [self.serializer(bucket) for _ in range(self.tp_size(url))]
        body = {"serialized_named_tensors": payloads, "flush_cache": last, "abort_all_requests": False,
                "weight_version": str(version) if last else None}
        res = self.link.http.call(url, "POST", "/update_weights_from_tensor", idempotent=False, json=body).json()
        if not res.get("success", False):
            raise RolloutError(f"SGLang server {url} refused weight bucket {k}: {res.get('message')}")
        return res

    def _begin_session(self, url: str) -> bool:
        """Open a weight-update session; False on SGLang without sessions (< 0.5.21: the endpoint answers 404). A
        session left open by a trainer that died mid-sync is closed and opened again."""
        if self.sessions.get(url) is False:
            return False
        http = self.link.http
        try:
            http.call(url, "POST", "/begin_weight_update", idempotent=False, json={})
        except RolloutError as e:
            if "answered 404" in str(e) and url not in self.sessions:
                self.sessions[url] = False
                return False
            if "already open" not in str(e):
                raise
            http.call(url, "POST", "/end_weight_update", idempotent=False, json={})
            http.call(url, "POST", "/begin_weight_update", idempotent=False, json={})
        self.sessions[url] = True
        return True
