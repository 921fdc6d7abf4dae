"""The rehearsal's verdict is read from what the two launches left behind: a resumed launch that failed makes the
resume, sync-after-resume, export and learning rows FAIL (naming the launch's own error; any FAIL makes `--rehearse`
exit 2), and a run without its checkpoint fails the checkpoint row."""

from __future__ import annotations

import json
import time

from grpo_cli.config.load import build_config
from grpo_cli.launch.rehearse import plan_rehearsal
from grpo_cli.launch.rehearse_checks import collect_checks
from grpo_cli.launch.rehearse_run import Phase


def _first_run(run_dir, reh, started: float) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "time": started + s, "time/step": 0.5, "time/generate": 0.1, "time/sync": 0.05,
             "sync/seconds": 0.05, "weight_version": s, "dist/param_numel_local": 50.0,
             "dist/param_numel_total": 100.0}
            for s in range(1, reh.resume_at + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": reh.resume_at, "reward_first_10pct": -7.0,
                                                      "reward_last_10pct": -4.0, "backend": "fsdp2"}))


def test_failed_resume_fails_the_rows_that_depend_on_it(tmp_path):
    reh = plan_rehearsal(build_config("qwen-7b-async"), deepspeed_ready=False)
    started = time.time()
    _first_run(tmp_path / "run", reh, started)
    logs = tmp_path / "first.log", tmp_path / "resumed.log"
    logs[0].write_text("async: 2 rollout actor(s) on Ray hold weight version 0 (verified: probe logprob diff 1e-3)\n")
    logs[1].write_text("launching: ...\nerror: weight sync to version 10 did not take: probe logprobs differ\n")
    phases = [Phase("first run", 0, started, 20.0, logs[0]), Phase("resumed run", 1, started + 30, 20.0, logs[1])]
    checks = {c.name: c for c in collect_checks(reh, phases, tmp_path / "run")}
    assert checks["launch + load"].status == "ok" and checks["generate"].status == "ok"
    assert checks["checkpoint"].status == "FAIL"  # no checkpoint-10 folder was written
    assert checks["resume"].status == "FAIL" and "error: weight sync to version 10" in checks["resume"].detail
    assert checks["sync (verified)"].status == "FAIL"
    assert checks["final export"].status == "FAIL" and checks["reward rises"].status == "FAIL"
    assert {c.status for c in checks.values()} >= {"GPU only"}


def _offload_row(tmp_path, moved: dict[str, float], *, deepspeed_ready: bool = True):
    reh = plan_rehearsal(build_config("qwen-72b-colocate"), deepspeed_ready=deepspeed_ready)
    started = time.time()
    _first_run(tmp_path / "run", reh, started)
    path = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:  # the first step's offload has no gradients yet: 0 B; later ones move the bucket
        row["time/offload"] = 0.01
        row.update({f"offload/moved_bytes/{k}": (0.0 if row["step"] == 1 else v) for k, v in moved.items()})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "first.log"
    log.write_text("")
    return {c.name: c for c in collect_checks(reh, [Phase("first run", 0, started, 20.0, log)], tmp_path / "run")}


def test_offload_row_reports_the_bytes_moved_and_what_deepspeed_ignores(tmp_path):
    row = _offload_row(tmp_path, {"optimizer": 0.0, "grads": 8192.0})["offload"]
    assert row.status == "ok", row.detail
    assert ("asked optimizer, grads; moved per process (largest step): optimizer 0 B (on the host already), "
            "grads 8.0 KiB (the reduce bucket; partitions on the host)") in row.detail


def test_offload_row_fails_when_asked_state_did_not_move_or_ignored_state_did(tmp_path):
    row = _offload_row(tmp_path / "a", {"optimizer": 0.0, "grads": 0.0})["offload"]
    assert row.status == "FAIL" and "UNEXPECTED: grads moved nothing" in row.detail
    row = _offload_row(tmp_path / "b", {"optimizer": 4096.0, "grads": 8192.0})["offload"]
    assert row.status == "FAIL" and "optimizer moved although the backend keeps it on the host" in row.detail
    stand_in = _offload_row(tmp_path / "c", {"optimizer": 4096.0, "grads": 8192.0}, deepspeed_ready=False)
    assert stand_in["offload"].status == "ok"  # fsdp2 stands in for ZeRO-3: it moves both
