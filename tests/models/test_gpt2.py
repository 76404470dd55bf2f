"""GPT-2 and BLOOM (models.gpt2, models.checkpoint_views) against HF transformers (PyTorch).

Each architecture gets a tiny random checkpoint saved by transformers at test time (biases and
LayerNorm weights randomised too, so a dropped one shows). BLOOM has 6 heads, a head count that
is not a power of two, so the second ALiBi slope rule is exercised. Tensor parallelism runs in
a subprocess with 2 CPU devices (``multidevice_gpt2_checks.py``).
"""

from __future__ import annotations

import os
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxpaged import LLM, SamplingParams
from models.gpt2 import GPT2LMHeadModel, alibi_slopes
from models.weights import load_model
from tests.models.conftest import PagedRunner, hf_logits, relative_diff
from tests.multidevice import run_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent
# float32 on both sides; the differences are summation order only (measured ~5e-7).
RTOL = 1e-4
VOCAB = 128
ARCHITECTURES = ("GPT2LMHeadModel", "BloomForCausalLM")
# Small engine: 16-token steps chunk every prompt (12-23 tokens); 10 blocks of 8 slots cannot
# hold the four requests at once (up to 35 tokens, 5 blocks each), so one is preempted.
TIGHT_ENGINE = dict(
    dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
    max_num_batched_tokens=16, block_size=8, num_gpu_blocks_override=10,
)  # fmt: skip


def make_checkpoint(path: str, architecture: str, *, seed: int = 0) -> str:
    """Saves a tiny random ``architecture`` (GPT-2: hidden 64, 4 heads; BLOOM: hidden 96, 6
    heads; both 2 layers, vocab 128) with transformers and returns ``path``."""
    import torch
    import transformers

    if architecture == "GPT2LMHeadModel":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            initializer_range=0.1, bos_token_id=0, eos_token_id=0, architectures=[architecture],
        )  # fmt: skip
    else:
        config = transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6, initializer_range=0.1,
            architectures=[architecture],
        )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "ln" in name or "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("gpt2_family")
    return {arch: make_checkpoint(str(root / arch), arch) for arch in ARCHITECTURES}


