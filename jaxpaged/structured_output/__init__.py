"""Structured outputs (constrained decoding): grammars compiled on the host, applied on the device.

One job per module:

- ``params.py``: ``StructuredOutputsParams``, one request's constraint, checked when it is made
  (vLLM's; ``jaxpaged.sampling_params`` and ``jaxpaged`` give it too).
- ``config.py``: ``StructuredOutputsConfig`` (the engine's ``structured_outputs_config``:
  backend, defaults, budgets).
- ``backend.py`` / ``backend_guidance.py``: the grammar library (xgrammar / llguidance): checks
  a request's constraint, compiles it against the tokenizer, makes per-sequence matchers and
  fills a step's bitmask rows on its own threads; ``backend_base.py`` what they share (the
  probe of a compiled grammar's first steps, error text).
- ``admission.py``: the budgets checked when a request is added, and the compile job.
- ``compiler.py``: compile workers off the engine thread (lower priority, time budget,
  abandonment) and the byte-bounded cache by the constraint's key.
- ``request_state.py``: one sequence's matcher, kept in step with its committed output tokens.
- ``bitmask.py``: the packed int32 token bitmask ``[B, ceil(vocab_size / 32)]`` filled on the
  host, and the on-device masking of the logits.
- ``manager.py``: what the engine calls: add / admit (wait, or hold until compiled) / fill the
  step's bitmask / commit / free.

How the engine uses them (synchronous, asynchronous and split steps): docs/structured_outputs.md.

Nothing here imports JAX except ``bitmask.apply_token_bitmask`` (imported lazily by the
sampler), so the engine core's host logic stays JAX-free.
"""
