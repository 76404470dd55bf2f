"""Speculative decoding: propose several tokens cheaply, verify them in one target forward.

One job per module:

- ``config.py``: ``SpeculativeConfig`` (the engine's ``speculative_config``, vLLM's keys),
  parsed and checked once against the target model (host only, no JAX).
- ``rejection_sampler.py``: accept / recover / bonus over a padded ``[B, K]`` batch of drafts
  (Leviathan et al. 2023; greedy rows accept while the draft is the target's argmax), pure
  jittable JAX that reuses ``jaxpaged.sample``'s logit processing.
- ``ngram_proposer.py``: prompt lookup over each sequence's token history on the device, with a
  numpy reference.
- ``metrics.py``: ``SpecDecodingStats`` (vLLM's counters) and the acceptance log line (host only).

How these plug into the step pipeline: ``docs/spec_decode.md``. Importing this package imports
nothing else, so the host-only modules stay free of JAX.
"""
