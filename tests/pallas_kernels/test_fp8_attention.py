"""Both attention kernels and kv_cache_update over an FP8 KV cache (``kv_cache_dtype="fp8"``).

The caches hold ``quantize_kv(k, k_scale)`` with NaN in every unused block and stale slot (e4m3fn
and e5m2 both encode NaN). Against its plain-JAX reference on the *same* FP8 cache a kernel must
agree to float32 tolerance: both read the same FP8 values, the kernel folding the scales into the
logits and the output, the reference multiplying each element. Against float32 K/V the error is
the cache's rounding, bounded as in docs/quantization.md.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    kv_cache_update,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.fp8_kv_cache import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    dequantize_kv,
    kv_scale_from_amax,
    quantize_kv,
)
from pallas_kernels.paged_attention import DecodeTiling, _paged_attention, _split_plan
from tests.pallas_kernels.test_paged_attention import (
    F32_TOL,
    INTERPRET_MODES,
    assert_close,
    make_paged_kv,
)
from tests.pallas_kernels.test_ragged_paged_attention import cu_of, mixed_batch

FP8_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]
BLOCK_SIZE, MAX_BLOCKS, HKV, GROUP, D = 8, 5, 2, 2, 32


def fp8_case(rng, seq_lens, dtype):
    """(k8, v8 caches, tables, k, v contiguous float32, k8, v8 contiguous, k_scale, v_scale)."""
    k_cache, v_cache, tables, k, v = make_paged_kv(
        rng, seq_lens, num_kv_heads=HKV, head_dim=D, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS
    )
    v_cache, v = 3 * v_cache, 3 * v  # a range unlike K's, so a swapped scale shows
    finite = jnp.nan_to_num
    k_scale = kv_scale_from_amax(finite(k_cache), K_SCALE_CONSTANT)
    v_scale = kv_scale_from_amax(finite(v_cache), V_SCALE_CONSTANT)
    k8, v8 = quantize_kv(k_cache, k_scale, dtype), quantize_kv(v_cache, v_scale, dtype)
    assert bool(jnp.isnan(k8.astype(jnp.float32)).any()), "the unused slots must hold NaN"
    contiguous = (len(seq_lens), MAX_BLOCKS * BLOCK_SIZE, HKV, D)
    k8_c, v8_c = k8[tables].reshape(contiguous), v8[tables].reshape(contiguous)
    return k8, v8, tables, k, v, k8_c, v8_c, k_scale, v_scale


def check_within_fp8_bound(out, exact, q, k, v, k_deq, v_deq, seq_of_row, lens, scale):
    """docs/quantization.md: ``|d out| <= (exp(2 delta) - 1) max|v| + max|dv|`` per query row,
    ``delta = scale * max_key sum_d |q_d| |dk_d|`` over the row's visible keys (here all the
    sequence's keys, a superset, so the bound only loosens)."""
    out, exact, q = (np.asarray(a, np.float64) for a in (out, exact, q))
    k, v, k_deq, v_deq = (np.asarray(a, np.float64) for a in (k, v, k_deq, v_deq))
    for row, b in enumerate(seq_of_row):
        n = int(lens[b])
        for h in range(q.shape[1]):
            kv_head = h // GROUP
            dk = np.abs(k_deq[b, :n, kv_head] - k[b, :n, kv_head])
            delta = scale * (np.abs(q[row, h]) * dk).sum(-1).max()
            dv = np.abs(v_deq[b, :n, kv_head] - v[b, :n, kv_head]).max()
            bound = (np.exp(2 * delta) - 1) * np.abs(v[b, :n, kv_head]).max() + dv
            assert np.abs(out[row, h] - exact[row, h]).max() <= bound * (1 + 1e-4) + 1e-6


