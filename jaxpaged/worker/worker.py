"""``Worker``: the one object that owns the device(s) (vLLM's engine -> worker -> model runner).

Start-up, in vLLM's order (``vllm/v1/worker/gpu_worker.py``: ``load_model``,
``determine_available_memory``, ``initialize_from_config``, ``compile_or_warm_up_model``):

1. ``Worker(config)``: joins the other processes (multi-host), builds the ``("tp",)`` mesh and
   resolves the attention backend.
2. ``load_model()``: weights (or dummies) onto the device(s); the KV cache's geometry follows.
3. ``determine_num_blocks()``: profiles one step at the full token budget and sizes the KV cache
   (docs/architecture.md, "KV cache sizing"), or takes the forced count / byte budget of the config.
4. ``initialize_cache(num_blocks)``: builds the ``ModelRunner``, compiles every step bucket
   against the cache's shapes (before allocating it, so XLA's autotuner sees the memory the
   cache will take), allocates the cache and the host swap space (``BlockMover``).

Then, per step, the engine hands it a ``SchedulerOutput``: ``execute_block_ops`` (swaps and
copy-on-write), ``prepare``, ``launch`` of each segment of the step's device stages, ``collect``
(``engine/step_pipeline.py`` decides the segments and when to collect). Nothing outside the
worker writes the runner's fields.
"""

from __future__ import annotations

import functools
import gc
import logging
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpaged.config import EngineConfig
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.lora.manager import LoRAManager, create_lora_manager
from jaxpaged.worker.compilation_cache import CompileCounter, enable_compilation_cache
from jaxpaged.worker.distributed import agree_on_min, initialize_distributed, is_driver
from jaxpaged.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    MemoryBudget,
    allocate_kv_caches,
    bytes_in_use,
    kv_cache_shapes,
    measure_kv_budget,
    num_blocks_for_budget,
)
from jaxpaged.worker.kv_size_memo import memo_key, remembered_num_blocks
from jaxpaged.worker.memory_pool import configure_memory_pool
from jaxpaged.worker.model_runner import DeviceStep, ModelRunner
from jaxpaged.worker.step_output import ModelRunnerOutput
from jaxpaged.worker.step_program import WHOLE
from jaxpaged.worker.step_timeline import StepTimeline
from jaxpaged.worker.swap import BlockMover
from jaxpaged.worker.weight_update import update_device_weights
from models.attention import kv_cache_head_dim
from models.attention_backends import resolve_attention_backend
from models.kv_scales import attach_kv_scales, read_kv_scales
from models.linear_backends import step_compiler_options
from models.orbax_checkpoint import is_orbax_checkpoint, load_orbax_model
from models.platform import target_platform
from models.quantized_weights import quantized_weight_bytes
from models.registry import checkpoint_view
from models.sharded_weights import load_sharded_model
from models.sharding import kv_cache_sharding, make_mesh
from models.tp_layout import TPLayout
from models.weights import float_weights_checksum, load_model, resolve_dtype
from pallas_kernels.fp8_kv_cache import kv_cache_fp8_dtype

logger = logging.getLogger(__name__)

# Block counts are int32 ids on the device.
_MAX_NUM_BLOCKS = 2**31 - 1


