"""paged_attention (decode) against its contiguous-K/V reference.

Every case uses random data, a randomly permuted block table whose columns past the used
blocks hold arbitrary valid ids, and NaN in every unused block and every stale slot past
``seq_len``. One batch holds the lengths 1, block_size - 1, block_size, block_size + 1 and the
maximum (max_blocks * block_size), so each call covers all the block-edge cases.

``TestPagedAttention`` runs the kernel in interpret mode on CPU; ``TestPagedAttentionCompiled``
reruns the same cases compiled (Pallas Triton) when a GPU is present.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention import DecodeTiling, _paged_attention, _split_plan

# float32: kernel and reference differ only in summation order (online vs. two-pass softmax).
F32_TOL = dict(rtol=1e-4, atol=1e-5)
# bfloat16: both sides see the same bf16 inputs (the reference upcasts them to f32), but the
# kernel rounds the probabilities to bf16 before the P.V dot and rounds its output to bf16.
# bf16 keeps 8 mantissa bits, i.e. ~2**-8 = 3.9e-3 relative per rounding; outputs are O(1)
# (convex combinations of N(0, 1) values, |out| < ~3), so 2e-2 absolute covers two roundings.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def edge_lengths(block_size: int, max_blocks: int) -> list[int]:
    """1, block_size - 1, block_size, block_size + 1 and the maximum, without duplicates."""
    lengths = [1, block_size - 1, block_size, block_size + 1, max_blocks * block_size]
    return list(dict.fromkeys(n for n in lengths if n >= 1))


def make_paged_kv(
    rng, seq_lens, *, num_kv_heads, head_dim, block_size, max_blocks, dtype=np.float32
):
    """Random paged K/V caches, block tables and the same K/V gathered contiguously.

    Returns (k_cache, v_cache, block_tables, k_contiguous, v_contiguous), with caches
    [num_blocks, block_size, Hkv, D] whose unused blocks and stale slots are NaN, and
    contiguous K/V [B, max_blocks * block_size, Hkv, D] gathered through the tables.
    """
    seq_lens = [int(n) for n in seq_lens]
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + 3  # three spare blocks that no sequence uses
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    # Columns past a sequence's used blocks: arbitrary valid ids, possibly other sequences'.
    tables = rng.integers(0, num_blocks, (len(seq_lens), max_blocks)).astype(np.int32)
    stale = np.ones((num_blocks, block_size), bool)
    free_ids = iter(rng.permutation(num_blocks))
    for b, length in enumerate(seq_lens):
        for i in range(used[b]):
            block = next(free_ids)
            tables[b, i] = block
            stale[block, : min(block_size, length - i * block_size)] = False
    k_cache[stale] = np.nan
    v_cache[stale] = np.nan
    k_cache = jnp.asarray(k_cache, dtype)
    v_cache = jnp.asarray(v_cache, dtype)
    contiguous = (len(seq_lens), max_blocks * block_size, num_kv_heads, head_dim)
    k_contiguous = k_cache[tables].reshape(contiguous)
    v_contiguous = v_cache[tables].reshape(contiguous)
    return k_cache, v_cache, jnp.asarray(tables), k_contiguous, v_contiguous


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


# ``interpret`` values for a kernel test: interpreted everywhere; compiled (Pallas Triton) where a
# GPU is present.
INTERPRET_MODES = [
    True,
    pytest.param(
        False,
        marks=pytest.mark.skipif(
            jax.default_backend() != "gpu", reason="compiled Pallas (Triton) kernels need a GPU"
        ),
    ),
]


def assert_close(actual, expected, tol):
    actual = np.asarray(actual, np.float32)
    assert np.all(np.isfinite(actual)), "kernel output has NaN/inf"
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), **tol)


def random_alibi_slopes(rng, num_q_heads: int) -> jnp.ndarray:
    """``f32[Hq]`` distinct positive slopes (real ones are ``2 ** -k``, BLOOM's up to 0.7):
    large enough that a wrong sign or position shows in the output."""
    return jnp.asarray(rng.uniform(0.05, 0.8, num_q_heads), jnp.float32)


def poison_blocks_before(k_cache, v_cache, tables, first_visible, block_size):
    """Copies of the caches with NaN in every block of sequence ``b`` that lies wholly before
    position ``first_visible[b]`` (blocks inside ``seq_len`` but outside a sliding window)."""
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    tables = np.asarray(tables)
    poisoned = 0
    for b, first in enumerate(first_visible):
        for column in range(max(int(first), 0) // block_size):
            k_cache[tables[b, column]] = np.nan
            v_cache[tables[b, column]] = np.nan
            poisoned += 1
    assert poisoned > 0, "the case poisons no block: it would test nothing"
    return jnp.asarray(k_cache), jnp.asarray(v_cache)


class TestPagedAttention:
    INTERPRET = True

    def run_case(
        self,
        *,
        num_kv_heads,
        group,
        head_dim,
        block_size,
        max_blocks,
        seed=0,
        dtype=np.float32,
        soft_cap=None,
        sliding_window=None,
        alibi=False,
        seq_lens=None,
    ):
        rng = np.random.default_rng(seed)
        if seq_lens is None:
            seq_lens = edge_lengths(block_size, max_blocks)
        k_cache, v_cache, tables, k, v = make_paged_kv(
            rng,
            seq_lens,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            max_blocks=max_blocks,
            dtype=dtype,
        )
        q = jnp.asarray(rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim)), dtype)
        lens = jnp.asarray(seq_lens, jnp.int32)
        options = dict(scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=sliding_window)
        if alibi:
            options["alibi_slopes"] = random_alibi_slopes(rng, q.shape[1])
        out = paged_attention(
            q, k_cache, v_cache, tables, lens, interpret=self.INTERPRET, **options
        )
        expected = paged_attention_reference(q, k, v, lens, **options)
        assert out.shape == q.shape and out.dtype == q.dtype
        return out, expected

    @pytest.mark.parametrize(
        "num_kv_heads, group, head_dim, block_size, max_blocks",
        [
            (2, 1, 64, 16, 3),  # MHA
            (2, 2, 128, 8, 4),
            (1, 4, 64, 32, 2),
            (1, 7, 8, 16, 3),  # odd group, tiny head dim (the stories model's D)
            (2, 7, 128, 16, 3),  # Qwen2.5-7B's group: head 1's rows start mid-tile
            (2, 8, 16, 8, 5),
            (3, 2, 8, 32, 2),
        ],
    )
    def test_matches_reference_across_gqa_head_dim_and_block_size(
        self, num_kv_heads, group, head_dim, block_size, max_blocks
    ):
        out, expected = self.run_case(
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            max_blocks=max_blocks,
        )
        assert_close(out, expected, F32_TOL)

    @pytest.mark.parametrize("soft_cap, sliding_window", [(None, 7), (2.0, 20)])
    def test_soft_cap_and_sliding_window_match_reference(self, soft_cap, sliding_window):
        out, expected = self.run_case(
            num_kv_heads=2,
            group=2,
            head_dim=64,
            block_size=8,
            max_blocks=4,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            seed=1,
        )
        assert_close(out, expected, F32_TOL)

    @pytest.mark.parametrize(
        "num_kv_heads, group, soft_cap, sliding_window",
        [(6, 1, None, None), (2, 3, 3.0, 11)],  # 6 heads: BLOOM's non-power-of-two count
    )
    def test_alibi_matches_reference(self, num_kv_heads, group, soft_cap, sliding_window):
        out, expected = self.run_case(
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=16,
            block_size=8,
            max_blocks=4,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            alibi=True,
            seed=9,
        )
        assert_close(out, expected, F32_TOL)

    def test_alibi_reference_matches_naive_formula(self):
        # softmax(q.k * scale + slope * (pos - (seq_len - 1))) . v, one head at a time in numpy.
        rng = np.random.default_rng(10)
        seq_lens = [1, 7, 12]
        q = rng.standard_normal((3, 2, 8)).astype(np.float32)
        k = rng.standard_normal((3, 12, 1, 8)).astype(np.float32)
        v = rng.standard_normal((3, 12, 1, 8)).astype(np.float32)
        slopes = np.array([0.5, 0.125], np.float32)
        expected = np.zeros(q.shape)
        for b, n in enumerate(seq_lens):
            for h in range(2):
                s = k[b, :n, 0] @ q[b, h] * 0.3 + slopes[h] * (np.arange(n) - (n - 1))
                w = np.exp(s - s.max())
                expected[b, h] = w @ v[b, :n, 0] / w.sum()
        out = paged_attention_reference(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seq_lens, jnp.int32),
            scale=0.3, alibi_slopes=jnp.asarray(slopes),
        )  # fmt: skip
        assert_close(out, expected, F32_TOL)

    def test_sliding_window_never_reads_blocks_outside_the_window(self):
        # Every block wholly before a sequence's window is NaN, although it lies inside
        # seq_len; 16-key steps over blocks of 4 and 16-token splits put whole steps and whole
        # splits before the window as well as a step that straddles its start.
        rng = np.random.default_rng(11)
        block_size, window = 4, 6
        seq_lens = [9, 13, 31, 40]
        k_cache, v_cache, tables, k, v = make_paged_kv(
            rng, seq_lens, num_kv_heads=2, head_dim=16, block_size=block_size, max_blocks=10
        )
        k_poisoned, v_poisoned = poison_blocks_before(
            k_cache, v_cache, tables, [n - window for n in seq_lens], block_size
        )
        q = jnp.asarray(rng.standard_normal((4, 4, 16)), jnp.float32)
        lens = jnp.asarray(seq_lens, jnp.int32)
        options = dict(scale=0.25, soft_cap=None, sliding_window=window)
        tiling = DecodeTiling(block_k=16, target_programs=64, min_split_tokens=16)
        assert _split_plan(4, 2, block_size, 10, tiling)[1] > 1
        out = _paged_attention(
            q, k_poisoned, v_poisoned, tables, lens, interpret=self.INTERPRET, tiling=tiling,
            **options,
        )  # fmt: skip
        assert_close(out, paged_attention_reference(q, k, v, lens, **options), F32_TOL)
        public = paged_attention(
            q, k_poisoned, v_poisoned, tables, lens, interpret=self.INTERPRET, **options
        )
        assert_close(public, paged_attention_reference(q, k, v, lens, **options), F32_TOL)

    def test_sliding_window_ignores_keys_outside_the_window(self):
        # With a window of 1 each query sees only its own position: out == v[seq_len - 1].
        rng = np.random.default_rng(2)
        seq_lens = [5, 16, 17]
        k_cache, v_cache, tables, _, v = make_paged_kv(
            rng, seq_lens, num_kv_heads=1, head_dim=16, block_size=8, max_blocks=3
        )
        q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            jnp.asarray(seq_lens, jnp.int32),
            scale=0.25,
            sliding_window=1,
            interpret=self.INTERPRET,
        )
        last = np.stack([np.asarray(v)[b, n - 1, 0] for b, n in enumerate(seq_lens)])
        assert_close(out, np.repeat(last[:, None], 2, axis=1), F32_TOL)

    @pytest.mark.parametrize("group, head_dim", [(4, 64), (7, 128), (1, 8)])
    def test_bfloat16_matches_reference_on_same_inputs(self, group, head_dim):
        out, expected = self.run_case(
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            block_size=16,
            max_blocks=3,
            dtype=jnp.bfloat16,
            seed=3,
        )
        assert_close(out, expected, BF16_TOL)

    def test_nan_in_unused_blocks_does_not_leak(self):
        # Same live data, stale slots NaN in one run and huge finite values in the other:
        # the outputs must be finite and identical.
        rng = np.random.default_rng(4)
        seq_lens = [3, 9, 16]
        k_cache, v_cache, tables, _, _ = make_paged_kv(
            rng, seq_lens, num_kv_heads=2, head_dim=16, block_size=8, max_blocks=3
        )
        q = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
        lens = jnp.asarray(seq_lens, jnp.int32)

        def run(k, v):
            return paged_attention(q, k, v, tables, lens, scale=0.25, interpret=self.INTERPRET)

        with_nan = run(k_cache, v_cache)
        k_big = jnp.where(jnp.isnan(k_cache), 1e4, k_cache)
        v_big = jnp.where(jnp.isnan(v_cache), -1e4, v_cache)
        assert np.all(np.isfinite(np.asarray(with_nan)))
        np.testing.assert_array_equal(np.asarray(with_nan), np.asarray(run(k_big, v_big)))

    def test_padding_row_with_zero_length_returns_zeros(self):
        out, expected = self.run_case(
            num_kv_heads=1,
            group=2,
            head_dim=16,
            block_size=8,
            max_blocks=2,
            seq_lens=[0, 5, 0],
            seed=5,
        )
        assert_close(out, expected, F32_TOL)
        np.testing.assert_array_equal(np.asarray(out)[[0, 2]], 0.0)

    @pytest.mark.parametrize("num_splits", [1, 3, 5])
    def test_split_count_does_not_change_result(self, num_splits):
        # 16-token steps over 10 blocks of 8: 5 steps, cut into 1, 3 (2+2+1) or 5 splits; the
        # lengths end inside, on and just past step and split edges.
        rng = np.random.default_rng(6)
        seq_lens = [1, 15, 33, 80, 48]
        k_cache, v_cache, tables, k, v = make_paged_kv(
            rng, seq_lens, num_kv_heads=2, head_dim=16, block_size=8, max_blocks=10
        )
        q = jnp.asarray(rng.standard_normal((5, 4, 16)), jnp.float32)
        lens = jnp.asarray(seq_lens, jnp.int32)
        tiling = DecodeTiling(block_k=16, target_programs=5 * 2 * num_splits, min_split_tokens=16)
        assert _split_plan(5, 2, 8, 10, tiling) == (2, num_splits)
        out = _paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            scale=0.25,
            soft_cap=None,
            sliding_window=None,
            interpret=self.INTERPRET,
            tiling=tiling,
        )
        assert_close(out, paged_attention_reference(q, k, v, lens, scale=0.25), F32_TOL)

    def test_table_width_not_a_multiple_of_the_step(self):
        # 3 blocks of 8 per row, 32-token steps: the second half of the last step's table
        # columns do not exist and must not be read.
        out, expected = self.run_case(
            num_kv_heads=1, group=4, head_dim=16, block_size=8, max_blocks=3, seed=8
        )
        assert_close(out, expected, F32_TOL)

    @pytest.mark.parametrize(
        "case, match",
        [
            ("kv_mismatch", "k_cache and v_cache"),
            ("heads", "multiple of Hkv"),
            ("batch", "block_tables"),
            ("len_dtype", "int32"),
            ("table_dtype", "int32"),
            ("head_dim", "D="),
            ("window", "sliding_window"),
            ("alibi_shape", "alibi_slopes"),
            ("alibi_dtype", "alibi_slopes"),
        ],
    )
    def test_bad_arguments_raise_value_error(self, case, match):
        q = jnp.ones((2, 4, 16), jnp.float32)
        k_cache = v_cache = jnp.ones((4, 8, 2, 16), jnp.float32)
        tables = jnp.zeros((2, 3), jnp.int32)
        lens = jnp.array([3, 4], jnp.int32)
        options = dict(scale=0.25)
        if case == "kv_mismatch":
            v_cache = jnp.ones((4, 8, 1, 16), jnp.float32)
        elif case == "heads":
            q = jnp.ones((2, 3, 16), jnp.float32)
        elif case == "batch":
            tables = jnp.zeros((3, 3), jnp.int32)
        elif case == "len_dtype":
            lens = lens.astype(jnp.float32)
        elif case == "table_dtype":
            tables = tables.astype(jnp.uint32)
        elif case == "head_dim":
            q = jnp.ones((2, 4, 8), jnp.float32)
        elif case == "alibi_shape":
            options["alibi_slopes"] = jnp.ones((2,), jnp.float32)
        elif case == "alibi_dtype":
            options["alibi_slopes"] = jnp.ones((4,), jnp.bfloat16)
        else:
            options["sliding_window"] = 0
        with pytest.raises(ValueError, match=match):
            paged_attention(q, k_cache, v_cache, tables, lens, interpret=True, **options)


@pytest.mark.skipif(not has_gpu(), reason="compiled Pallas (Triton) kernels need a GPU")
class TestPagedAttentionCompiled(TestPagedAttention):
    INTERPRET = False
