"""A real jaxpaged server on loopback for the tests: uvicorn in a background thread, its engine
core in its own process (``jaxpaged/engine_core/core.py``), as ``jaxpaged serve`` runs them.

``tests/conftest.py`` builds one per session and worker (the ``server`` fixture). Its engine has
the same arguments as the session's ``stories_llm`` (the reference for greedy outputs) but is
its own engine, in its own process, so nothing is shared between the two paths. The core is a
``HookedEngineCore``: tests slow its steps, bound its queue or make it die through utility calls.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import os
import threading
import time

from jaxpaged.engine_core.core import EngineCore
from tests.conftest import SMALL_ENGINE

API_KEY = "test-key"
MODEL_NAME = "stories"
# stories260k has no chat template of its own; this one is simple enough to render by hand.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HOOKED_CORE = "tests.live_server:HookedEngineCore"


class HookedEngineCore(EngineCore):
    """An ``EngineCore`` with test controls, called by name from the API process."""

    UTILITY_METHODS = (
        *EngineCore.UTILITY_METHODS,
        "set_step_delay",
        "set_max_num_queued_requests",
        "die_when_unfinished",
        "pause_steps",
        "num_compilations",
        "gc_freeze_count",
        "set_grammar_compile_timeout",
        "num_compiling_grammars",
        "memory_use",
    )

    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self._delay = 0.0
        self._die_at: tuple[int, str] | None = None

    def set_step_delay(self, seconds: float) -> None:
        """Make each step last at least ``seconds``: step counts then measure reaction times
        well above the server's own latency."""
        self._delay = seconds

    def set_max_num_queued_requests(self, limit: int | None) -> None:
        self.max_num_queued_requests = limit

    def die_when_unfinished(self, count: int, message: str) -> None:
        """Raise ``RuntimeError(message)`` from the first step with ``count`` requests."""
        self._die_at = (count, message)

    def num_compilations(self) -> int:
        """Step executables the core's model runner has compiled so far."""
        return self.engine.worker.model_runner.num_compilations

    def gc_freeze_count(self) -> int:
        """Objects in the core process's permanent GC generation (``core.freeze_gc_heap``)."""
        return gc.get_freeze_count()

    def set_grammar_compile_timeout(self, seconds: float) -> float:
        """Set ``structured_outputs_config.grammar_compile_timeout_s`` (the manager reads it
        at each verdict); returns the previous value, for the caller to restore."""
        manager = self.engine.structured_output
        previous = manager.config.grammar_compile_timeout_s
        manager.config = dataclasses.replace(manager.config, grammar_compile_timeout_s=seconds)
        return previous

    def num_compiling_grammars(self) -> int:
        """Grammar compile jobs running now (abandoned ones included)."""
        return self.engine.structured_output.num_compiling

    def memory_use(self) -> dict:
        """The core process's ``memory_use()``."""
        return memory_use()

    def pause_steps(self) -> None:
        """From now on steps run no model: requests stay unfinished (and nothing compiles)."""
        self._die_at = (2**31, "")

    def step(self) -> list:
        if self._die_at is not None:
            count, message = self._die_at
            if self.engine.get_num_unfinished_requests() >= count:
                raise RuntimeError(message)
            time.sleep(0.001)
            return [[], self.get_stats() | {"scheduled": [], "step_start": time.monotonic()}]
        if self._delay:
            time.sleep(self._delay)
        return super().step()


def memory_use() -> dict:
    """This process's memory after a full collection, in bytes: ``rss`` (resident, once glibc's
    ``malloc_trim`` has handed free pages back), ``malloc_in_use`` (what malloc has handed out
    and not got back: ``mallinfo2``'s ``uordblks + hblkhd``; None where the C library has no
    ``mallinfo2``) and ``python_objects`` (objects the collector tracks, a count)."""
    import ctypes
    import ctypes.util

    gc.collect()
    in_use = None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        in_use = info.uordblks + info.hblkhd
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "malloc_in_use": in_use, "python_objects": len(gc.get_objects())}


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>, glibc 2.33+)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


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
        """The ``EngineCoreClient``."""
        return self.app.state.engine

    def call(self, name: str, *args, timeout: float = 30.0):
        """``EngineCore.<name>(*args)`` in the core process, from any thread."""
        coroutine = self.engine.call_utility(name, *args, timeout=timeout)
        return asyncio.run_coroutine_threadsafe(coroutine, self.engine.loop).result(timeout)

    def stats(self) -> dict:
        return self.call("get_stats")

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until the core has no unfinished request; returns its stats after checking the
        block pool's invariants."""
        deadline = time.monotonic() + timeout
        while self.stats()["num_unfinished_requests"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine core still has unfinished requests")
            time.sleep(0.005)
        return self.call("check_idle")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def spawn_client(**overrides):
    """A spawned ``EngineCoreClient`` on stories260k (float32, the session's small engine)."""
    from transformers import AutoTokenizer

    from jaxpaged.config import EngineArgs, default_model_path
    from jaxpaged.engine_core.core_client import EngineCoreClient

    client_kwargs = {
        key: overrides.pop(key)
        for key in ("heartbeat_timeout_s", "max_num_queued_requests", "core_class")
        if key in overrides
    }
    client_kwargs.setdefault("core_class", HOOKED_CORE)
    args = EngineArgs(**(dict(dtype="float32", **SMALL_ENGINE) | overrides))
    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    return EngineCoreClient.spawn(args, tokenizer=tokenizer, **client_kwargs)


def start_server(
    *,
    served_model_names=(MODEL_NAME,),
    api_key=None,
    chat_template=None,
    lora_modules=(),
    enable_auto_tool_choice=False,
    tool_call_parser=None,
    reasoning_parser=None,
    enable_dev_endpoints=False,
    app_options=None,
    **kw,
):
    """A ``RunningServer`` over a freshly spawned core (``spawn_client(**kw)``);
    ``app_options``: more ``ServeConfig`` fields (its on/off serving flags)."""
    from jaxpaged.config import default_model_path
    from jaxpaged.entrypoints.openai.api_server import build_app
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig

    config = ServeConfig(
        served_model_names=served_model_names,
        api_key=api_key,
        chat_template=chat_template,
        lora_modules=lora_modules,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_dev_endpoints=enable_dev_endpoints,
        **(app_options or {}),
    )
    client = spawn_client(**kw)
    app = build_app(
        client, config, model=kw.get("model") or default_model_path(), tokenizer=client.tokenizer
    )
    return RunningServer(app)


def start_test_server() -> RunningServer:
    """The shared server: two model names, an API key and the test chat template."""
    return start_server(
        served_model_names=[MODEL_NAME, "alias"], api_key=API_KEY, chat_template=CHAT_TEMPLATE
    )
