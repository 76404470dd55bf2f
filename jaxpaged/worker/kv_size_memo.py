"""The KV block count an earlier start of the same engine chose, kept beside the compilation cache.

Every step bucket's executable has the KV cache's shape in it, so a restart reuses the persistent
compilation cache only if it picks the same number of blocks. Memory profiling does not: the
first start's peak includes XLA's compile-time scratch, and a warm start (executables loaded,
not compiled) measures a lower peak and so a few hundred more blocks (measured on the H200 with
Llama-3-8B: 55,242 cold, 55,468 warm, which recompiled all 18 buckets). ``remembered_num_blocks``
therefore reuses the earlier count whenever it still fits what profiling allows now; only a start
that measures less memory than before takes its own, smaller count (and compiles).

The memo is one JSON file per engine configuration under the compilation cache directory, keyed
by a hash of everything that decides the step's shapes and the profiled budget.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

logger = logging.getLogger(__name__)


def memo_key(**fields) -> str:
    """A stable hash of the JSON-serializable ``fields`` (sorted keys)."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def remembered_num_blocks(cache_dir: str, key: str, measured: int) -> int:
    """The block count to use: the remembered one when it is at most ``measured`` (it fits the
    memory profiling allows now), else ``measured``, which is then remembered.

    Args:
        cache_dir: the compilation cache directory (``Worker.compilation_cache_dir``).
        key: ``memo_key`` of the engine configuration.
        measured: blocks that fit the budget this start measured, >= 1.

    An unreadable memo is ignored (and rewritten); a failure to write only logs.
    """
    path = os.path.join(cache_dir, "kv_blocks", f"{key}.json")
    try:
        with open(path) as f:
            remembered = int(json.load(f)["num_blocks"])
    except (OSError, ValueError, KeyError, TypeError):
        remembered = None
    if remembered is not None and 1 <= remembered <= measured:
        return remembered
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"num_blocks": measured}, f)
    except OSError as error:
        logger.warning("could not remember the KV block count in %s: %s", path, error)
    return measured
