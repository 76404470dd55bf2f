"""LLM.update_weights: weights from memory, checked first, placed leaf by leaf, no recompile."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.worker.compilation_cache import CompileCounter
from jaxpaged.worker.weight_update import device_bytes_in_use
from tests.conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def hf_weights(stories_dir) -> dict[str, np.ndarray]:
    """stories260k's own tensors by HF name, on the host (as a trainer's export would be)."""
    return safetensors.numpy.load_file(os.path.join(stories_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def llm():
    """Starts from dummy weights; every test leaves stories260k's real weights in it."""
    return LLM(dtype="float32", load_format="dummy", enable_sleep_mode=True, **SMALL_ENGINE)


def _greedy(llm, golden) -> list[list[int]]:
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]]
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _expected(golden) -> list[list[int]]:
    return [c["greedy_new_ids"] for c in golden["cases"]]


def test_hf_names_after_dummy_give_golden_then_perturbed_and_restored(llm, hf_weights, golden):
    assert _greedy(llm, golden) != _expected(golden)  # dummy weights
    llm.update_weights(hf_weights)
    assert _greedy(llm, golden) == _expected(golden)
    own = llm.get_weights()
    perturbed = jax.tree.map(lambda x: x * 1.25 + 0.01, own)
    llm.update_weights(perturbed)
    assert _greedy(llm, golden) != _expected(golden)
    llm.update_weights(own)  # our own layout, on the device
    assert _greedy(llm, golden) == _expected(golden)


def test_updates_compile_nothing(llm, hf_weights, golden):
    llm.update_weights(hf_weights)  # the first HF update compiled its assembly functions
    _greedy(llm, golden)
    own = llm.get_weights()
    bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), own)  # cast back to float32 on update
    with CompileCounter() as counter:
        for params in (hf_weights, own, hf_weights):
            llm.update_weights(params)
            assert _greedy(llm, golden) == _expected(golden)
    assert counter.requests == 0
    llm.update_weights(bf)  # a new dtype: casting compiles, the step does not
    runner_compilations = llm.llm_engine.worker.model_runner.num_compilations
    _greedy(llm, golden)
    assert llm.llm_engine.worker.model_runner.num_compilations == runner_compilations
    llm.update_weights(hf_weights)


@pytest.mark.parametrize("layout", ["own_device", "hf_host", "own_bfloat16"])
def test_peak_device_bytes_stay_within_weights_plus_5_percent(llm, hf_weights, layout):
    """Measured as the live arrays' bytes on the device (the CPU reports no allocator
    statistics; on GPU ``device_bytes_in_use`` reads ``bytes_in_use``) after each placed leaf,
    over what was live before the call (the engine's weights plus the caller's pytree)."""
    if layout == "hf_host":
        params = hf_weights
        llm.update_weights(params)  # compiles the assembly functions (their constants)
    else:
        own = llm.get_weights()
        params = jax.tree.map(lambda x: x + 0.0, own)  # a new copy on the device
        if layout == "own_bfloat16":
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        del own
    device = jax.devices()[0]
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.get_weights()))
    before = device_bytes_in_use(device)
    peak = [before]
    llm.llm_engine.update_weights(
        params, on_leaf=lambda _: peak.append(device_bytes_in_use(device))
    )
    assert max(peak) - before <= 0.05 * weights, (max(peak) - before, weights)
    llm.update_weights(hf_weights)


