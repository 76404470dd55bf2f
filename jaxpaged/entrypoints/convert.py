"""``jaxpaged convert MODEL OUT``: write the engine's own parameters as an orbax checkpoint.

The output (``models/orbax_checkpoint.py``) holds the parameters exactly as the engine runs them
(fused q/k/v and gate/up, in the chosen dtype, laid out for ``--tensor-parallel-size``) plus the
HF config and tokenizer files; ``LLM(OUT)`` / ``jaxpaged serve OUT`` recognise it and restore
each shard straight onto its device.
"""

from __future__ import annotations

import argparse
import functools
import os

# Quantization methods ``convert`` can write; quantized linears are not built yet (issue 14).
SUPPORTED_QUANTIZATION = ("none",)


def convert(
    model: str,
    out: str,
    *,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> dict:
    """Load ``model`` (a local HF directory) as the engine would and save it to ``out``.

    Args:
        model: HF directory (config.json + safetensors, or config only with ``load_format``
            "dummy").
        out: new or empty output directory.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16", "float16".
        tensor_parallel_size: shards to lay the parameters out for, >= 1; needs that many
            devices here, and the output restores only at this size.
        quantization: None or "none"; any other method is refused by name.
        load_format: "auto"/"safetensors", or "dummy" (random weights of the real shapes).
        seed: seed of dummy weights.

    Returns:
        The metadata written next to the parameters.

    Raises:
        ValueError: an unsupported quantization, a bad directory, dtype or shard count.
    """
    if quantization not in (None, *SUPPORTED_QUANTIZATION):
        raise ValueError(
            f"quantization must be one of {list(SUPPORTED_QUANTIZATION)} for jaxpaged convert, "
            f"got {quantization!r} (quantized checkpoints are not supported yet)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"output path {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):  # before loading anything big
        raise ValueError(f"output directory {out} exists and is not empty")
    from models.orbax_checkpoint import save_checkpoint
    from models.sharded_weights import load_sharded_model
    from models.sharding import make_mesh
    from models.weights import load_config, load_model

    if getattr(load_config(model), "quantization_config", None) is not None:
        raise ValueError(
            f"{model} is a quantized checkpoint (config.json has quantization_config); jaxpaged "
            "convert writes float checkpoints only: serve it directly with --quantization"
        )
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    load = load_model
    if tensor_parallel_size > 1:
        load = functools.partial(load_sharded_model, mesh=make_mesh(tensor_parallel_size))
    loaded, _ = load(model, dtype=dtype, load_format=load_format, seed=seed)
    return save_checkpoint(
        loaded, model, out, tensor_parallel_size=tensor_parallel_size, quantization=None
    )


def add_convert_parser(sub) -> None:
    """The ``convert`` subcommand on the ``jaxpaged`` parser's subparsers."""
    parser = sub.add_parser(
        "convert", help="write a model's engine parameters as an orbax checkpoint"
    )
    parser.add_argument("model", metavar="MODEL", help="local HF model directory")
    parser.add_argument("out", metavar="OUT", help="output directory (new or empty)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="weight dtype: auto (the checkpoint's), float32, bfloat16, float16 (default: auto)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the parameters are laid out for, >= 1; OUT restores only at this size "
        "(default: 1)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="quantization method; only none for now (default: none)",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="auto/safetensors: read MODEL's weights; dummy: random weights (default: auto)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of dummy weights (default: 0)")


def run_convert(args: argparse.Namespace) -> int:
    """Run ``jaxpaged convert`` from parsed flags; prints one summary line."""
    meta = convert(
        args.model,
        args.out,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        load_format=args.load_format,
        seed=args.seed,
    )
    print(
        f"wrote {len(meta['params'])} parameters ({meta['dtype']}, tensor_parallel_size="
        f"{meta['tensor_parallel_size']}) to {args.out}",
        flush=True,
    )
    return 0
