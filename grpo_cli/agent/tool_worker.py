"""A tool-running interpreter (`python -m grpo_cli.agent.tool_worker`): reads one JSON request per line
(`{"spec", "name", "arguments"}`), runs the tool, writes one JSON reply per line (`{"status", "text"}`). It shares
nothing with the trainer but these lines; `agent.execute.WorkerPool` starts, reuses and kills these processes."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from grpo_cli.runtime.workers import end_strays

    from grpo_cli.agent.execute import format_result
    from grpo_cli.agent.tools import load_tools

    loaded: dict[str, dict] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            tools = loaded.setdefault(req["spec"], load_tools([req["spec"]]))
            reply = {"status": "ok", "text": format_result(tools[req["name"]].fn(**req["arguments"]))}
        except BaseException as exc:  # noqa: BLE001  (any failure is the model's next message)
            reply = {"status": "error", "text": f"{type(exc).__name__}: {exc}"}
        end_strays()
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
