"""A real jaxpaged server on loopback (uvicorn in a background thread) for the tests.

``tests/conftest.py`` builds one per session and worker (the ``server`` fixture). Its engine has
the same arguments as the session's ``stories_llm`` (the reference for greedy outputs) but is
its own ``LLMEngine``, so nothing is shared between the two paths.
"""

from __future__ import annotations

import threading
import time

from tests.conftest import SMALL_ENGINE

API_KEY = "test-key"
MODEL_NAME = "stories"
# stories260k has no chat template of its own; this one is simple enough to render by hand.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class RunningServer:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def engine(self):
        """The ``AsyncLLMEngine``."""
        return self.app.state.engine

    @property
    def llm_engine(self):
        return self.app.state.engine.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has no unfinished request (aborts are applied between steps)."""
        deadline = time.monotonic() + timeout
        while self.llm_engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("the engine still has unfinished requests")
            time.sleep(0.005)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def make_engine(**overrides):
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    args = dict(dtype="float32", **SMALL_ENGINE) | overrides
    return LLMEngine.from_engine_args(EngineArgs(**args), show_progress=False)


def start_test_server() -> RunningServer:
    """The shared server: two model names, an API key and the test chat template."""
    from jaxpaged.entrypoints.openai.api_server import build_app

    app = build_app(
        make_engine(),
        served_model_names=[MODEL_NAME, "alias"],
        api_key=API_KEY,
        chat_template=CHAT_TEMPLATE,
    )
    return RunningServer(app)
