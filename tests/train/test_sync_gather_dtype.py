"""fsdp2 weight sync gathers in the engine's dtype, on the training device: the float32 master shards are cast before
the all-gather (a bf16 engine: half the bytes on the wire), and under `fsdp2.cpu_offload` (shards in host memory) the
bucket is copied to the GPU before the collective, which ran over gloo on the host. Driven on CPU in a 1-rank gloo
group; the CUDA device is a `torch.device("cuda", 0)` with `accel.to_device` patched to record the move."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from grpo_cli.config.load import build_config
from grpo_cli.runtime import accel
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.backends.base import TrainingBackend
from grpo_cli.train.weights.hf_module import ModuleWeights
from grpo_cli.train.weights.shard_gather import GatheredBucket
from grpo_cli.train.weights.weight_sync import sync_weights
from grpo_cli.rollout.base import RolloutEngine

GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@pytest.fixture
def gathers(monkeypatch):
    """Every all-gather's input (dtype, bytes, device type), in order."""
    seen: list[tuple[torch.dtype, int, str]] = []
    real = getattr(dist, GATHER)

    def gather(output, input, *args, **kw):
        seen.append((input.dtype, input.numel() * input.element_size(), input.device.type))
        return real(output, input, *args, **kw)

    monkeypatch.setattr(dist, GATHER, gather)
    return seen


def _sharded(offload: bool = False) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A float32 `fully_shard`ed module (FSDP2's masters) and each parameter's full float32 value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), **kw)
    return model, masters


class _Bf16Engine(RolloutEngine):
    """An engine holding bfloat16 weights; keeps what it is sent."""

    dtype = "bfloat16"  # as an engine reports it
    weight_version = 0

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors, version: int) -> None:
        self.got.update((n, t.clone()) for n, t in named_tensors)
        self.weight_version = version


def test_sync_gathers_the_shards_in_the_engine_dtype(one_rank_group, gathers):
    model, masters = _sharded()
    engine = _Bf16Engine()
    sync_weights(engine, model, version=1, bucket_mb=1, verify=False, probe=None)
    numel = sum(t.numel() for t in masters.values())
    assert gathers == [(torch.bfloat16, 2 * numel, "cpu")]  # one bucket, half the float32 bytes
    assert engine.got.keys() == masters.keys()
    for name, master in masters.items():
        assert engine.got[name].dtype == torch.bfloat16
        assert torch.equal(engine.got[name], master.to(torch.bfloat16)), name


def test_cpu_offloaded_shards_are_gathered_on_the_training_device(one_rank_group, gathers, monkeypatch):
    """`fsdp2.cpu_offload`: the shards live in host memory; the bucket goes to the (CUDA) training device first."""
    model, masters = _sharded(offload=True)
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    cuda = torch.device("cuda", 0)
    moves: list[tuple] = []

    def to_device(tensor, device):
        moves.append((tensor.dtype, tensor.device.type, torch.device(device), len(gathers)))
        return tensor  # stays on the host here: there is no GPU; the gather then runs as it would on one

    monkeypatch.setattr(accel, "to_device", to_device)
    source = ModuleWeights(model, device=cuda)
    got = dict(source.named_tensors(bucket_mb=1, stats={"tensors": 0, "bytes": 0, "copies": {}}, keep_copies=set(),
                                    keep_rows=set(), dtype=torch.bfloat16))
    assert moves == [(torch.bfloat16, "cpu", cuda, 0)]  # the cast bucket, moved before the (first) gather
    assert [g[0] for g in gathers] == [torch.bfloat16]
    assert all(torch.equal(got[n], m.to(torch.bfloat16)) for n, m in masters.items())


def test_the_backend_hands_its_device_to_the_weight_source():
    backend = TrainingBackend(build_config(), DistInfo(), torch.device("cuda", 0))
    backend.module = torch.nn.Linear(2, 2)
    assert backend.weight_source().device == torch.device("cuda", 0)


def test_without_a_dtype_the_masters_are_gathered_as_they_are(one_rank_group, gathers):
    model, masters = _sharded()
    params = dict(model.named_parameters())
    bucket = GatheredBucket(list(params.values()))
    assert [g[0] for g in gathers] == [torch.float32]
    assert all(torch.equal(bucket.full(params[n]), m) for n, m in masters.items())


def test_exact_parameters_keep_their_dtype(one_rank_group, gathers):
    """A LoRA base weight is merged with its adapter before the cast, so it is gathered in its own dtype."""
    model, masters = _sharded()
    params = dict(model.named_parameters())
    base = params["0.weight"]
    bucket = GatheredBucket(list(params.values()), dtype=torch.bfloat16, exact=frozenset({id(base)}))
    assert sorted(str(g[0]) for g in gathers) == ["torch.bfloat16", "torch.float32"]
    assert torch.equal(bucket.full(base), masters["0.weight"])
    assert bucket.full(params["2.weight"]).dtype == torch.bfloat16


def test_to_device_moves_only_off_device_tensors():
    t = torch.ones(3)
    assert accel.to_device(t, torch.device("cpu")) is t and accel.to_device(t, "cpu") is t
    assert accel.to_device(t, "meta").device.type == "meta"


def test_a_lora_base_weight_is_merged_at_master_precision_then_cast(one_rank_group, gathers):
    """fsdp2 + LoRA: the adapted base weight is gathered in float32 and merged (W + s·B·A) before any cast; the other
    weights are gathered in the engine's dtype."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"]))
    with torch.no_grad():
        model.base_model.model[0].lora_B["default"].weight.normal_()
    layer = model.base_model.model[0]
    merged = (layer.base_layer.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight
              * layer.scaling["default"]).detach().clone()
    other = model.base_model.model[2].weight.detach().clone()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    engine = _Bf16Engine()
    sync_weights(engine, model, version=1, bucket_mb=1, verify=False, probe=None)
    assert torch.float32 in {g[0] for g in gathers} and torch.bfloat16 in {g[0] for g in gathers}
    assert torch.equal(engine.got["0.weight"], merged.to(torch.bfloat16))
    assert torch.equal(engine.got["2.weight"], other.to(torch.bfloat16))
