"""jaxpaged.viz draws what a live engine holds: block states, tables, sharing, preemptions."""

from __future__ import annotations

import sys

import matplotlib
import pytest

from jaxpaged import viz
from jaxpaged.core.kv_cache_snapshot import CACHED, FREE, REFERENCED

matplotlib.use("Agg")

SYSTEM = "Once upon a time, there was a little girl named Lily. She loved to play."


@pytest.fixture(scope="module")
def run():
    """A tiny cache (10 blocks of 8 tokens) that three requests outgrow: the first request's
    prompt blocks are cached before the other two arrive, one of which shares them; the cache
    then runs out and a request is preempted."""
    from jaxpaged import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              block_size=8, num_gpu_blocks_override=10, preemption_mode="recompute",
              enable_compilation_cache=False)  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine.add_request("a", SYSTEM + " One day", params)
    engine.step()
    engine.add_request("b", SYSTEM + " She saw", params)
    engine.add_request("c", "The cat sat", params)
    snapshots = []
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(engine.kv_cache_snapshot())
    return llm, snapshots


def test_snapshots_show_prefix_sharing_and_the_timeline_a_preemption(run):
    llm, snapshots = run
    shared = [s for s in snapshots if {"a", "b"} <= set(s.block_tables)]
    assert shared and shared[0].shared_blocks("a", "b") >= 2
    records = llm.llm_engine.step_history.records()
    assert sum(r.num_preempted for r in records) >= 1
    assert records[0].num_prefill_tokens > 0 and records[0].num_decode_tokens == 0
    assert any(r.num_decode_tokens for r in records)
    after = snapshots[-1]  # all finished: nothing referenced, the prompts' blocks cached
    assert after.count(REFERENCED) == 0 and after.count(CACHED) > 0


def test_block_pool_cells_take_the_colour_of_their_state(run):
    from matplotlib.colors import to_hex

    _, snapshots = run
    snap = next(s for s in snapshots if s.count(REFERENCED) and s.count(FREE) + s.count(CACHED))
    ax = viz.plot_block_pool(snap)
    colors = [to_hex(p.get_facecolor()) for p in ax.patches]
    assert colors == [viz.STATE_COLORS[s] for s in snap.block_states]
    texts = [t.get_text() for t in ax.texts]
    for block, state in enumerate(snap.block_states):
        want = str(snap.ref_counts[block]) if state == REFERENCED else str(block)
        assert texts[block] == want


def test_block_tables_write_physical_ids_and_mark_shared_blocks(run):
    from matplotlib.colors import to_hex

    _, snapshots = run
    snap = next(s for s in snapshots if {"a", "b"} <= set(s.block_tables))
    ax = viz.plot_block_tables(snap)
    cells = [b for t in snap.block_tables.values() for b in t]
    assert [t.get_text() for t in ax.texts] == [str(b) for b in cells]
    shared = [to_hex(p.get_facecolor()) == viz.SHARED_COLOR for p in ax.patches]
    assert shared == [snap.ref_counts[b] > 1 for b in cells] and any(shared)
    sharing = viz.plot_prefix_sharing(snap)
    matrix = sharing.images[0].get_array()
    assert matrix[0, 1] == snap.shared_blocks(*list(snap.block_tables)[:2])


def test_timeline_and_whole_figure_draw_from_the_engine(run):
    llm, _ = run
    records = llm.llm_engine.step_history.records()
    ax = viz.plot_step_timeline(llm)
    assert len(ax.patches) == 2 * len(records)  # prefill and decode bar per step
    assert any("preempted" in t.get_text() for t in ax.texts)
    fig = viz.plot_engine(llm)  # finished: tables and sharing say so instead of drawing
    assert any(t.get_text() == "no running sequences" for a in fig.axes for t in a.texts)


def test_missing_matplotlib_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="jaxpaged.viz needs matplotlib.*pip install"):
        viz.plot_engine([])


def test_profile_writes_a_trace_and_refuses_misuse(run, tmp_path):
    llm, _ = run
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile(str(tmp_path))
    llm.generate("Once", use_tqdm=False)
    assert llm.stop_profile() == str(tmp_path)
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
