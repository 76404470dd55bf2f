"""Where a quantized engine's start-up goes: each step bucket compiled alone, timed, and what XLA
made of it.

    python benchmarks/startup_probe.py --model benchmarks/configs/llama-3-8b --layers 2 \\
        --quantization fp8 --kv-cache-dtype fp8 --buckets profile,1d,16m,512m \\
        --triton-gemm auto --out probe.json

The engine starts with ``enforce_eager`` and a fixed block count (no profiling run, no bucket
compiled), the persistent compilation cache off; then the chosen buckets compile one by one on
the main thread with the step's XLA options of ``--triton-gemm``
(``models.linear_backends.step_compiler_options``: ``auto`` is the engine's choice, ``on`` XLA's
default, ``off`` cuBLAS / cuBLASLt for every dot). Per bucket it records the compile seconds and,
from the optimized HLO, the GEMMs (cuBLASLt FP8 ``__cublas$lt$matmul$f8``, other cuBLAS(Lt)
calls, Triton GEMM fusions and their distinct shapes: what XLA's autotuner tunes), the Pallas
(Triton) kernel calls and the fusion count; ``--hlo-dir`` keeps each optimized module. The
start-up phases before compiling (weights drawn and quantized, placed, KV allocation) come from
the engine's own start-up line. One ``--triton-gemm`` choice per process: XLA's in-process
autotuning cache would otherwise carry results from one choice to the next.

Buckets: ``profile`` (the profiling run's, the largest with every sampler stage), ``<T>d``
(decode-only with T sequences), ``<T>m`` (mixed with T tokens), ``all`` (every start-up bucket).
``--layers`` replaces ``num_hidden_layers`` (a copy of the config in a temporary directory).
Off a GPU it compiles for the CPU (a smoke test of the script), or, with ``--h100-without-gpu``,
for an H100 through XLA's GPU compiler without autotuning (``benchmarks/lib/deviceless_gpu.py``:
the GEMMs and kernels a GPU compile makes, on a machine without one; compile times are the
CPU's).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import re
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.entrypoints.cli_args import add_engine_args  # noqa: E402

# Custom-call targets and fusion kinds counted in each optimized module.
FP8_GEMM = "__cublas$lt$matmul$f8"
GEMM_CALLS = (FP8_GEMM, "__cublas$lt$matmul", "__cublas$gemm")
PALLAS_CALL = "__gpu$xla.gpu.triton"
TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")


def hlo_counts(text: str) -> dict:
    """GEMMs, Pallas calls and fusions of one optimized HLO module (``Compiled.as_text()``)."""
    entry = text  # every computation: GEMMs also sit in while bodies (prompt logprobs)
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', entry))
    gemm_fusions = [
        line for line in entry.splitlines()
        if "fusion(" in line and any(f'"kind":"{k}"' in line for k in TRITON_GEMM_KINDS)
    ]  # fmt: skip
    shapes = {line.split(" = ", 1)[1].split(" fusion(")[0] for line in gemm_fusions}
    return {
        "fp8_cublaslt": targets.get(FP8_GEMM, 0),
        "other_cublas": sum(targets.get(t, 0) for t in GEMM_CALLS[1:]),
        "triton_gemm_fusions": len(gemm_fusions),
        "triton_gemm_shapes": len(shapes),
        "pallas_calls": targets.get(PALLAS_CALL, 0),
        "fusions": sum(1 for line in entry.splitlines() if " fusion(" in line),
    }


def with_num_layers(model: str, num_layers: int, directory: str) -> str:
    """A copy of ``model``'s config.json with ``num_hidden_layers`` replaced, in ``directory``."""
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (pathlib.Path(directory) / "config.json").write_text(json.dumps(config))
    return directory


def select_keys(runner, spec: str) -> list:
    """The bucket keys of ``spec`` (module docstring), in its order.

    Raises:
        ValueError: a name that is no bucket of this engine (the message lists them).
    """
    keys = runner.all_bucket_keys()
    named = {f"{k.num_tokens}{'d' if k.decode_only else 'm'}": k for k in keys}
    named["profile"] = runner.profile_key()
    out = []
    for name in spec.split(","):
        if name == "all":
            out += [k for k in keys if k not in out]
        elif name in named:
            out.append(named[name])
        else:
            raise ValueError(f"--buckets: no bucket {name!r}; this engine has {sorted(named)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    parser.add_argument("--buckets", default="profile,1d,16m,512m", help="module docstring")
    parser.add_argument("--triton-gemm", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--hlo-dir", default=None, help="write each optimized module here")
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument(
        "--h100-without-gpu", action="store_true",
        help="compile for an H100 on this machine (lib/deviceless_gpu.py)",
    )  # fmt: skip
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.h100_without_gpu:
        return probe(args)
    import jax

    from benchmarks.lib.deviceless_gpu import h100_device, pretend_gpu

    device = h100_device()
    with pretend_gpu():
        return probe(args, jax.default_device(device))


def probe(args: argparse.Namespace, compile_context=None) -> int:
    """The probe of the module docstring; buckets compile inside ``compile_context``."""
    start = time.perf_counter()
    import jax

    from jaxpaged.benchmarks.throughput import build_llm
    from models.linear_backends import step_compiler_options

    tmp = tempfile.TemporaryDirectory()
    if args.layers is not None:
        args.model = with_num_layers(args.model, args.layers, tmp.name)
    args.enforce_eager = True  # nothing compiles at start-up; the buckets compile below
    args.enable_compilation_cache = False
    if args.num_gpu_blocks_override is None:
        args.num_gpu_blocks_override = 2048  # no profiling run (its bucket is timed below)
    llm = build_llm(args)
    engine = llm.llm_engine
    worker = engine.worker
    runner = worker.model_runner
    options = step_compiler_options(
        engine.config.model_config.quant_config, jax.default_backend(), args.triton_gemm
    )
    runner.compiler_options = options or None
    report = {
        "model": args.model,
        "layers": args.layers,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "triton_gemm": args.triton_gemm,
        "compiler_options": options,
        "device": f"{jax.default_backend()} {jax.devices()[0].device_kind}",
        "engine_start_s": time.perf_counter() - start,
        "startup_phases": engine.startup.as_dict(),
        "num_buckets": len(runner.all_bucket_keys()),
        "buckets": [],
    }
    print(f"engine up in {report['engine_start_s']:.1f} s; {report['num_buckets']} buckets; "
          f"XLA options {options}", flush=True)  # fmt: skip

    def save() -> None:  # after every bucket: a run cut by a time box keeps what it measured
        if args.out:
            report["total_s"] = time.perf_counter() - start
            pathlib.Path(args.out).write_text(json.dumps(report, indent=1))

    save()
    for key in select_keys(runner, args.buckets):
        name = "profile" if key == runner.profile_key() else (
            f"{key.num_tokens}{'d' if key.decode_only else 'm'}")  # fmt: skip
        t0 = time.perf_counter()
        with compile_context or contextlib.nullcontext():
            executable = runner.executable(key)
        row = {"bucket": name, "compile_s": time.perf_counter() - t0}
        text = executable.as_text() or ""
        row.update(hlo_counts(text))
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            pathlib.Path(args.hlo_dir, f"{name}.hlo").write_text(text)
        report["buckets"].append(row)
        print(json.dumps(row), flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
