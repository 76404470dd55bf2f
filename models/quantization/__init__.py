"""Quantized linear layers: one module per method, plus the shared pieces they stand on.

Why under ``models/`` and not ``jaxpaged/`` (docs/architecture.md, "Layers"): a
quantized linear is called from inside the model's layers (``models/llama.py``,
``models/merged_linear.py``), and imports point one way, ``pallas_kernels`` <- ``models`` <-
``jaxpaged``. The engine (``jaxpaged/config.py``) can still import the JAX-free parsing in
:mod:`models.quantization.config`, as it does ``models.tp_layout``. The FP8 KV-cache helpers
live beside the kernels that call them, in ``pallas_kernels/fp8_kv_cache.py``.

Modules:

- ``config``: HF ``quantization_config`` -> a frozen config per method; auto-detection from
  ``quant_method`` and the ``quantization=`` flag check (no JAX, no numpy).
- ``linear_method``: ``get_linear_method(config, layer_name)``, the one object the model and the
  loaders talk to (tensor specs, load, TP split axis, apply).
- ``stored``: a layer's stored tensors (``TensorSpec``) and the check that names a bad one.
- ``packing``: int4/int8 values packed in int32 words, unpacked with shifts and masks.
- ``awq``, ``gptq``, ``compressed_tensors``, ``fp8``, ``bitsandbytes``: per method, the tensors a
  layer loads as stored (names, shapes, dtypes, checks), unpacking to (values, scales, zeros),
  dequantization, and the linear ``y = x @ W``.
- ``w8a8``: dynamic per-token activation quantization and the INT8 / FP8 scaled matmuls shared by
  ``compressed_tensors``, ``fp8`` and ``bitsandbytes``.
- ``tp_split``: which axis of each stored tensor splits for column- and row-parallel layers.
- ``merge``: q/k/v (gate/up) parts fused in ``models.merged_linear``'s shard-major order.

``docs/quantization.md`` lists the formats with their sources and the plan for wiring this in.

Shape letters: ``in`` / ``out`` are a layer's input and output features, ``G`` its number of
quantization groups along ``in`` (``in // group_size``), ``T`` tokens (as in ``pallas_kernels``).
Orientation is the checkpoint's ("loading as stored"): AWQ and GPTQ store ``[in, ...]``
(``x @ W``), compressed-tensors, FP8 and bitsandbytes store ``[out, in]`` (``x @ W.T``).
"""

QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "bitsandbytes")
"""vLLM's names for the methods jaxpaged implements (``quantization=`` / ``--quantization``)."""
