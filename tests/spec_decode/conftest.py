"""Fixtures shared with the sampler tests: HF (PyTorch) logits of stories260k."""

from tests.sample.conftest import hf_story_logits  # noqa: F401  (a fixture)
