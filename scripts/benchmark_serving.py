"""Thin wrapper: the benchmark lives in ``jaxpaged/benchmarks/serving.py`` (``jaxpaged bench serving``,
where ``serve`` is this script's name for ``serving``); same flags, same result lines."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