def test_update_drops_cached_prefixes(llm, hf_weights):
    prompt = {"prompt_token_ids": list(range(1, 40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(hf_weights)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def _hf_bad_inputs(hf):
    name = "model.layers.2.self_attn.k_proj.weight"
    missing = {k: v for k, v in hf.items() if k != name}
    extra = hf | {"model.layers.9.mlp.up_proj.weight": hf[name]}
    misshapen = hf | {name: hf[name][:, :-1]}
    wrong_dtype = hf | {name: hf[name].astype(np.int32)}
    return [
        (missing, rf"{name}.*missing"),
        (extra, r"model\.layers\.9\.mlp\.up_proj\.weight"),
        (misshapen, rf"{name}.*shape"),
        (wrong_dtype, rf"{name}.*int32"),
        # These raised AttributeError and a pytree-sorting error naming nothing.
        (hf | {name: hf[name].tolist()}, rf"parameter {name} is a list; expected an array"),
        (hf | {5: hf[name]}, r"params at the top level has the key 5 \(int\)"),
        (hf | {"extra": nnx.Param(jnp.ones(4))}, r"no parameter for, e\.g\. 'extra'"),
    ]


def _own_bad_inputs(own):
    layer = own["model"]["layers"][1]["self_attn"]["qkv_proj"]
    kernel = layer["kernel"]
    missing = jax.tree.map(lambda x: x, own)
    del missing["model"]["layers"][1]["self_attn"]["qkv_proj"]
    extra = jax.tree.map(lambda x: x, own)
    extra["model"]["extra_norm"] = {"weight": jnp.ones(4)}
    misshapen = jax.tree.map(lambda x: x, own)
    misshapen["model"]["layers"][1]["self_attn"]["qkv_proj"]["kernel"] = kernel[:, 1:]
    wrong_dtype = jax.tree.map(lambda x: x, own)
    wrong_dtype["model"]["layers"][1]["self_attn"]["qkv_proj"]["kernel"] = kernel.astype(int)
    path = r"model\.layers\.1\.self_attn\.qkv_proj\.kernel"
    as_list = jax.tree.map(lambda x: x, own)
    as_list["model"]["layers"][1]["self_attn"]["qkv_proj"]["kernel"] = np.asarray(kernel).tolist()
    odd_key = jax.tree.map(lambda x: x, own)
    odd_key["model"][5] = {"weight": jnp.ones(4)}
    top_param = {**own, "extra": nnx.Param(jnp.ones(4))}
    return [
        (missing, path + ".*missing"),
        (extra, r"model\.extra_norm\.weight"),
        (misshapen, path + ".*shape"),
        (wrong_dtype, path + ".*int32"),
        # A list leaf read as "missing" (its items became paths); a non-string key raised a
        # pytree-sorting error naming nothing.
        (as_list, path + " is a list; expected an array"),
        (odd_key, r"params at model has the key 5 \(int\)"),
        (top_param, r"no parameter for, e\.g\. extra;"),
    ]


@pytest.mark.parametrize("layout", ["hf", "own"])
def test_bad_params_are_refused_by_name_and_the_engine_keeps_its_weights(
    llm, hf_weights, golden, layout
):
    llm.update_weights(hf_weights)
    own = llm.get_weights()
    cases = _hf_bad_inputs(hf_weights) if layout == "hf" else _own_bad_inputs(own)
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.update_weights(params)
        kept = zip(jax.tree.leaves(own), jax.tree.leaves(llm.get_weights()), strict=True)
        assert all(a is b for a, b in kept)
    assert _greedy(llm, golden) == _expected(golden)
    for bad in ([], {}, np.zeros(3)):
        with pytest.raises(ValueError, match="params"):
            llm.update_weights(bad)


def test_update_while_requests_run_is_refused_and_they_finish(llm, hf_weights, golden):
    llm.update_weights(hf_weights)
    engine = llm.llm_engine
    case = golden["cases"][0]
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": case["prompt_ids"]}, params)
    engine.step()
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.update_weights(llm.get_weights())
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    assert list(final.outputs[0].token_ids) == case["greedy_new_ids"]
    llm.update_weights(hf_weights)  # idle again: accepted


def test_from_params_builds_an_engine_with_weights_from_memory(stories_dir, hf_weights, golden):
    llm = LLM.from_params(stories_dir, hf_weights, dtype="float32", **SMALL_ENGINE)
    assert _greedy(llm, golden) == _expected(golden)


def test_weights_checksum_follows_an_update(llm, hf_weights):
    """``Worker.weights_checksum`` (``jaxpaged bench matrix``) reads the weights the steps run
    on after ``update_weights``: the sum of |x| and the non-zero count of the HF tensors, which
    any layout of them keeps."""
    llm.update_weights(hf_weights)
    total, count = llm.llm_engine.worker.weights_checksum()
    floats = [t for t in hf_weights.values() if np.issubdtype(t.dtype, np.floating)]
    assert count == sum(int(np.count_nonzero(t)) for t in floats)
    assert total == pytest.approx(sum(float(np.abs(t.astype(np.float64)).sum()) for t in floats))
    llm.update_weights(jax.tree.map(lambda x: x * 2.0, llm.get_weights()))
    assert llm.llm_engine.worker.weights_checksum() == pytest.approx((2 * total, count))
    llm.update_weights(hf_weights)