class Worker:
    """Owns the mesh, the model's weights, the KV cache (device and host swap space) and the
    ``ModelRunner`` that steps on them.

    Args:
        config: the validated engine configuration (``EngineArgs.create_engine_config()``).
        show_progress: show the bucket-compilation progress bar (process 0 only).
        platform: the platform the model and its steps are built for (``"gpu"``: compiled
            Pallas kernels); None: ``models.platform.target_platform()``, where they run. A
            worker built for another platform than the host's can only lower its steps
            (``abstract_runner``), as ``tests/gpu_lowering`` does for a GPU on a CPU host.
    """

    def __init__(
        self, config: EngineConfig, *, show_progress: bool = True, platform: str | None = None
    ):
        self.config = config
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size
        # JAX's GPU pool from gpu_memory_utilization: before any device is touched.
        configure_memory_pool(config.cache_config.gpu_memory_utilization)
        initialize_distributed(config.parallel_config)  # before any device is touched
        # Directory of JAX's persistent compilation cache (None: off): restarts compile nothing.
        self.compilation_cache_dir = (
            enable_compilation_cache(config.compilation_cache_dir)
            if config.enable_compilation_cache
            else None
        )
        tp = self.tensor_parallel_size
        self.mesh = make_mesh(tp) if tp > 1 else None
        self._kv_sharding = None if self.mesh is None else kv_cache_sharding(self.mesh)
        self.show_progress = show_progress and is_driver()
        self.platform = platform or target_platform()
        # "auto": Pallas kernels on GPU, the plain-JAX references elsewhere.
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.platform)
        # Set by load_model:
        self.hf_config = None
        self.dtype = None
        self.kv_cache_spec: KVCacheSpec | None = None
        # kv_cache_dtype="fp8": the per-layer (k_scale, v_scale) in use; None for a float cache.
        self.kv_scales: list[tuple[float, float]] | None = None
        self._model = None
        # Multi-LoRA: adapter slots on the device and the host LRU (None: LoRA off); every
        # runner the worker builds (the profiling one too) steps with its slot weights.
        self.lora_manager: LoRAManager | None = None
        # Set by determine_num_blocks (None without device memory statistics, e.g. on CPU):
        self.memory_budget: MemoryBudget | None = None
        # Set by initialize_cache:
        self.num_gpu_blocks = 0
        self.num_cpu_blocks = 0
        self.model_runner: ModelRunner | None = None
        self.block_mover: BlockMover | None = None
        # Seconds spent compiling step buckets at start-up (0 with lazy compilation).
        self.compile_seconds = 0.0
        # Start-up's step executables: got from the persistent cache, compiled, and left to
        # the background thread (a warm start; ``_get_executables``).
        self.executables_loaded = 0
        self.executables_compiled = 0
        self.executables_deferred = 0
        # Seconds allocating the device KV cache and the host swap space.
        self.kv_allocation_seconds = 0.0

    # ----------------------------------------------------------------------------- start-up
    def load_model(self, hf_config=None) -> None:
        """Load the weights (``load_format``) onto the device(s), sharded over the mesh.

        ``hf_config``: the model's config when the engine already read it
        (``models.weights.load_config``); None: the loader reads it.

        Raises:
            ValueError: from ``models.weights.load_model`` (missing files, unknown dtype,
                unsupported architecture, a missing or misshapen tensor); ``enable_lora`` with
                a model class that does not support LoRA; incomplete or bad FP8 KV scales in the
                checkpoint (``models.kv_scales.read_kv_scales``).
        """
        mc = self.config.model_config
        load = (
            load_model
            if self.mesh is None
            else functools.partial(load_sharded_model, mesh=self.mesh)
        )
        if mc.load_format != "dummy" and is_orbax_checkpoint(mc.model):  # `jaxpaged convert`
            load = functools.partial(load_orbax_model, mesh=self.mesh)
        load = functools.partial(load, quant_config=mc.quant_config, hf_config=hf_config)
        self._model, self.hf_config = load(
            mc.model,
            dtype=mc.dtype,
            load_format=mc.load_format,
            attention_backend=self.attention_backend,
            interpret=self.attention_backend == "pallas" and self.platform != "gpu",
            seed=mc.seed,
        )
        self.dtype = resolve_dtype(mc.dtype, self.hf_config)
        kv_dtype = self._load_kv_cache_dtype()  # FP8: attaches the per-layer scales
        self.kv_cache_spec = KVCacheSpec(
            num_layers=int(self.hf_config.num_hidden_layers),
            # Hkv * r when tensor parallelism repeats KV heads (models.sharding)
            num_kv_heads=TPLayout.from_hf_config(
                self.hf_config, self.tensor_parallel_size
            ).num_kv_heads_physical,
            # Pallas pads a head dim that is not a power of two (Phi-3's 96 -> 128).
            head_dim=kv_cache_head_dim(_head_dim(self.hf_config), self.attention_backend),
            block_size=self.config.cache_config.block_size,
            dtype=kv_dtype,
        )
        # The slots are allocated here, before profiling, so they count as weights.
        self.lora_manager = create_lora_manager(
            self.config.lora_config, self._model, self.hf_config, self.dtype, self.mesh
        )

    def _load_kv_cache_dtype(self):
        """The cache's element dtype: the compute dtype (``kv_cache_dtype="auto"``), or FP8,
        whose per-layer ``k_scale`` / ``v_scale`` (the checkpoint's, else 1.0) are attached to
        the model's attention modules here (``models.kv_scales``).

        Raises:
            ValueError: from ``read_kv_scales`` (a checkpoint with incomplete or bad scales).
        """
        mc, cache_dtype = self.config.model_config, self.config.cache_config.cache_dtype
        if cache_dtype == "auto":
            return self.dtype
        num_layers = int(self.hf_config.num_hidden_layers)
        scales = None if mc.load_format == "dummy" else read_kv_scales(mc.model, num_layers)
        if scales is None:
            logger.warning(
                "kv_cache_dtype=%s without k_scale/v_scale in the checkpoint: using 1.0 (values "
                "beyond the format's range saturate)", cache_dtype,
            )  # fmt: skip
            scales = [(1.0, 1.0)] * num_layers
        sharding = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        attach_kv_scales(self._model, scales, sharding=sharding)
        self.kv_scales = scales
        return kv_cache_fp8_dtype(cache_dtype)

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (the checkpoint's ``vocab_size``); valid after ``load_model``."""
        return int(self.hf_config.vocab_size)

    def determine_num_blocks(self) -> int:
        """Device KV blocks for this engine: ``num_gpu_blocks_override``, else what
        ``kv_cache_memory_bytes`` holds, else what profiling leaves under
        ``gpu_memory_utilization`` (CPU, which reports no memory statistics: a fixed budget,
        capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use). Every
        process of a multi-host engine returns the same count (the smallest).

        Raises:
            ValueError: not even one block fits the budget.
        """
        cc, sc = self.config.cache_config, self.config.scheduler_config
        spec, tp = self.kv_cache_spec, self.tensor_parallel_size
        # Budgets are per device; the cache splits evenly over the tp devices.
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = num_blocks_for_budget(
                spec, cc.kv_cache_memory_bytes * tp, cap=_MAX_NUM_BLOCKS
            )
        else:
            self.memory_budget = self._profile_memory()
            if self.memory_budget is None:
                max_blocks_per_seq = -(-sc.max_model_len // cc.block_size)
                cap = sc.max_num_seqs * max_blocks_per_seq + 1
                num_blocks = num_blocks_for_budget(spec, DEFAULT_CPU_KV_CACHE_BYTES * tp, cap=cap)
            else:
                per_device = self.memory_budget.kv_bytes
                num_blocks = num_blocks_for_budget(spec, per_device * tp, cap=_MAX_NUM_BLOCKS)
                if self.compilation_cache_dir is not None:
                    # Same count as the last start when it still fits: its executables match.
                    num_blocks = remembered_num_blocks(
                        self.compilation_cache_dir, self._kv_size_key(), num_blocks
                    )
        # Every process must hold the same number of blocks, or their schedules diverge.
        return agree_on_min(num_blocks)

    def _kv_size_key(self) -> str:
        """What decides the step's shapes and the profiled budget (``kv_size_memo``)."""
        mc, cc = self.config.model_config, self.config.cache_config
        return memo_key(
            hf_config=mc.hf_config_json,
            load_format=mc.load_format,
            quantization=str(mc.quant_config),
            dtype=str(self.dtype),
            spec=str(self.kv_cache_spec),
            scheduler=str(self.config.scheduler_config),
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=cc.gpu_memory_utilization,
            attention_backend=self.attention_backend,
            kv_cache_dtype=str(jnp.dtype(self.kv_cache_spec.dtype)),
        )

    def _profile_memory(self) -> MemoryBudget | None:
        """Per-device memory left for KV blocks after one profiling step at the full token
        budget (vLLM's rule), or None when the device reports no memory statistics (CPU). With
        tensor parallelism the tightest of this process's mesh devices sets the budget."""
        devices = (
            [jax.local_devices()[0]]
            if self.mesh is None
            else [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        )
        weights = [bytes_in_use(d) for d in devices]
        if weights[0] is None:
            return None
        spec = self.kv_cache_spec
        sc = self.config.scheduler_config
        probe_blocks = -(-sc.max_num_batched_tokens // spec.block_size) + 1
        probe_caches = allocate_kv_caches(spec, probe_blocks, sharding=self._kv_sharding)
        probe = self._make_runner(probe_caches)
        probe.profile_run()
        # The probe runner sits in reference cycles (its executable table holds its bound
        # compile method), so ``del`` alone leaves its caches and its LogitsState (1.3 GB at
        # max_num_seqs 1024 and a 128k vocabulary) alive until some later cyclic collection:
        # possibly after the KV cache is allocated, taking memory the budget gave to the cache.
        del probe, probe_caches
        gc.collect()
        utilization = self.config.cache_config.gpu_memory_utilization
        budgets = [
            measure_kv_budget(utilization, d, weights_bytes=w)
            for d, w in zip(devices, weights, strict=True)
        ]
        return min(budgets, key=lambda budget: budget.kv_bytes)

    def initialize_cache(self, num_blocks: int) -> None:
        """Build the model runner over ``num_blocks`` device blocks, compile its buckets (unless
        ``enforce_eager``; default: eager off GPU, where XLA:CPU takes seconds per bucket and
        runs are short), then allocate the cache and ``swap_space`` of host blocks."""
        spec = self.kv_cache_spec
        self.num_gpu_blocks = num_blocks
        self.num_cpu_blocks = self.config.cache_config.swap_space_bytes // spec.bytes_per_block
        enforce_eager = self.config.enforce_eager
        if enforce_eager is None:
            enforce_eager = self.platform != "gpu"
        # Buckets compile against the cache's shapes before it is allocated, so that XLA's
        # autotuning scratch and rematerialization limit see the memory the cache will take.
        self.model_runner = self._make_runner(
            kv_cache_shapes(spec, num_blocks, sharding=self._kv_sharding)
        )
        compile_start = time.perf_counter()
        if not enforce_eager:
            self._get_executables()
        self.compile_seconds = time.perf_counter() - compile_start
        allocation_start = time.perf_counter()
        self.reset_kv_caches()
        self.block_mover = BlockMover(spec, self.num_cpu_blocks, cache_sharding=self._kv_sharding)
        self.kv_allocation_seconds = time.perf_counter() - allocation_start
        if is_driver():  # the start-up report: KV size and dtype (and quantized weights' savings)
            logger.info("%s", self.kv_cache_report())

    def _get_executables(self) -> None:
        """Every step bucket's executable, compiled now or (a warm start) partly later.

        With the persistent compilation cache on (one process), the first steps' buckets
        (``ModelRunner.first_step_keys``) come first; if all of them were cache hits, the cache
        is taken as warm and the other buckets load on a background thread while the engine
        serves (a step whose bucket is not there yet waits for it or gets it itself). Otherwise
        (a cold cache, the cache off, several processes) every bucket compiles now, before the
        cache is allocated, as the XLA autotuner needs the room.
        """
        runner = self.model_runner
        keys = runner.all_bucket_keys()
        first = runner.first_step_keys() if self.compilation_cache_dir is not None else []
        if jax.process_count() > 1:  # each process must compile the same buckets in step
            first = []
        with CompileCounter() as counter:
            if first:
                runner.compile_all(show_progress=False, keys=first)
            warm = bool(first) and counter.compiled == 0
            if warm:
                rest = [key for key in keys if key not in first]
                runner.load_in_background(rest)
                self.executables_deferred = len(rest)
            else:
                runner.compile_all(show_progress=self.show_progress)
        self.executables_loaded = counter.cache_hits
        self.executables_compiled = counter.compiled

    def wait_for_executables(self) -> None:
        """Return once every step bucket of start-up is there (a warm start loads some in the
        background; benchmarks wait before timing)."""
        if self.model_runner is not None:
            self.model_runner.wait_for_executables()

    def abstract_runner(self, num_blocks: int) -> ModelRunner:
        """A model runner over a KV cache of ``num_blocks`` blocks that is never allocated (its
        shapes only): its steps can be lowered (``ModelRunner.lower``), not run. Needs
        ``load_model`` first."""
        return self._make_runner(kv_cache_shapes(self.kv_cache_spec, num_blocks))

    def _make_runner(self, kv_caches: list) -> ModelRunner:
        sc = self.config.scheduler_config
        return ModelRunner(
            self._model,
            kv_caches,
            block_size=self.config.cache_config.block_size,
            max_model_len=sc.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            mesh=self.mesh,
            vocab_size=self.vocab_size,
            max_logprobs=self.config.model_config.max_logprobs,
            lora_manager=self.lora_manager,
            compiler_options=step_compiler_options(
                self.config.model_config.quant_config, self.platform
            ),
        )

    def reset_kv_caches(self, fill_value: float = 0.0) -> None:
        """Allocate a fresh device cache filled with ``fill_value`` (tests pass NaN to prove
        that no kernel reads a stale slot); every block's K/V is lost, so the caller must also
        forget cached prefixes (``KVCacheManager.reset_prefix_cache``)."""
        caches = allocate_kv_caches(
            self.kv_cache_spec,
            self.num_gpu_blocks,
            fill_value=fill_value,
            sharding=self._kv_sharding,
        )
        self.model_runner.set_kv_caches(caches)

    def kv_cache_report(self) -> str:
        """One line: the KV element dtype, blocks, tokens and GiB, and (after profiling) their
        share of the memory left after weights and activations (per device)."""
        block_size = self.config.cache_config.block_size
        num_blocks = self.num_gpu_blocks
        kv_bytes = num_blocks * self.kv_cache_spec.bytes_per_block // self.tensor_parallel_size
        line = (
            f"KV cache: {kv_bytes / 2**30:.2f} GiB per device, {num_blocks} blocks of "
            f"{block_size} tokens = {num_blocks * block_size} tokens in "
            f"{jnp.dtype(self.kv_cache_spec.dtype).name}"
        )
        budget = self.memory_budget
        if budget is not None:
            left = budget.left_after_weights_and_activations
            line += (
                f"; device {budget.total / 2**30:.1f} GiB, gpu_memory_utilization "
                f"{self.config.cache_config.gpu_memory_utilization} -> usable "
                f"{budget.usable / 2**30:.2f} GiB (JAX pool {budget.pool / 2**30:.2f} GiB), "
                f"weights {budget.weights / 2**30:.2f} GiB, peak after profiling "
                f"{budget.peak / 2**30:.2f} GiB, left {left / 2**30:.2f} GiB, of which the KV "
                f"cache takes {100 * kv_bytes / max(left, 1):.1f}%"
            )
        return line + self._quantized_weights_report()

    def _quantized_weights_report(self) -> str:
        """``"; weights ..."``: the quantized layers' bytes per device against the same layers
        in the compute dtype, and the KV blocks the difference holds; empty when unquantized."""
        quant_config = self.config.model_config.quant_config
        if quant_config is None:
            return ""
        stored, unquantized = quantized_weight_bytes(self.model_runner.weights.model())
        tp = self.tensor_parallel_size
        freed = (unquantized - stored) // tp
        blocks = freed * tp // self.kv_cache_spec.bytes_per_block
        return (
            f"; quantization {quant_config.method}: quantized layer weights "
            f"{stored / tp / 2**20:.2f} MiB per device vs {unquantized / tp / 2**20:.2f} MiB in "
            f"{self.dtype.name}, freeing {freed / 2**20:.2f} MiB = {blocks} KV blocks"
        )

    def weights_checksum(self) -> tuple[float, int]:
        """``(sum of |x|, non-zero count)`` of the floating-point weights and LoRA slots
        (``models.weights.float_weights_checksum``): equal for engines holding the same
        weights, whatever their layout. After ``update_weights`` (which releases the loaded
        module) it reads the runner's arrays.

        Raises:
            RuntimeError: the weights were released by ``sleep(level=2)``.
        """
        slots = () if self.lora_manager is None else (self.lora_manager.slots.weights,)
        model = self._model if self._model is not None else self.get_weights()
        return float_weights_checksum(model, *slots)

    # ------------------------------------------------------- weights from memory, sleep mode
    def get_weights(self) -> dict:
        """The weights the steps run on, in the model's own nested layout (a pure dict of the
        engine's arrays, not copies; ``update_weights`` takes the same structure back).

        Raises:
            RuntimeError: the weights were released by ``sleep(level=2)``.
        """
        if not self.model_runner.weights.complete:
            raise RuntimeError(
                "the weights were released by sleep(level=2); update_weights() restores them"
            )
        return self.model_runner.weights.nested()

    def update_weights(self, params, *, on_leaf=None) -> int:
        """Place ``params`` (``{HF name: array}`` or our own layout) into the steps' weights,
        leaf by leaf with the old arrays released as it goes (``worker/weight_update.py``);
        returns the number of weights replaced. Works while asleep (after ``sleep(level=2)``
        it is how the weights come back).

        Raises:
            ValueError: bad ``params`` (named; nothing replaced), a quantized model or LoRA
                (their weights have other layouts).
        """
        mc = self.config.model_config
        if mc.quant_config is not None or self.lora_manager is not None:
            what = "quantization" if mc.quant_config is not None else "enable_lora"
            raise ValueError(f"update_weights is not supported with {what} yet")
        self._release_model()  # its variables hold the old arrays: they must be freed as we go
        replaced = update_device_weights(
            self.model_runner.weights,
            params,
            hf_config=self.hf_config,
            dtype=self.dtype,
            view=checkpoint_view(self.hf_config),
            tensor_parallel_size=self.tensor_parallel_size,
            on_leaf=on_leaf,
        )
        return replaced

    def _release_model(self) -> None:
        """Forget the loaded module (the runner steps on its own split of it): its variables
        sit in reference cycles, so its arrays go only with a cyclic collection, done here
        once rather than whenever the collector runs."""
        if self._model is not None:
            self._model = None
            gc.collect()

    def sleep(self, level: int) -> None:
        """Free device memory (vLLM's sleep mode): level 1 the KV cache, level 2 also the
        weights (the engine's references; arrays a trainer shares stay valid). The compiled
        step executables are kept. ``wake_up`` re-allocates the cache at its shapes.

        Raises:
            ValueError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.model_runner.release_kv_caches()
        if level == 2:
            self._release_model()
            self.model_runner.weights.release_all()

    @property
    def has_weights(self) -> bool:
        """Whether the weights are there (False after ``sleep(level=2)`` until an update)."""
        return self.model_runner.weights.complete

    def wake_up(self) -> None:
        """Re-allocate the KV cache at the shapes the steps were compiled for (its contents
        are gone: the caller forgets cached prefixes)."""
        if not self.model_runner.has_kv_caches:
            self.reset_kv_caches()

    def set_step_timeline(self, timeline: StepTimeline | None) -> None:
        """Time every dispatched step on the device (benchmarks); None stops."""
        self.model_runner.timeline = timeline

    # ----------------------------------------------------------------------------- per step
    def execute_block_ops(self, scheduler_output: SchedulerOutput) -> None:
        """Swap-out, swap-in and copy-on-write block moves of the step, in that order."""
        self.model_runner.execute_block_ops(scheduler_output, self.block_mover)

    def execute_model(
        self, scheduler_output: SchedulerOutput, fill_bitmask=None
    ) -> ModelRunnerOutput:
        """Run one step whole and wait for its outputs (``ModelRunner.execute_model``)."""
        return self.model_runner.execute_model(scheduler_output, fill_bitmask)

    def prepare(
        self,
        scheduler_output: SchedulerOutput,
        *,
        structured: bool = False,
        segments: tuple[tuple[str, ...], ...] = (WHOLE,),
    ) -> DeviceStep:
        """A step's host preparation before any launch (``ModelRunner.prepare``)."""
        return self.model_runner.prepare(scheduler_output, structured=structured, segments=segments)

    def launch(self, step: DeviceStep, segment=WHOLE, *, fill_bitmask=None) -> DeviceStep:
        """Launch one segment of a prepared step and return at once (``ModelRunner.launch``)."""
        return self.model_runner.launch(step, segment, fill_bitmask=fill_bitmask)

    def is_ready(self, step: DeviceStep) -> bool:
        """Whether a launched step's sampled tokens are computed (never blocks; True for an
        empty step). The engine core polls it to know when the step on the device is done."""
        return step.out is None or step.out["token_ids"].is_ready()

    def wait(self, step: DeviceStep) -> None:
        """Block until a launched step's sampled tokens are computed (not yet read back)."""
        if step.out is not None:
            step.out["token_ids"].block_until_ready()

    def collect(self, step: DeviceStep) -> ModelRunnerOutput:
        """Wait for a launched step and read its outputs (``ModelRunner.collect``)."""
        return self.model_runner.collect(step)


def _head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)
