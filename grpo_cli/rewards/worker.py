"""A reward worker interpreter (`python -m grpo_cli.rewards.worker`, started by `rewards.isolated`): one JSON
request per line (one completion), the function called in a fresh temporary working directory, one JSON reply
per line. Any exception, `SystemExit` included, is a reply with status `error`."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile


def main() -> None:
    from grpo_cli.runtime.workers import end_strays

    from grpo_cli.rewards.resolve import resolve

    fns: dict = {}
    home = os.getcwd()
    for line in sys.stdin:
        req = json.loads(line)
        work = tempfile.mkdtemp(prefix="reward-")
        try:
            os.chdir(work)
            if req["name"] not in fns:  # resolved once (setdefault would resolve it again on every call)
                fns[req["name"]] = resolve(req["name"])
            fn = fns[req["name"]]
            columns = {k: [v] for k, v in req["columns"].items()}
            [value] = fn([req["prompt"]], [req["completion"]], **columns, **req["kwargs"], **req["extras"])
            ok = value is None or (isinstance(value, (int, float)) and math.isfinite(value))
            reply = {"status": "ok", "value": value} if ok else {"status": "error", "text": f"returned {value!r}"}
        except BaseException as exc:  # noqa: BLE001  (SystemExit, MemoryError: that sample's failure)
            reply = {"status": "error", "text": f"{type(exc).__name__}: {exc}"}
        finally:
            os.chdir(home)
            shutil.rmtree(work, ignore_errors=True)
        end_strays()
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
