"""``pallas_kernels.lora_bgmv`` (interpreted; compiled on a GPU) against ``models.lora``'s
per-token reference and its dense path, on fused (qkv-like, 3 parts) slot layouts built by
``jaxpaged.lora.slots``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import pallas_kernels.lora_bgmv
from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.slots import adapter_slot_arrays
from models.lora import ProjectionSpec, lora_delta, lora_delta_reference
from pallas_kernels.lora_bgmv import BGMVTiling, lora_bgmv
from tests.pallas_kernels.test_paged_attention import INTERPRET_MODES

# in 40 (not a power of two: a masked tail in the K tiles), parts 24 + 8 + 8 = 40 out
# columns, max rank 8 over 3 parts: C = 24 (no power of two; read as a masked 32-wide tile).
SPEC = ProjectionSpec(40, (24, 8, 8))
MAX_RANK = 8
RANKS = (8, 3, 5)  # one adapter per slot; slot ranks below the max leave zero columns
INTERPRET = INTERPRET_MODES


def _slots(rng):
    """Per slot: the unpadded ``A [in, P*r]`` and block-diagonal ``B [P*r, out]`` (reference
    operands) and the padded slot arrays stacked into ``a [in, S*C]``, ``b [S*C, out]``."""
    a_list, b_list, a_cols, b_rows = [], [], [], []
    for rank in RANKS:
        parts = {
            (0, module): (
                rng.normal(size=(SPEC.in_features, rank)).astype(np.float32),
                rng.normal(size=(rank, size)).astype(np.float32) / rank,
            )
            for module, size in zip(("q_proj", "k_proj", "v_proj"), SPEC.part_sizes, strict=True)
        }
        a_list.append(np.concatenate([a for a, _ in parts.values()], axis=1))
        b_list.append(scipy.linalg.block_diag(*[b for _, b in parts.values()]))
        a, b = adapter_slot_arrays(LoRAAdapter(rank, 1.0, parts), {"qkv_proj": SPEC}, 1, MAX_RANK)[
            0
        ]["qkv_proj"]
        a_cols.append(a)
        b_rows.append(b)
    return a_list, b_list, np.concatenate(a_cols, axis=1), np.concatenate(b_rows, axis=0)


# Default tiles (one program at these sizes) and 16-wide tiles: at T = 20 two token tiles,
# three output tiles and three shrink steps, each with a masked tail.
@pytest.mark.parametrize(
    "num_tokens, tiling",
    [
        (1, None),
        (3, None),
        (16, None),
        (20, None),
        (20, BGMVTiling(16, 16, 16)),
    ],
)
@pytest.mark.parametrize("interpret", INTERPRET)
def test_float32_matches_the_per_token_reference_and_the_dense_path(
    num_tokens, tiling, interpret, monkeypatch
):
    if tiling is not None:
        monkeypatch.setattr(pallas_kernels.lora_bgmv, "_TILING", tiling)
    rng = np.random.default_rng(num_tokens)
    a_list, b_list, a, b = _slots(rng)
    x = rng.normal(size=(num_tokens, SPEC.in_features)).astype(np.float32)
    token_slots = rng.integers(-1, len(RANKS), num_tokens).astype(np.int32)
    token_slots[-1] = -1
    args = (jnp.asarray(x), jnp.asarray(token_slots), jnp.asarray(a), jnp.asarray(b))
    got = np.asarray(lora_bgmv(*args, max_loras=len(RANKS), interpret=interpret))
    assert got.shape == (num_tokens, SPEC.out_features) and got.dtype == np.float32
    expected = lora_delta_reference(x, token_slots, a_list, b_list)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    dense = np.asarray(lora_delta(*args, max_loras=len(RANKS), path="dense"))
    np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4 * scale)
    assert not got[token_slots == -1].any()


@pytest.mark.parametrize("interpret", INTERPRET)
def test_bfloat16_within_a_few_ulps_of_the_float32_reference(interpret):
    rng = np.random.default_rng(7)
    a_list, b_list, a, b = _slots(rng)
    num_tokens = 20  # every slot and -1 present in the one token tile
    x = rng.normal(size=(num_tokens, SPEC.in_features)).astype(np.float32)
    token_slots = (np.arange(num_tokens) % (len(RANKS) + 1) - 1).astype(np.int32)
    args = [jnp.asarray(v, jnp.bfloat16) for v in (x, a, b)]
    got = lora_bgmv(args[0], jnp.asarray(token_slots), *args[1:], max_loras=len(RANKS),
                    interpret=interpret)  # fmt: skip
    assert got.dtype == jnp.bfloat16
    # Reference from the bf16-rounded operands, in float32. The kernel rounds x @ A to bf16
    # before the expand (as the dense path does) and its output to bf16: each a relative
    # 2^-8 step, so 2e-2 of the output's scale bounds both with room for the summation order.
    round_trip = [np.asarray(v.astype(jnp.float32)) for v in args]
    a_bf, b_bf = round_trip[1], round_trip[2]
    cols = a.shape[1] // len(RANKS)
    a_slots = [a_bf[:, s * cols : (s + 1) * cols] for s in range(len(RANKS))]
    b_slots = [b_bf[s * cols : (s + 1) * cols] for s in range(len(RANKS))]
    expected = lora_delta_reference(round_trip[0], token_slots, a_slots, b_slots)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=2e-2 * scale)
    assert not np.asarray(got, np.float32)[token_slots == -1].any()


def test_bad_shapes_are_refused_by_name():
    x, slots = jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32)
    a, b = jnp.zeros((8, 32)), jnp.zeros((32, 4))
    cases = [
        (dict(x=jnp.zeros(8)), "x must be"),
        (dict(token_slots=jnp.zeros(3, jnp.int32)), "token_slots must be"),
        (dict(token_slots=jnp.zeros(2, jnp.float32)), "token_slots must be"),
        (dict(a=jnp.zeros((9, 32))), "a must be"),
        (dict(b=jnp.zeros((16, 4))), "b must be"),
        (dict(max_loras=3), "max_loras must be"),
        (dict(max_loras=0), "max_loras must be"),
    ]
    for change, message in cases:
        kwargs = dict(x=x, token_slots=slots, a=a, b=b, max_loras=2) | change
        with pytest.raises(ValueError, match=message):
            lora_bgmv(**kwargs, interpret=True)
