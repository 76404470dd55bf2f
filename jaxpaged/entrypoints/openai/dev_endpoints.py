"""vLLM's development-mode routes: sleep mode and the prefix-cache reset.

vLLM serves them when ``VLLM_SERVER_DEV_MODE=1``; here ``build_app(enable_dev_endpoints=True)``
(``jaxpaged serve --enable-dev-endpoints``, which also honours that variable) adds them. They
let whoever reaches the server free the engine's memory: keep them off public endpoints.

- ``POST /sleep?level=1``: ``LLMEngine.sleep`` in the engine core (level 1 frees the KV
  cache, 2 also the weights); 200 with an empty body, 400 for a bad level or an engine built
  without ``--enable-sleep-mode``, 409 while requests are unfinished.
- ``POST /wake_up`` (``?tags=kv_cache``, repeatable, as vLLM): re-allocates the KV cache;
  200 (also when not sleeping: a no-op, as in vLLM).
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
- ``POST /reset_prefix_cache``: forget every cached prefix; 200.

While the engine sleeps, generation requests are refused with HTTP 503 and ``Retry-After`` (a
load balancer retries them elsewhere), naming the cause.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxpaged.engine_core.core_client import EngineCoreClient, EngineDeadError
from jaxpaged.entrypoints.openai.errors import error_response


def add_dev_routes(app: FastAPI, engine: EngineCoreClient) -> None:
    """Add the routes of the module docstring, each a utility call into the engine core."""

    @app.post("/sleep")
    async def sleep(raw_request: Request) -> Response:
        level = raw_request.query_params.get("level", "1")
        if level not in ("1", "2"):
            return error_response(400, f"level must be 1 or 2, got {level!r}", "level")
        return await _answer(engine.sleep(int(level)))

    @app.post("/wake_up")
    async def wake_up(raw_request: Request) -> Response:
        tags = raw_request.query_params.getlist("tags") or None
        return await _answer(engine.wake_up(tags))

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await engine.call_utility("reset_prefix_cache")
        return Response(status_code=200)


async def _answer(call) -> Response:
    """200 once ``call`` returns; its ``ValueError`` -> 400, an engine that is busy -> 409."""
    try:
        await call
    except ValueError as error:
        return error_response(400, str(error))
    except EngineDeadError:
        raise
    except RuntimeError as error:
        return error_response(409, str(error))
    return Response(status_code=200)