def hf_greedy(model_dir: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """HF greedy continuations, one full forward per token (no EOS handling to differ on)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(num_new):
                logits = model.eval()(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(torch.argmax(logits)))
            outputs.append(tokens[len(prompt) :])
    return outputs


def test_alibi_slopes_match_hf_build_alibi_tensor():
    pytest.importorskip("torch")
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for num_heads in (1, 6, 8, 12, 16, 20, 33):
        mask = torch.ones(1, 2)
        # Position 1's bias is slope * 1: the slopes themselves.
        ref = build_alibi_tensor(mask, num_heads, torch.float32)[:, 0, 1].numpy()
        np.testing.assert_allclose(alibi_slopes(num_heads), ref, rtol=1e-6)


@pytest.mark.parametrize(
    "architecture, backend",
    [("GPT2LMHeadModel", "reference"), ("BloomForCausalLM", "reference"),
     ("BloomForCausalLM", "pallas")],
)  # fmt: skip
def test_logits_match_hf_over_paged_cache(checkpoints, architecture, backend):
    """Two prompts prefilled in one ragged step, then 5 batched decode steps over a NaN-filled,
    permuted paged cache; every position's logits against HF's full-sequence logits. BLOOM on
    the Pallas backend runs ALiBi inside both kernels (interpret mode)."""
    model_dir = checkpoints[architecture]
    model, config = load_model(model_dir, attention_backend=backend, interpret=True)
    heads = config.num_attention_heads
    runner = PagedRunner(
        model, num_layers=config.num_hidden_layers, num_kv_heads=heads,
        head_dim=config.hidden_size // heads,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (13, 7)]
    for seq in runner.generate(prompts, 6):
        diff = relative_diff(np.stack(seq.logits), hf_logits(model_dir, seq.tokens))
        assert diff < RTOL, (architecture, backend, diff)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_engine_greedy_matches_hf_with_chunking_prefix_caching_and_preemption(
    checkpoints, architecture
):
    model_dir = checkpoints[architecture]
    llm = LLM(model_dir, **TIGHT_ENGINE)
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, VOCAB, 9)]  # one full 8-slot block is shared
    prompts = [shared + [int(t) for t in rng.integers(0, VOCAB, n)] for n in (3, 14, 6, 9)]
    expected = hf_greedy(model_dir, prompts, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    scheduler = llm.llm_engine.scheduler
    preemptions = sum(scheduler.num_preemptions_by_mode.values())

    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in batched] == expected
    assert sum(scheduler.num_preemptions_by_mode.values()) > preemptions
    assert max(o.num_cached_tokens for o in batched) >= 8  # the shared block was reused

    for prompt, want in zip(prompts, expected, strict=True):
        (alone,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(alone.outputs[0].token_ids) == want


def test_hub_checkpoint_without_transformer_prefix_loads_the_same(checkpoints, tmp_path):
    """The Hub's ``gpt2`` names its tensors ``h.0.attn...`` (no ``transformer.`` prefix)."""
    source = checkpoints["GPT2LMHeadModel"]
    tensors = safetensors.numpy.load_file(os.path.join(source, "model.safetensors"))
    renamed = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    assert not any(name.startswith("transformer.") for name in renamed)
    safetensors.numpy.save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(pathlib.Path(source, "config.json").read_text())
    ours, _ = load_model(str(tmp_path))
    theirs, _ = load_model(source)
    a = ours.model.layers[1].self_attn.qkv_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(a), theirs.model.layers[1].self_attn.qkv_proj.kernel)
    np.testing.assert_array_equal(
        np.asarray(ours.model.embed_positions.embedding[...]),
        np.asarray(theirs.model.embed_positions.embedding[...]),
    )


def test_unsupported_activation_raises_naming_it():
    import transformers
    from flax import nnx

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, activation_function="swish"
    )
    with pytest.raises(ValueError, match="activation_function 'swish'.*gelu_new"):
        nnx.eval_shape(
            lambda: GPT2LMHeadModel(
                config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
            )
        )


def test_tensor_parallel_checks_pass_on_2_cpu_devices():
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    report = run_on_cpu_devices([*pytest_args, str(HERE / "multidevice_gpt2_checks.py")], 2)
    assert re.search(r"\b3 passed\b", report), report
    assert "skipped" not in report, report


def test_config_json_of_gpt2_and_bloom_gives_layout_and_context_limit(tmp_path):
    """GPT-2 names the head count ``n_head`` and the context ``n_positions``; BLOOM (ALiBi) has
    no context limit in its config: vLLM's default of 2048 applies. Their MLP is 4 x hidden."""
    import json

    from jaxpaged.config import EngineArgs
    from models.tp_layout import TPLayout

    gpt2 = dict(architectures=["GPT2LMHeadModel"], n_head=12, n_embd=768, n_inner=None,
                n_layer=12, n_positions=1024, vocab_size=50257)  # fmt: skip
    bloom = dict(architectures=["BloomForCausalLM"], n_head=16, hidden_size=1024, n_layer=24,
                 vocab_size=250880)  # fmt: skip
    for config, intermediate, limit in ((gpt2, 3072, 1024), (bloom, 4096, 2048)):
        layout = TPLayout.from_hf_config(config, 2)
        assert (layout.num_heads, layout.num_kv_heads) == (config["n_head"],) * 2
        assert layout.intermediate_size == intermediate
        directory = tmp_path / config["architectures"][0]
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        args = EngineArgs(model=str(directory), load_format="dummy", tensor_parallel_size=2)
        assert args.create_engine_config().model_config.max_model_len == limit
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\)"):
        TPLayout.from_hf_config(gpt2, 5)
