"""Data parallelism behind one API process: N engine cores, one ``DPBalancer`` choosing among them.

``jaxpaged serve --data-parallel-size N`` starts N engine-core processes (``EngineCoreClient``
each: its own scheduler, KV cache and device group) and serves them through ``DPEngineCoreClient``,
which has the client's interface (``add_request``, ``abort``, ``call_utility``, ``start``,
``shutdown``, ``is_dead``, ``info``), so the routes need not know how many cores there are.

- Routing: ``DPBalancer`` (``jaxpaged/engine_core/dp_balancer.py``): least outstanding requests, or
  ``--dp-routing prefix`` (the hash of the prompt's first full blocks picks a stable core).
- Devices: core ``i`` uses the GPUs ``[i * tp, (i + 1) * tp)`` of those the process sees (JAX's
  ``jax_cuda_visible_devices``, set in the core before its backend starts); on CPU every core
  has its own host device.
- Failure: a core that dies is taken out of rotation (its open streams end with an error, as
  with one core); the others keep serving. ``is_dead`` (``/health`` 503) only once every core
  is dead; ``engine_health`` says which are alive.
- Metrics: one ``ServerMetrics`` per core (``engine`` label = index), rendered together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxpaged.engine_core.core_client import EngineCoreClient, EngineDeadError, RequestStream
from jaxpaged.engine_core.dp_balancer import DPBalancer, NoHealthyEngineError
from jaxpaged.metrics import ServerMetrics
from jaxpaged.sampling_params import SamplingParams


def device_group(index: int, group_size: int) -> str:
    """The GPUs of data-parallel engine ``index``: ``"i*g,...,i*g+g-1"`` (indices into the
    devices the API process sees), for ``run_engine_core``'s ``cuda_visible_devices``."""
    return ",".join(str(d) for d in range(index * group_size, (index + 1) * group_size))


class DPEngineCoreClient:
    """``EngineCoreClient``'s interface over several cores (see the module docstring).

    Args:
        clients: the started cores' clients, index = engine index.
        balancer: routes over ``len(clients)`` engines.
    """

    def __init__(self, clients: Sequence[EngineCoreClient], balancer: DPBalancer):
        if len(clients) != balancer.num_engines:
            raise ValueError(f"{len(clients)} clients for {balancer.num_engines} engines")
        self.clients = list(clients)
        self.balancer = balancer
        for client in self.clients:
            client.on_forget = self._finished

    @classmethod
    def spawn(
        cls,
        engine_args,
        *,
        data_parallel_size: int,
        dp_routing: str = "least_loaded",
        spawn_one: Callable[..., EngineCoreClient] = EngineCoreClient.spawn,
        **kwargs,
    ) -> DPEngineCoreClient:
        """Start ``data_parallel_size`` cores of ``engine_args``, each on its device group.

        ``kwargs`` go to ``EngineCoreClient.spawn`` (tokenizer, queue bound, ...).

        Raises:
            ValueError: ``data_parallel_size`` < 1 or a bad ``dp_routing``.
            RuntimeError: a core failed to start (the started ones are stopped).
        """
        balancer = DPBalancer(
            data_parallel_size, routing=dp_routing, block_size=engine_args.block_size
        )
        tp = engine_args.tensor_parallel_size
        clients: list[EngineCoreClient] = []
        try:
            for index in range(data_parallel_size):
                clients.append(
                    spawn_one(engine_args, cuda_visible_devices=device_group(index, tp), **kwargs)
                )
        except BaseException:
            for client in clients:
                client.core.process.kill()
            raise
        return cls(clients, balancer)

    # ----------------------------------------------------------------------- client interface
    def attach_metrics(self, make_metrics: Callable[[int], ServerMetrics]) -> list[ServerMetrics]:
        """One ``make_metrics(index)`` per core, fed from that core's steps."""
        return [
            client.attach_metrics(lambda _, i=i: make_metrics(i))[0]
            for i, client in enumerate(self.clients)
        ]

    @property
    def info(self) -> dict:
        return self.clients[0].info

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    @property
    def is_dead(self) -> bool:
        """True once every core is dead."""
        return all(client.is_dead for client in self.clients)

    @property
    def dead_error(self) -> str | None:
        errors = [client.dead_error for client in self.clients]
        return (
            None if None in errors else "; ".join(f"engine {i}: {e}" for i, e in enumerate(errors))
        )

    def engine_health(self) -> list[bool]:
        """Per engine index: alive."""
        self._sync_health()
        return [not client.is_dead for client in self.clients]

    async def start(self) -> None:
        for client in self.clients:
            await client.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        for client in self.clients:
            await client.shutdown(timeout)

    async def add_request(
        self,
        request_id: str,
        prompt: dict,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        **kwargs,
    ) -> RequestStream:
        """Route the request to a core (``DPBalancer``) and add it there.

        Raises:
            EngineDeadError: every core is dead.
            ValueError / QueueFullError: as ``EngineCoreClient.add_request``.
        """
        self._sync_health()
        try:
            engine = self.balancer.add_request(request_id, prompt["prompt_token_ids"])
        except NoHealthyEngineError as error:
            raise EngineDeadError(f"every engine core has died: {self.dead_error}") from error
        try:
            return await self.clients[engine].add_request(
                request_id, prompt, params, arrival_time=arrival_time, **kwargs
            )
        except BaseException:
            self.balancer.finish_request(request_id)
            raise

    def abort(self, request_id: str) -> None:
        engine = self.balancer.engine_of(request_id)
        if engine is not None:
            self.clients[engine].abort(request_id)

    async def call_utility(self, name: str, *args, timeout: float = 30.0) -> list:
        """``EngineCore.<name>(*args)`` in every live core; their results, by engine index
        (None for a dead core)."""
        results = []
        for client in self.clients:
            results.append(
                None if client.is_dead else await client.call_utility(name, *args, timeout=timeout)
            )
        return results

    async def add_lora(self, lora_request) -> bool:
        """Load the adapter in every live core (any core may serve its requests).

        Raises:
            ValueError: a core refused the adapter (bad path, rank, target modules).
        """
        results = [await c.add_lora(lora_request) for c in self.clients if not c.is_dead]
        return all(results)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload the adapter from every live core; True if one of them had it."""
        results = [await c.remove_lora(lora_int_id) for c in self.clients if not c.is_dead]
        return any(results)

    async def list_loras(self) -> set[int]:
        """Adapter ids loaded in the live cores."""
        loaded: set[int] = set()
        for client in self.clients:
            if not client.is_dead:
                loaded |= await client.list_loras()
        return loaded

    # ------------------------------------------------------------------------------ internal
    def _finished(self, request_id: str) -> None:
        self.balancer.finish_request(request_id)

    def _sync_health(self) -> None:
        for index, client in enumerate(self.clients):
            if client.is_dead and self.balancer.healthy[index]:
                self.balancer.mark_dead(index)
