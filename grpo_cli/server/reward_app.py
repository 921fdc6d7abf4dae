"""`grpo serve-rollout --task reward`: a sequence-classification checkpoint behind SGLang's reward-model route,
POST /classify `{"text": [...]}` → `[{"embedding": [score]}, ...]` in order (`rewards.model.score_texts`), plus
/health; bearer token and body limit as the rollout server's."""

from __future__ import annotations

import anyio
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

import grpo_cli
from grpo_cli.server.app import Guard


class ClassifyBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's request also names the model
    text: list[str] = Field(min_length=1, max_length=65536)


def create_reward_app(model: str, *, token: str | None, max_request_bytes: int, batch_size: int = 16,
                      on_startup=None) -> Guard:
    app = FastAPI(title="grpo serve-rollout --task reward", version=grpo_cli.__version__, docs_url=None,
                  redoc_url=None, openapi_url=None, on_startup=[on_startup] if on_startup else None)
    lock = anyio.Lock()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "task": "reward", "model": model}

    @app.post("/classify")
    async def classify(body: ClassifyBody) -> list[dict]:
        from grpo_cli.rewards.model import score_texts

        async with lock:
            scores = await anyio.to_thread.run_sync(lambda: score_texts(model, body.text, batch_size=batch_size))
        return [{"embedding": [s], "index": i} for i, s in enumerate(scores)]

    return Guard(app, token=token, max_body=max_request_bytes)
