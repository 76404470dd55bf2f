"""Run only the compiled (GPU) cases of kernel test files: the items whose ``interpret``
parameter is False, and tests named ``test_compiled_*``; the interpreted cases (the CPU's
checks, slow on a GPU host) are deselected.

    python benchmarks/lib/compiled_kernel_tests.py tests/pallas_kernels/test_w8_gemv.py ...

Extra pytest flags may follow the files. Exit status: pytest's.
"""

from __future__ import annotations

import sys

import pytest


class CompiledOnly:
    """A pytest plugin keeping the compiled cases only."""

    @staticmethod
    def pytest_collection_modifyitems(config, items):
        keep, drop = [], []
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            compiled = params.get("interpret") is False or item.name.startswith("test_compiled")
            (keep if compiled else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


if __name__ == "__main__":
    sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]], plugins=[CompiledOnly()]))
