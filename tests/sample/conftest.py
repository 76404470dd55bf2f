"""Shared helpers for the sampler tests: HF (PyTorch) logits of stories260k, metadata rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sample.metadata import SamplingMetadata
from jaxpaged.worker.step_buffer import NEUTRAL_SLOT, SAMPLING_COLUMNS, SECTIONS

STORY = "Once upon a time, there was a little girl named Lily. She loved to play with her"


@pytest.fixture(scope="session")
def hf_story_logits(stories_dir) -> np.ndarray:
    """f32[len(tokens), vocab]: HF transformers logits at every position of STORY."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    ids = tokenizer.encode(STORY)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="session")
def flat_logits(hf_story_logits) -> np.ndarray:
    """f32[vocab]: the HF logits of the STORY position with the most uncertain next token."""
    z = hf_story_logits - hf_story_logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    entropy = -(p * np.log(p + 1e-30)).sum(-1)
    return hf_story_logits[int(np.argmax(entropy))]


def make_metadata(n: int, num_tokens: int = 1, neutral_slot: int = 0, **fields) -> SamplingMetadata:
    """SamplingMetadata for ``n`` rows: neutral defaults, overridden by scalars or arrays."""
    values = {}
    for name, _, dtype, padding in SECTIONS:
        if name not in SAMPLING_COLUMNS:
            continue
        value = fields.pop(name, neutral_slot if padding == NEUTRAL_SLOT else padding)
        values[name] = jnp.asarray(np.broadcast_to(np.asarray(value, dtype), (n,)))
    values["prompt_target"] = jnp.asarray(
        fields.pop("prompt_target", -np.ones(num_tokens, np.int32))
    )
    if fields:
        raise TypeError(f"unknown fields {sorted(fields)}")
    return SamplingMetadata(**values)
