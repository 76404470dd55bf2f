"""``jaxpaged bench matrix --workers N``: the matrix's rows split over N worker processes.

Why: a row's time is mostly XLA and Triton compiling its engine and its reference (the first
GPU run, an H100 at ``f94aa64``: about 30 s a row, of which 22-41 s compiling), and compiling
runs on the host's CPUs, most of them idle while one engine compiles. N processes compile N
engines at once and share the device: each gets ``1 / N`` of the memory pool
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, set before its JAX starts, and the rows'
``gpu_memory_utilization``), which the matrix's small engines (2 layers, 160 KV blocks) fit.

Sharding keeps rows that share a reference run (same model and workload: see
``Matrix._reference``) in one worker, so no reference runs twice, and balances the shards by
row count (longest first). Each worker writes its own JSON (``--out`` with a ``.shardK``
suffix); the parent merges them in the declared row order into ``--out``. A worker that dies
leaves its finished rows; the rows it never reported are recorded as errors naming the worker's
exit status.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxpaged.benchmarks.matrix_rows import MatrixRow
from jaxpaged.entrypoints.env import child_env_with_memory_fraction

# Device memory a worker may take in all: the matrix's default (0.9) split N ways.
TOTAL_MEMORY_FRACTION = 0.9


def shard_rows(rows: Sequence[MatrixRow], workers: int) -> list[list[MatrixRow]]:
    """``rows`` in at most ``workers`` shards: groups of rows with the same (model, workload)
    stay together; groups go, largest first, to the shard with the fewest rows. Rows keep their
    declared order inside a shard. Raises ValueError for ``workers < 1``."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    groups: dict[tuple[str, str], list[MatrixRow]] = {}
    for row in rows:
        groups.setdefault((row.model, row.workload), []).append(row)
    shards: list[list[MatrixRow]] = [[] for _ in range(min(workers, len(groups)) or 1)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(group)
    order = {row.name: i for i, row in enumerate(rows)}
    return [sorted(shard, key=lambda r: order[r.name]) for shard in shards if shard]


def run_sharded(rows: Sequence[MatrixRow], workers: int, out: str, passthrough: list[str]) -> dict:
    """Run ``rows`` in ``workers`` processes (``python -m jaxpaged.entrypoints.cli bench matrix
    --rows ... --out OUT.shardK`` plus ``passthrough`` flags) and return the merged report
    (also written to ``out``). The workers' tables go to this process's stderr."""
    shards = shard_rows(rows, workers)
    fraction = TOTAL_MEMORY_FRACTION / len(shards)
    procs = []
    start = time.perf_counter()
    for k, shard in enumerate(shards):
        shard_out = f"{out}.shard{k}"
        pathlib.Path(shard_out).unlink(missing_ok=True)
        env = child_env_with_memory_fraction(fraction)
        command = [sys.executable, "-m", "jaxpaged.entrypoints.cli", "bench", "matrix",
                   "--rows", *[r.name for r in shard], "--out", shard_out, "--no-tqdm",
                   "--gpu-memory-utilization", f"{fraction:.3f}", *passthrough]  # fmt: skip
        procs.append((subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL), shard_out))
    records: dict[str, dict] = {}
    report: dict = {}
    for (proc, shard_out), shard in zip(procs, shards, strict=True):
        status = proc.wait()
        path = pathlib.Path(shard_out)
        part = json.loads(path.read_text()) if path.is_file() else {"rows": []}
        report = report or {k: v for k, v in part.items() if k != "rows"}
        for record in part["rows"]:
            records[record["name"]] = record
        for row in shard:
            if row.name not in records:
                records[row.name] = dict(
                    name=row.name, model=row.model, compiled="error", matches=None,
                    max_abs_dlogprob=None, tolerance=None, startup_s=None, compile_s=None,
                    step_ms=None, note=f"worker exited with status {status} before this row",
                )  # fmt: skip
        path.unlink(missing_ok=True)
    report.update(workers=len(shards), total_s=round(time.perf_counter() - start, 2))
    report["rows"] = [records[row.name] for row in rows]
    pathlib.Path(out).write_text(json.dumps(report, indent=1, default=float))
    return report
