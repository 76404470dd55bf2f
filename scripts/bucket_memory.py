"""XLA's memory analysis of every compiled step bucket, against the profiled bucket's.

The KV cache is sized from ONE profiling step (``ModelRunner.profile_run``: the largest mixed
bucket with every sampler stage on) plus a 1% headroom (``jaxpaged.worker.kv_cache``). This
tool builds the engine's worker (weights, LoRA slots if enabled), compiles the profiled bucket
and every bucket of ``ModelRunner.all_bucket_keys()``, and prints, per bucket, the bytes of
``compiled.memory_analysis()``: temporaries, arguments, outputs and outputs aliased to (donated)
arguments, and how far each bucket's temporaries exceed the profiled bucket's. A bucket whose
temporaries exceed the profiled ones by more than the headroom can run out of memory after
start-up.

    python scripts/bucket_memory.py --model benchmarks/configs/llama-3-8b --load-format dummy \\
        --skip-tokenizer-init --dtype bfloat16 --max-num-seqs 1024 \\
        --max-num-batched-tokens 4096 --num-hidden-layers 2 --num-gpu-blocks-override 257 \\
        --enable-lora --max-loras 8 --max-lora-rank 16 [--lora-fold] [--output-json F]

``--num-hidden-layers`` overrides the checkpoint's layer count (a copy of its config.json; dummy
weights only). On the CPU, use a small ``--num-gpu-blocks-override`` (257 blocks hold 4096
tokens): Pallas kernels run in interpret mode there, which copies the whole cache into
temporaries, and bfloat16 dots upcast their operands (weights included) to float32, so CPU
temporaries are a proxy only; on a GPU leave the override out to get the engine's own count.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.entrypoints.cli_args import add_engine_args, engine_args_from  # noqa: E402
from jaxpaged.entrypoints.env import set_jax_memory_fraction  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--num-hidden-layers",
        type=int,
        default=None,
        help="override the checkpoint's layer count (dummy weights only)",
    )
    parser.add_argument(
        "--lora-fold",
        action="store_true",
        help="the fold LoRA layout (models.lora.LORA_FOLD) instead of the default",
    )
    parser.add_argument("--output-json", default=None, help="write the rows here")
    add_engine_args(parser)
    return parser


def with_num_layers(model: str, num_layers: int, directory: str) -> str:
    """A copy of ``model``'s config.json with ``num_hidden_layers`` replaced, in ``directory``."""
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (pathlib.Path(directory) / "config.json").write_text(json.dumps(config))
    return directory


def bucket_rows(runner) -> list[dict]:
    """One row per bucket (the profiled one first): its name and memory analysis in bytes."""
    runner.compile_all(show_progress=False)  # on threads; the profiled bucket comes next
    profiled = runner.profile_key()
    rows = []
    for key in [profiled, *runner.all_bucket_keys()]:
        analysis = runner.executable(key).memory_analysis()
        kind = "profiled" if key == profiled else "decode" if key.decode_only else "mixed"
        rows.append(
            dict(
                bucket=f"T={key.num_tokens} B={key.num_seqs} {kind}",
                temp=analysis.temp_size_in_bytes,
                argument=analysis.argument_size_in_bytes,
                output=analysis.output_size_in_bytes,
                alias=analysis.alias_size_in_bytes,
            )
        )
    for row in rows:
        row["temp_over_profiled"] = row["temp"] - rows[0]["temp"]
    return rows


def main() -> int:
    args = build_parser().parse_args()
    set_jax_memory_fraction(args.gpu_memory_utilization)
    import models.lora
    from jaxpaged.worker.worker import Worker

    models.lora.LORA_FOLD = args.lora_fold
    with tempfile.TemporaryDirectory() as directory:
        if args.num_hidden_layers is not None:
            args.model = with_num_layers(args.model, args.num_hidden_layers, directory)
        args.enforce_eager = True  # this tool compiles the buckets itself, one at a time
        worker = Worker(engine_args_from(args).create_engine_config(), show_progress=False)
        worker.load_model()
        worker.initialize_cache(worker.determine_num_blocks())
    rows = bucket_rows(worker.model_runner)
    mib = 2**20
    print(f"{worker.num_gpu_blocks} KV blocks; MiB")
    print(
        f"{'bucket':<26} {'temp':>8} {'over prof':>10} {'argument':>9} {'output':>8} {'alias':>8}"
    )
    for row in rows:
        print(
            f"{row['bucket']:<26} {row['temp'] / mib:8.1f} {row['temp_over_profiled'] / mib:+10.1f}"
            f" {row['argument'] / mib:9.1f} {row['output'] / mib:8.1f} {row['alias'] / mib:8.1f}"
        )
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
