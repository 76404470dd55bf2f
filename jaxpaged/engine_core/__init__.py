"""The process boundary (vLLM v1's split): the engine-core process that steps an ``LLMEngine``
without pause, the API processes' clients of it, and the messages between them.

- ``core.py`` (the loop in the core process), ``admission.py`` (when it schedules the next step
  under async scheduling), ``request_trace.py`` (a core that records each request's life);
- ``core_messages.py`` (the msgpack protocol), ``core_process.py`` (starting and watching the
  process);
- ``core_client.py`` (an API process's client), ``client_outputs.py`` (token deltas ->
  ``RequestOutput``s with text and stop strings), ``dp_client.py`` and ``dp_balancer.py``
  (several cores behind one API process).

It drives ``jaxpaged.engine`` (the in-process step loop) and never the other way round: the loop
hands out token deltas (``engine/deltas.py``) and this package sends them.
"""
