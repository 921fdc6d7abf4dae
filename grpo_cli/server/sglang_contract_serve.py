"""Serve the SGLang contract server (`sglang_contract.py`, NOT SGLang) over HTTP, for rehearsals of SGLang presets
on machines without CUDA: `python -m grpo_cli.server.sglang_contract_serve --model PATH [--port 0]`."""

from __future__ import annotations

import argparse
import os

from grpo_cli.server.launch import READY_PREFIX, bind, sglang_command, url_of


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="Checkpoint folder (builtin:tiny works).")
    parser.add_argument("--port", type=int, default=0, help="Port on 127.0.0.1; 0 picks a free one.")
    parser.add_argument("--token-env", default="GRPO_ROLLOUT_TOKEN", help="Variable holding the API key.")
    args = parser.parse_args(argv)
    import uvicorn

    from grpo_cli.server.engines import ServeOptions, build
    from grpo_cli.server.sglang_contract import create_contract_app
    from grpo_cli.models.tiny import resolve_model_path

    model = resolve_model_path(args.model)
    sock = bind("127.0.0.1", args.port)
    # The contract server obeys the flags `grpo serve-rollout --engine sglang` would launch SGLang with.
    app = create_contract_app(build(ServeOptions(engine="hf", model=model)),
                              launch_args=sglang_command(ServeOptions(engine="sglang", model=model)),
                              api_key=os.environ.get(args.token_env) or None)
    url = url_of(sock)
    print(f"{READY_PREFIX}{url} (SGLang contract server, NOT SGLang; hf engine, model {model})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


if __name__ == "__main__":
    main()
