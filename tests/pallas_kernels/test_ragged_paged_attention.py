"""ragged_paged_attention (prefill / mixed batches) against its contiguous-K/V reference.

Each batch mixes a decode (q_len 1), a prefill from scratch (q_len == seq_len), chunked
prefills on top of a cached prefix, a padding sequence (q_len == seq_len == 0) and padding
tokens after cu_q_lens[B]. Context lengths are 1, block_size - 1, block_size, block_size + 1 and
the maximum; block tables are randomly permuted and unused blocks / stale slots are NaN (see
``make_paged_kv``). ``TestRaggedPagedAttention`` runs in interpret mode on CPU;
``TestRaggedPagedAttentionCompiled`` reruns the cases compiled when a GPU is present.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    paged_attention,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention import RaggedTiling, _ragged_paged_attention
from tests.pallas_kernels.test_paged_attention import (
    BF16_TOL,
    F32_TOL,
    assert_close,
    has_gpu,
    make_paged_kv,
    poison_blocks_before,
    random_alibi_slopes,
)

NUM_PADDING_TOKENS = 3


def mixed_batch(block_size: int, max_blocks: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): decode, short chunk, full prefill, prefill, long chunk, padding."""
    max_len = max_blocks * block_size
    seq_lens = [1, block_size - 1, block_size, block_size + 1, max_len, 0]
    q_lens = [1, 2, block_size, block_size + 1, block_size + 3, 0]
    return seq_lens, q_lens


