"""A tool-running interpreter (`python -m grpo_cli.agent.tool_worker`): reads one JSON message per line (a request
`{"spec", "name", "arguments"}`, or `{"batch": [requests]}`), runs each tool call, writes one JSON reply per request
(`{"status", "text"}`) as it finishes (`runtime.workers.serve_batch`). It shares nothing with the trainer but these
lines; `agent.execute.WorkerPool` starts, reuses and kills these processes."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from grpo_cli.runtime.workers import end_strays, serve_batch

    from grpo_cli.agent.execute import format_result
    from grpo_cli.agent.tools import load_tools

    loaded: dict[str, dict] = {}

    def handle(req: dict) -> dict:
        try:
            if req["spec"] not in loaded:  # once per tool (setdefault would load it again on every call)
                loaded[req["spec"]] = load_tools([req["spec"]])
            tools = loaded[req["spec"]]
            reply = {"status": "ok", "text": format_result(tools[req["name"]].fn(**req["arguments"]))}
        except BaseException as exc:  # noqa: BLE001  (any failure is the model's next message)
            reply = {"status": "error", "text": f"{type(exc).__name__}: {exc}"}
        end_strays()
        return reply

    for line in sys.stdin:
        serve_batch(json.loads(line), handle)


if __name__ == "__main__":
    main()
