"""Rendering a client's chat template (the request's ``chat_template``) without trusting it.

A Jinja template is a program: ``{% for i in range(99999) %}{% for j in range(99999) %}`` is
150 bytes of CPU for hours, ``{{ "x" * 10**10 }}`` is 10 GB, and transformers'
``apply_chat_template`` runs either in the API process, holding its event loop. Here a client's
template runs in a separate worker process (this file run as a script: its imports are the
standard library and jinja2, nothing of jaxpaged), inside Jinja's
``ImmutableSandboxedEnvironment`` (no attribute escapes such as ``__class__``/``__globals__``,
no mutation of the inputs), with limits:

- time: the parent waits ``timeout_s`` for the answer, then kills the worker (and starts a new
  one on the next render);
- memory: the worker's address space is capped (``RLIMIT_AS``), so a blow-up fails there;
- output: rendering streams (``Template.generate``) and stops past ``max_output_chars``;
- ``range``: at most ``MAX_RANGE`` items (Jinja's own sandbox raises ``OverflowError``, a 500
  before this).

Every failure is a ``TemplateLimitError`` (a ``ValueError``: the server answers 400) naming the
limit. The template sees what transformers gives it: ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens and ``chat_template_kwargs``, with
transformers' helpers ``raise_exception``, ``strftime_now``, the ``tojson`` filter and the
``{% generation %}`` tag (``tokenization_utils_base.apply_chat_template``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

MAX_RANGE = 100_000
"""Most items a template's ``range()`` may produce."""
DEFAULT_TIMEOUT_S = 2.0
"""Wall-clock budget of one render, in seconds (transformers renders real templates in ms)."""
DEFAULT_MAX_OUTPUT_CHARS = 16 * 2**20
"""Longest rendered prompt, in characters (far beyond any context window's text)."""
WORKER_MEMORY_BYTES = 2 * 2**30
"""The worker's address-space cap."""
_STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter importing jinja2, on a loaded machine


class TemplateLimitError(ValueError):
    """A client's chat template failed, broke a limit or was refused; the message says which."""


class TemplateSandbox:
    """One worker process rendering client templates, one render at a time (thread-safe).

    Args:
        timeout_s: wall-clock budget of one render, > 0.
        max_output_chars: longest rendered text, >= 1.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._lock = threading.Lock()
        self._worker: subprocess.Popen | None = None
        self._pending = b""

    def render(self, template: str, context: dict) -> str:
        """``template`` rendered with ``context`` (JSON values) in the worker.

        Raises:
            TemplateLimitError: a template error, a limit broken (time, output, memory,
                range), or a context JSON cannot carry.
        """
        try:
            request = json.dumps({"template": template, "context": context}).encode() + b"\n"
        except (TypeError, ValueError) as error:
            raise TemplateLimitError(f"the chat template's inputs are not JSON: {error}") from None
        with self._lock:
            worker = self._start()
            deadline = time.monotonic() + self.timeout_s
            try:
                worker.stdin.write(request)
                worker.stdin.flush()
                line = self._read_line(worker, deadline)
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                timed_out = time.monotonic() >= deadline
                self._stop()
                if timed_out:
                    raise TemplateLimitError(
                        f"the chat template ran longer than its {self.timeout_s:g} s budget"
                    )
                raise TemplateLimitError(
                    "the chat template's worker died (it ran out of its "
                    f"{WORKER_MEMORY_BYTES // 2**30} GiB of memory)"
                )
        answer = json.loads(line)
        if "error" in answer:
            raise TemplateLimitError(answer["error"])
        return answer["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen:
        """The running worker, started (and waited for: its start is not the template's
        time) if there is none.

        Raises:
            TemplateLimitError: the worker did not start.
        """
        if self._worker is None or self._worker.poll() is not None:
            self._worker = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(self.max_output_chars)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            self._pending = b""
            ready = self._read_line(self._worker, time.monotonic() + _STARTUP_TIMEOUT_S)
            if ready is None:
                self._stop()
                raise TemplateLimitError("the chat-template worker process did not start")
        return self._worker

    def _stop(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker.wait()
            for pipe in (self._worker.stdin, self._worker.stdout):
                pipe.close()
            self._worker = None

    def _read_line(self, worker: subprocess.Popen, deadline: float) -> bytes | None:
        """One answer line, or None when the deadline passes or the worker dies."""
        fd = worker.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line


# ------------------------------------------------------------------ the worker (a script)
def _worker_main(max_output_chars: int) -> None:  # pragma: no cover - runs in the worker
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    environment = _environment()
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            answer = {"text": _render(environment, request, max_output_chars)}
        except MemoryError:
            answer = {"error": "the chat template ran out of memory"}
        except Exception as error:  # noqa: BLE001 - every failure is the client's template's
            answer = {"error": f"the chat template failed: {type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def _render(environment, request: dict, max_output_chars: int) -> str:
    template = environment.from_string(request["template"])
    parts, size = [], 0
    for part in template.generate(**request["context"]):
        size += len(part)
        if size > max_output_chars:
            raise ValueError(f"its output passed {max_output_chars} characters")
        parts.append(part)
    return "".join(parts)


def _environment():
    """transformers' chat-template environment, with ``range`` capped."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks
        assistant tokens with it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    def capped_range(*args):
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise ValueError(f"range() of {len(items)} items; the limit is {MAX_RANGE}")
        return items

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, range=capped_range
    )
    return environment


if __name__ == "__main__":  # pragma: no cover - the worker process
    _worker_main(int(sys.argv[1]))
