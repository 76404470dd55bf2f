"""Which data-parallel engine gets a request (host only; no JAX).

Under ``--data-parallel-size N`` one API process feeds N engine cores, each with its own scheduler
and KV cache (docs/architecture.md, "The process boundary"). ``DPBalancer`` picks the core for every new request and keeps the
count of requests each core has not finished yet:

- ``"least_loaded"`` (default): the healthy engine with the fewest outstanding requests. Ties go
  round robin, starting after the engine chosen last, so that requests which finish before the
  next arrives still spread over every engine. (vLLM's ``DPLBAsyncMPClient`` ranks engines by
  ``4 * waiting + running`` as the engines last published them; counting outstanding requests
  in the API process needs no stats channel and is never stale.)
- ``"prefix"``: requests whose prompts share their first ``prefix_blocks`` full KV blocks go to
  the same engine, so the second one finds the first one's blocks in that engine's prefix cache.
  The key is the chained block hash of ``jaxpaged.core.prefix_cache`` (the one the prefix cache
  itself uses, LoRA name included as an extra key). The engine is chosen by rendezvous hashing
  (highest random weight, Thaler & Ravishankar 1998): every healthy engine scores
  ``sha256(key, engine index)`` and the highest wins, so when an engine dies only the keys it
  held move, each to its own runner-up, and they come back when it does. A prompt shorter than
  one full block has no key and is balanced by load. A shared system prompt longer than
  ``prefix_blocks`` blocks sends all its traffic to one engine; ``balance_threshold`` bounds
  that (SGLang's cache-aware router has the same guard).

Health: ``mark_dead`` takes an engine out of rotation and returns the ids of the requests it
held (the caller fails their streams); ``mark_alive`` puts it back. With every engine dead,
``choose`` raises ``NoHealthyEngineError``.

Wiring (the API process under ``--data-parallel-size N``): ``engine = add_request(request_id,
prompt_token_ids, extra_keys=seq.block_hash_extra_keys)`` before sending the request to core
``engine``; ``finish_request(request_id)`` on its final output or abort; when core i dies,
``mark_dead(i)``, fail the returned requests' streams and report core i on ``/health`` and in
metrics (the others keep serving); ``mark_alive(i)`` after a restart. Not thread-safe: call it
from one thread (the event loop).

Invariant (``check_invariants``): each outstanding request belongs to exactly one engine, and
each engine's count equals the number of requests assigned to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from jaxpaged.core.prefix_cache import BlockHash, hash_block_tokens

DP_ROUTING_CHOICES = ("least_loaded", "prefix")


class NoHealthyEngineError(RuntimeError):
    """Every data-parallel engine is dead; the server answers 503."""


class DPBalancer:
    """Routes requests over ``num_engines`` data-parallel engines.

    Args:
        num_engines: engine count N >= 1; engines are indexed 0..N-1.
        routing: ``"least_loaded"`` or ``"prefix"`` (see the module docstring).
        block_size: tokens per KV block (the engines' ``block_size``); prefix keys hash full
            blocks of this many tokens.
        prefix_blocks: how many leading full blocks make the prefix key, >= 1. Prompts that agree
            on these blocks share an engine; a larger value separates more families but only
            prompts at least that long get a key of that length (shorter ones use what they
            have).
        balance_threshold: with ``"prefix"`` routing, when the prefix engine has more than this
            many outstanding requests beyond the least loaded healthy engine, the request goes
            to the least loaded one instead. None: never (pure prefix affinity).

    Raises:
        ValueError: a bad ``num_engines``, ``routing``, ``block_size``, ``prefix_blocks`` or
            ``balance_threshold``.
    """

    def __init__(
        self,
        num_engines: int,
        *,
        routing: str = "least_loaded",
        block_size: int = 16,
        prefix_blocks: int = 1,
        balance_threshold: int | None = None,
    ):
        if num_engines < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_engines}")
        if routing not in DP_ROUTING_CHOICES:
            raise ValueError(f"dp_routing must be one of {DP_ROUTING_CHOICES}, got {routing!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be at least 1, got {prefix_blocks}")
        if balance_threshold is not None and balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0 or None, got {balance_threshold}")
        self.num_engines = num_engines
        self.routing = routing
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.balance_threshold = balance_threshold
        # Requests not finished yet, per engine: engine -> request ids; and the reverse map.
        self._assigned: list[set[str]] = [set() for _ in range(num_engines)]
        self._engine_of: dict[str, int] = {}
        self._healthy = [True] * num_engines
        self._last_choice = num_engines - 1  # so the first round-robin tie goes to engine 0
        # Requests routed to each engine since start-up (for metrics and tests).
        self.num_routed = [0] * num_engines

    # ------------------------------------------------------------------ state
    @property
    def num_outstanding(self) -> list[int]:
        """Per engine, requests routed to it and not finished yet."""
        return [len(ids) for ids in self._assigned]

    @property
    def healthy(self) -> list[bool]:
        """Per engine, whether it is in rotation."""
        return list(self._healthy)

    def engine_of(self, request_id: str) -> int | None:
        """The engine holding ``request_id``, or None if it is not outstanding."""
        return self._engine_of.get(request_id)

    # ------------------------------------------------------------------ routing
    def prefix_key(
        self, prompt_token_ids: Sequence[int], extra_keys: tuple = ()
    ) -> BlockHash | None:
        """The chained hash of the prompt's first ``min(prefix_blocks, full blocks)`` full
        blocks (``hash_block_tokens``, as the prefix cache computes it), or None when the prompt
        has no full block."""
        num_blocks = min(self.prefix_blocks, len(prompt_token_ids) // self.block_size)
        key = None
        for index in range(num_blocks):
            start = index * self.block_size
            key = hash_block_tokens(
                key, prompt_token_ids[start : start + self.block_size], extra_keys
            )
        return key

    def choose(self, prompt_token_ids: Sequence[int] = (), *, extra_keys: tuple = ()) -> int:
        """The engine for a request with this prompt; changes nothing (see ``add_request``).

        Raises:
            NoHealthyEngineError: every engine is dead.
        """
        healthy = [i for i in range(self.num_engines) if self._healthy[i]]
        if not healthy:
            raise NoHealthyEngineError(
                f"all {self.num_engines} data-parallel engines are dead; none can take requests"
            )
        least = self._least_loaded(healthy)
        if self.routing == "least_loaded":
            return least
        key = self.prefix_key(prompt_token_ids, extra_keys)
        if key is None:
            return least
        chosen = max(healthy, key=lambda engine: _rendezvous_score(key, engine))
        if self.balance_threshold is not None:
            load = self.num_outstanding
            if load[chosen] - load[least] > self.balance_threshold:
                return least
        return chosen

    def _least_loaded(self, healthy: list[int]) -> int:
        load = self.num_outstanding
        fewest = min(load[i] for i in healthy)
        # Round robin among the tied engines, starting after the last choice.
        for step in range(1, self.num_engines + 1):
            engine = (self._last_choice + step) % self.num_engines
            if self._healthy[engine] and load[engine] == fewest:
                return engine
        raise AssertionError("unreachable: a healthy engine has the fewest requests")

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int] = (), *, extra_keys: tuple = ()
    ) -> int:
        """Choose the engine for ``request_id`` and count it as outstanding there.

        Raises:
            ValueError: ``request_id`` is already outstanding.
            NoHealthyEngineError: every engine is dead.
        """
        if request_id in self._engine_of:
            raise ValueError(
                f"request_id {request_id!r} is already outstanding on engine "
                f"{self._engine_of[request_id]}"
            )
        engine = self.choose(prompt_token_ids, extra_keys=extra_keys)
        self._assigned[engine].add(request_id)
        self._engine_of[request_id] = engine
        self._last_choice = engine
        self.num_routed[engine] += 1
        return engine

    def finish_request(self, request_id: str) -> int | None:
        """Forget a finished or aborted request; returns its engine (None if unknown, e.g.
        already failed by ``mark_dead``), so finishing twice is harmless."""
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self._assigned[engine].discard(request_id)
        return engine

    # ------------------------------------------------------------------ health
    def mark_dead(self, engine: int) -> list[str]:
        """Take ``engine`` out of rotation; returns (sorted) and forgets the requests it held,
        which the caller must fail: their KV state died with the engine.

        Raises:
            ValueError: ``engine`` is not an index in [0, num_engines).
        """
        self._check_index(engine)
        self._healthy[engine] = False
        lost = sorted(self._assigned[engine])
        for request_id in lost:
            del self._engine_of[request_id]
        self._assigned[engine].clear()
        return lost

    def mark_alive(self, engine: int) -> None:
        """Put ``engine`` back into rotation (after a restart).

        Raises:
            ValueError: ``engine`` is not an index in [0, num_engines).
        """
        self._check_index(engine)
        self._healthy[engine] = True

    def _check_index(self, engine: int) -> None:
        if not 0 <= engine < self.num_engines:
            raise ValueError(f"engine must be in [0, {self.num_engines}), got {engine}")

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the assignment maps disagree (see the module docstring)."""
        seen: dict[str, int] = {}
        for engine, ids in enumerate(self._assigned):
            for request_id in ids:
                if request_id in seen:
                    raise RuntimeError(
                        f"{request_id=} is outstanding on engines {seen[request_id]} and {engine}"
                    )
                seen[request_id] = engine
            if ids and not self._healthy[engine]:
                raise RuntimeError(f"dead {engine=} still holds {len(ids)} requests")
        if seen != self._engine_of:
            raise RuntimeError(f"assignment maps disagree: {seen=} {self._engine_of=}")


def _rendezvous_score(key: BlockHash, engine: int) -> bytes:
    """Engine ``engine``'s weight for ``key`` (compared as bytes; uniform over engines)."""
    return hashlib.sha256(key + engine.to_bytes(4, "little")).digest()