# Interpreted everywhere; compiled (Pallas Triton) where a GPU is present.
INTERPRET = INTERPRET_MODES


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_decode_kernel_reads_fp8_cache_like_its_reference(dtype, interpret):
    """Both FP8 formats, single pass and split (flash-decoding) paths."""
    rng = np.random.default_rng(0)
    seq_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, MAX_BLOCKS * BLOCK_SIZE]
    k8, v8, tables, k, v, k8_c, v8_c, k_scale, v_scale = fp8_case(rng, seq_lens, dtype)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), HKV * GROUP, D)), jnp.float32)
    lens = jnp.asarray(seq_lens, jnp.int32)
    sm = D**-0.5
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = paged_attention_reference(q, k8_c, v8_c, lens, scale=sm, **scales)
    out = paged_attention(q, k8, v8, tables, lens, scale=sm, interpret=interpret, **scales)
    assert_close(out, expected, F32_TOL)
    # The split path (partials scaled by v_scale, then combined) with a soft cap (k_scale
    # inside the tanh) agrees too.
    tiling = DecodeTiling(block_k=16, target_programs=64, min_split_tokens=16)
    assert _split_plan(len(seq_lens), HKV, BLOCK_SIZE, MAX_BLOCKS, tiling)[1] > 1
    split = _paged_attention(
        q, k8, v8, tables, lens, None, jnp.stack([k_scale, v_scale]), scale=sm, soft_cap=5.0,
        sliding_window=None, interpret=interpret, tiling=tiling,
    )  # fmt: skip
    capped = paged_attention_reference(q, k8_c, v8_c, lens, scale=sm, soft_cap=5.0, **scales)
    assert_close(split, capped, F32_TOL)
    # Against float32 K/V: within the bound that the FP8 rounding allows, and not exact.
    exact = paged_attention_reference(q, k, v, lens, scale=sm)
    k_deq, v_deq = dequantize_kv(k8_c, k_scale), dequantize_kv(v8_c, v_scale)
    check_within_fp8_bound(out, exact, q, k, v, k_deq, v_deq, range(len(seq_lens)), lens, sm)
    assert np.abs(np.asarray(out) - np.asarray(exact)).max() > 0


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_ragged_kernel_reads_fp8_cache_like_its_reference(dtype, interpret):
    rng = np.random.default_rng(1)
    seq_lens, q_lens = mixed_batch(BLOCK_SIZE, MAX_BLOCKS)
    k8, v8, tables, k, v, k8_c, v8_c, k_scale, v_scale = fp8_case(rng, seq_lens, dtype)
    num_tokens = sum(q_lens) + 3  # padding tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, HKV * GROUP, D)), jnp.float32)
    lens, cu = jnp.asarray(seq_lens, jnp.int32), jnp.asarray(cu_of(q_lens))
    options = dict(scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
    out = ragged_paged_attention(q, k8, v8, tables, lens, cu, interpret=interpret, **options)
    assert_close(out, ragged_paged_attention_reference(q, k8_c, v8_c, lens, cu, **options), F32_TOL)
    exact = ragged_paged_attention_reference(q, k, v, lens, cu, scale=D**-0.5)
    k_deq, v_deq = dequantize_kv(k8_c, k_scale), dequantize_kv(v8_c, v_scale)
    real = sum(q_lens)
    seq_of_row = np.repeat(np.arange(len(q_lens)), q_lens)
    check_within_fp8_bound(
        out[:real], exact[:real], q[:real], k, v, k_deq, v_deq, seq_of_row, lens, D**-0.5
    )
    assert np.all(np.asarray(out[real:]) == 0)  # padding tokens


def test_kv_cache_update_quantizes_with_the_layer_scale_and_saturates():
    cache = jnp.full((2, 4, 1, 2), jnp.nan, jnp.float8_e4m3fn)
    k_new = jnp.asarray([[[1.0, -3.0]], [[1e6, -1e6]]], jnp.float32)  # [T=2, Hkv=1, D=2]
    v_new = jnp.asarray([[[0.5, 0.25]], [[7.0, 9.0]]], jnp.float32)
    slots = jnp.asarray([5, 2], jnp.int32)
    k_cache, v_cache = kv_cache_update(
        cache, cache, k_new, v_new, slots, k_scale=jnp.float32(0.5), v_scale=jnp.float32(2.0)
    )
    k_flat = np.asarray(k_cache.astype(jnp.float32)).reshape(8, 2)
    v_flat = np.asarray(v_cache.astype(jnp.float32)).reshape(8, 2)
    np.testing.assert_array_equal(k_flat[5], [2.0, -6.0])  # k / k_scale
    np.testing.assert_array_equal(k_flat[2], [448.0, -448.0])  # saturated, not NaN
    np.testing.assert_array_equal(v_flat[[5, 2]], [[0.25, 0.125], [3.5, 4.5]])
    assert np.isnan(np.delete(k_flat, [2, 5], axis=0)).all()  # nothing else written


def test_scales_with_a_float_cache_are_refused():
    cache = jnp.zeros((2, 4, 1, 2), jnp.float32)
    new = jnp.zeros((1, 1, 2), jnp.float32)
    with pytest.raises(ValueError, match="k_scale and v_scale apply to an FP8 KV cache only"):
        kv_cache_update(cache, cache, new, new, jnp.zeros(1, jnp.int32), k_scale=2.0)
    q = jnp.zeros((1, 1, 2), jnp.float32)
    tables, lens = jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32)
    with pytest.raises(ValueError, match="float32 cache"):
        paged_attention(q, cache, cache, tables, lens, scale=1.0, v_scale=2.0, interpret=True)
    fp8 = cache.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_scale must be a scalar \(f32\[\]\), got shape \(2,\)"):
        paged_attention(q, fp8, fp8, tables, lens, scale=1.0, k_scale=jnp.ones(2), interpret=True)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_kernels_take_bfloat16_queries(dtype, interpret):
    """The engine's case: bfloat16 queries over an FP8 cache (the 078b2b9 GPU compile failure
    came from this path: a masked FP8 load). Tolerance 2e-2: bfloat16's 8-bit mantissa in q,
    the probabilities and the output, against a float32 reference on the same bf16 inputs."""
    rng = np.random.default_rng(2)
    seq_lens, q_lens = mixed_batch(BLOCK_SIZE, MAX_BLOCKS)
    k8, v8, tables, _, _, k8_c, v8_c, k_scale, v_scale = fp8_case(rng, seq_lens, dtype)
    num_tokens = sum(q_lens) + 3
    q = jnp.asarray(rng.standard_normal((num_tokens, HKV * GROUP, D)), jnp.bfloat16)
    lens, cu = jnp.asarray(seq_lens, jnp.int32), jnp.asarray(cu_of(q_lens))
    options = dict(scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
    out = ragged_paged_attention(q, k8, v8, tables, lens, cu, interpret=interpret, **options)
    expected = ragged_paged_attention_reference(
        q.astype(jnp.float32), k8_c, v8_c, lens, cu, **options
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out.astype(jnp.float32), expected, dict(rtol=2e-2, atol=2e-2))
    decode_q = q[: len(seq_lens)]
    out = paged_attention(decode_q, k8, v8, tables, lens, scale=D**-0.5, interpret=interpret,
                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    expected = paged_attention_reference(
        decode_q.astype(jnp.float32), k8_c, v8_c, lens, scale=D**-0.5, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    assert_close(out.astype(jnp.float32), expected, dict(rtol=2e-2, atol=2e-2))
