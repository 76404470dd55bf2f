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

# Methods that quantize an unquantized checkpoint while loading it (``--quantization``); a
# checkpoint quantized by its tool (AWQ, GPTQ, compressed-tensors, FP8, bitsandbytes) keeps its
# own method, detected from its config.json.
ONLINE_QUANTIZATION = ("fp8", "bitsandbytes")


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
        quantization: None (the checkpoint's own quantization_config, if any, else float),
            "none" (float; refused for a quantized checkpoint) or an online method,
            ``ONLINE_QUANTIZATION``: the engine's own quantized tensors are written, exactly
            as ``LLM(model, quantization=...)`` would run them.
        load_format: "auto"/"safetensors", "bitsandbytes" (what ``auto`` means with
            ``quantization="bitsandbytes"``), or "dummy" (random weights of the real shapes).
        seed: seed of dummy weights.

    Returns:
        The metadata written next to the parameters.

    Raises:
        ValueError: an unsupported quantization or one that does not go with the checkpoint
            or ``load_format`` (named), a bad directory, dtype or shard count.
    """
    if quantization not in (None, "none", *ONLINE_QUANTIZATION):
        raise ValueError(
            f"quantization must be one of {['none', *ONLINE_QUANTIZATION]} for jaxpaged convert "
            f"(a checkpoint quantized by its tool keeps its method: leave it unset), got "
            f"{quantization!r}"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"output path {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):  # before loading anything big
        raise ValueError(f"output directory {out} exists and is not empty")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {model} has no config.json ({config_path})")
    from jaxpaged.config import read_config_json
    from models.quantization.config import resolve_quantization

    stored = read_config_json(config_path).get("quantization_config")

    if quantization == "none":
        if stored is not None:
            raise ValueError(
                f"quantization='none' cannot convert {model}: its config.json has "
                f"quantization_config (quant_method {stored.get('quant_method')!r}), which is "
                "kept as stored; leave quantization unset"
            )
        quantization = None
    if quantization == "bitsandbytes" and load_format == "auto":
        load_format = "bitsandbytes"  # the engine's pairing (models.quantization.config)
    quant_config = resolve_quantization(quantization, stored, load_format)
    from models.orbax_checkpoint import save_checkpoint
    from models.sharded_weights import load_sharded_model
    from models.sharding import make_mesh
    from models.weights import load_model

    load = load_model
    if tensor_parallel_size > 1:
        load = functools.partial(load_sharded_model, mesh=make_mesh(tensor_parallel_size))
    loaded, _ = load(
        model, dtype=dtype, load_format=load_format, seed=seed, quant_config=quant_config
    )
    return save_checkpoint(
        loaded,
        model,
        out,
        tensor_parallel_size=tensor_parallel_size,
        quantization=None if quant_config is None else quant_config.method,
        quantization_load_format=None if quant_config is None else load_format,
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
        help="online quantization written as the engine runs it: fp8 or bitsandbytes (8-bit); "
        "none: float. Default: the checkpoint's own quantization_config if it has one (kept), "
        "else float",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "bitsandbytes", "dummy"],
        help="auto/safetensors: read MODEL's weights (bitsandbytes: the same, paired with "
        "--quantization bitsandbytes, which auto implies); dummy: random weights (default: auto)",
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
        f"wrote {len(meta['params'])} parameters ({meta['dtype']}, quantization "
        f"{meta['quantization']}, tensor_parallel_size={meta['tensor_parallel_size']}) to "
        f"{args.out}",
        flush=True,
    )
    return 0
