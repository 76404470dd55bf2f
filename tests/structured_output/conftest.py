"""Engines shared by the structured-output tests (one per backend for the whole package)."""

from __future__ import annotations

import pytest

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(scope="package")
def llm():
    """An engine with structured_outputs_config backend auto (xgrammar, installed here)."""
    pytest.importorskip("xgrammar")
    from jaxpaged import LLM

    return LLM(**ENGINE)


@pytest.fixture(scope="package")
def guidance_llm():
    pytest.importorskip("llguidance")
    from jaxpaged import LLM

    return LLM(**ENGINE, structured_outputs_config={"backend": "guidance"})