def cu_of(q_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def naive_ragged_attention(
    q, k, v, seq_lens, q_lens, scale, *, alibi_slopes=None, sliding_window=None
):
    """Token-by-token numpy loop, to check the reference itself."""
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // k.shape[2]
    cu = cu_of(q_lens)
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for i in range(q_len):
            t, pos = cu[b] + i, seq_len - q_len + i
            for head in range(q.shape[1]):
                start = 0 if sliding_window is None else max(0, pos + 1 - sliding_window)
                keys = k[b, start : pos + 1, head // group].astype(np.float64)
                scores = keys @ q[t, head].astype(np.float64) * scale
                if alibi_slopes is not None:
                    scores += alibi_slopes[head] * (np.arange(start, pos + 1) - pos)
                weights = np.exp(scores - scores.max())
                out[t, head] = weights @ v[b, start : pos + 1, head // group] / weights.sum()
    return out


class TestRaggedPagedAttention:
    INTERPRET = True

    def make_case(
        self,
        *,
        num_kv_heads,
        group,
        head_dim,
        block_size,
        max_blocks,
        seed=0,
        dtype=np.float32,
        seq_lens=None,
        q_lens=None,
    ):
        rng = np.random.default_rng(seed)
        if seq_lens is None:
            seq_lens, q_lens = mixed_batch(block_size, max_blocks)
        k_cache, v_cache, tables, k, v = make_paged_kv(
            rng,
            seq_lens,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            max_blocks=max_blocks,
            dtype=dtype,
        )
        num_tokens = sum(q_lens) + NUM_PADDING_TOKENS
        q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
        lens = jnp.asarray(seq_lens, jnp.int32)
        cu = jnp.asarray(cu_of(q_lens))
        return q, k_cache, v_cache, tables, lens, cu, k, v

    def run_case(self, *, soft_cap=None, sliding_window=None, alibi=False, **case):
        q, k_cache, v_cache, tables, lens, cu, k, v = self.make_case(**case)
        options = dict(scale=q.shape[-1] ** -0.5, soft_cap=soft_cap, sliding_window=sliding_window)
        if alibi:
            rng = np.random.default_rng(case.get("seed", 0) + 100)
            options["alibi_slopes"] = random_alibi_slopes(rng, q.shape[1])
        out = ragged_paged_attention(
            q, k_cache, v_cache, tables, lens, cu, interpret=self.INTERPRET, **options
        )
        expected = ragged_paged_attention_reference(q, k, v, lens, cu, **options)
        assert out.shape == q.shape and out.dtype == q.dtype
        return out, expected

    @pytest.mark.parametrize(
        "num_kv_heads, group, head_dim, block_size, max_blocks",
        [
            (2, 1, 64, 16, 3),  # MHA
            (1, 2, 128, 8, 4),
            (1, 4, 64, 32, 2),
            (1, 7, 8, 16, 3),  # odd group, tiny head dim (the stories model's D)
            (2, 7, 128, 16, 3),  # Qwen2.5-7B's group: head 1's rows start mid-tile
            (2, 8, 16, 8, 3),
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

    @pytest.mark.parametrize("soft_cap, sliding_window", [(5.0, None), (2.0, 6)])
    def test_soft_cap_and_sliding_window_match_reference(self, soft_cap, sliding_window):
        out, expected = self.run_case(
            num_kv_heads=2,
            group=2,
            head_dim=32,
            block_size=8,
            max_blocks=4,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            seed=1,
        )
        assert_close(out, expected, F32_TOL)

    @pytest.mark.parametrize(
        "num_kv_heads, group, soft_cap, sliding_window",
        [(6, 1, None, None), (2, 3, 3.0, 6)],  # 6 heads: BLOOM's non-power-of-two count
    )
    def test_alibi_matches_reference(self, num_kv_heads, group, soft_cap, sliding_window):
        out, expected = self.run_case(
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=16,
            block_size=8,
            max_blocks=3,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            alibi=True,
            seed=8,
        )
        assert_close(out, expected, F32_TOL)

    def test_sliding_window_never_reads_blocks_outside_the_window(self):
        # Every block wholly before the window of a sequence's first new token is NaN, though
        # inside seq_len. 16-key steps over blocks of 4 make the first step of a tile straddle
        # the window's start, holding poisoned blocks next to visible ones; 16-row tiles split
        # the 20-token chunk, so its second tile's window starts later than the first's.
        block_size, window = 4, 6
        seq_lens, q_lens = [13, 40, 31, 0], [1, 20, 5, 0]
        q, k_cache, v_cache, tables, lens, cu, k, v = self.make_case(
            num_kv_heads=1, group=2, head_dim=16, block_size=block_size, max_blocks=10,
            seed=9, seq_lens=seq_lens, q_lens=q_lens,
        )  # fmt: skip
        first_visible = [n - m + 1 - window for n, m in zip(seq_lens, q_lens, strict=True)]
        k_poisoned, v_poisoned = poison_blocks_before(
            k_cache, v_cache, tables, first_visible, block_size
        )
        options = dict(scale=0.25, soft_cap=None, sliding_window=window)
        out = _ragged_paged_attention(
            q, k_poisoned, v_poisoned, tables, lens, cu, interpret=self.INTERPRET,
            tiling=RaggedTiling(rows=32, block_k=16), **options,
        )  # fmt: skip
        expected = ragged_paged_attention_reference(q, k, v, lens, cu, **options)
        assert_close(out, expected, F32_TOL)

    def test_bfloat16_matches_reference_on_same_inputs(self):
        out, expected = self.run_case(
            num_kv_heads=2,
            group=4,
            head_dim=64,
            block_size=16,
            max_blocks=3,
            dtype=jnp.bfloat16,
            seed=2,
        )
        assert_close(out, expected, BF16_TOL)

    def test_padding_tokens_return_zeros(self):
        out, _ = self.run_case(
            num_kv_heads=1, group=2, head_dim=16, block_size=8, max_blocks=2, seed=3
        )
        padding = np.asarray(out)[-NUM_PADDING_TOKENS:]
        np.testing.assert_array_equal(padding, 0.0)

    def test_nan_in_unused_blocks_does_not_leak(self):
        # Stale slots NaN in one run, huge finite values in the other: same finite output.
        q, k_cache, v_cache, tables, lens, cu, _, _ = self.make_case(
            num_kv_heads=2, group=2, head_dim=16, block_size=8, max_blocks=3, seed=4
        )

        def run(k, v):
            return ragged_paged_attention(
                q, k, v, tables, lens, cu, scale=0.25, interpret=self.INTERPRET
            )

        with_nan = run(k_cache, v_cache)
        k_big = jnp.where(jnp.isnan(k_cache), 1e4, k_cache)
        v_big = jnp.where(jnp.isnan(v_cache), -1e4, v_cache)
        assert np.all(np.isfinite(np.asarray(with_nan)))
        np.testing.assert_array_equal(np.asarray(with_nan), np.asarray(run(k_big, v_big)))

    def test_sequence_spanning_several_query_tiles(self):
        # 32 rows of 2 heads = 16-token tiles split the 37- and 20-token chunks over 3 and 2
        # tiles; 16-key steps put the tiles' diagonals inside a step and on step edges.
        q, k_cache, v_cache, tables, lens, cu, k, v = self.make_case(
            num_kv_heads=1,
            group=2,
            head_dim=16,
            block_size=8,
            max_blocks=6,
            seed=5,
            seq_lens=[40, 1, 20],
            q_lens=[37, 1, 20],
        )
        out = _ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            cu,
            scale=0.25,
            soft_cap=None,
            sliding_window=None,
            interpret=self.INTERPRET,
            tiling=RaggedTiling(rows=32, block_k=16),
        )
        assert_close(out, ragged_paged_attention_reference(q, k, v, lens, cu, scale=0.25), F32_TOL)

    def test_last_token_of_each_sequence_matches_decode_kernel(self):
        q, k_cache, v_cache, tables, lens, cu, _, _ = self.make_case(
            num_kv_heads=2,
            group=2,
            head_dim=16,
            block_size=8,
            max_blocks=3,
            seed=6,
            seq_lens=[1, 9, 24],
            q_lens=[1, 4, 7],
        )
        slopes = random_alibi_slopes(np.random.default_rng(0), 4)
        options = dict(scale=0.25, sliding_window=5, alibi_slopes=slopes, interpret=self.INTERPRET)
        ragged = ragged_paged_attention(q, k_cache, v_cache, tables, lens, cu, **options)
        last = np.asarray(cu)[1:] - 1
        decode = paged_attention(q[last], k_cache, v_cache, tables, lens, **options)
        assert_close(np.asarray(ragged)[last], decode, F32_TOL)

    def test_reference_matches_naive_token_loop(self):
        seq_lens, q_lens = mixed_batch(block_size=8, max_blocks=3)
        q, _, _, _, lens, cu, k, v = self.make_case(
            num_kv_heads=2, group=2, head_dim=8, block_size=8, max_blocks=3, seed=7
        )
        expected = naive_ragged_attention(
            np.asarray(q), np.asarray(k), np.asarray(v), seq_lens, q_lens, scale=0.3
        )
        out = ragged_paged_attention_reference(q, k, v, lens, cu, scale=0.3)
        assert_close(out, expected, F32_TOL)
        # ALiBi and a sliding window, written independently in the loop.
        slopes = np.array([0.7, 0.25, 0.06, 0.5], np.float32)
        expected = naive_ragged_attention(
            np.asarray(q), np.asarray(k), np.asarray(v), seq_lens, q_lens, scale=0.3,
            alibi_slopes=slopes, sliding_window=5,
        )  # fmt: skip
        out = ragged_paged_attention_reference(
            q, k, v, lens, cu, scale=0.3, alibi_slopes=jnp.asarray(slopes), sliding_window=5
        )
        assert_close(out, expected, F32_TOL)

    @pytest.mark.parametrize(
        "case, match",
        [
            ("kv_mismatch", "k_cache and v_cache"),
            ("heads", "multiple of Hkv"),
            ("cu_length", "cu_q_lens"),
            ("cu_dtype", "int32"),
            ("soft_cap", "soft_cap"),
        ],
    )
    def test_bad_arguments_raise_value_error(self, case, match):
        q = jnp.ones((6, 4, 16), jnp.float32)
        k_cache = v_cache = jnp.ones((4, 8, 2, 16), jnp.float32)
        tables = jnp.zeros((2, 3), jnp.int32)
        lens = jnp.array([3, 4], jnp.int32)
        cu = jnp.array([0, 2, 5], jnp.int32)
        options = dict(scale=0.25)
        if case == "kv_mismatch":
            v_cache = jnp.ones((4, 8, 2, 8), jnp.float32)
        elif case == "heads":
            q = jnp.ones((6, 3, 16), jnp.float32)
        elif case == "cu_length":
            cu = cu[:2]
        elif case == "cu_dtype":
            cu = cu.astype(jnp.float32)
        else:
            options["soft_cap"] = -1.0
        with pytest.raises(ValueError, match=match):
            ragged_paged_attention(q, k_cache, v_cache, tables, lens, cu, interpret=True, **options)


@pytest.mark.skipif(not has_gpu(), reason="compiled Pallas (Triton) kernels need a GPU")
class TestRaggedPagedAttentionCompiled(TestRaggedPagedAttention):
    INTERPRET = False
