"""Pictures of a live engine's internals (matplotlib): the block pool, block tables, prefix
sharing and the step timeline.

Every function takes an ``LLM``, an ``LLMEngine`` or an already taken snapshot
(``LLMEngine.kv_cache_snapshot()``, ``LLMEngine.step_history.records()``), draws on ``ax`` (a new
figure when None) and returns the axes. Only public engine methods are read. matplotlib is an
optional dependency (``pip install matplotlib``); importing this module does not import it.

    from jaxpaged import viz
    viz.plot_engine(llm).savefig("engine.png")
"""

from __future__ import annotations

import math
from typing import Any

from jaxpaged.core.kv_cache_snapshot import CACHED, FREE, REFERENCED, KVCacheSnapshot
from jaxpaged.core.step_history import StepRecord

STATE_COLORS = {FREE: "#e6e6e6", CACHED: "#f2b134", REFERENCED: "#3b7dd8"}
SHARED_COLOR = "#7b3fb8"  # a block held by more than one table
PREFILL_COLOR, DECODE_COLOR, PREEMPT_COLOR = "#3b7dd8", "#59b36b", "#d9453b"
# Cells get their text (ref count, block id) only while they stay legible.
_MAX_ANNOTATED_BLOCKS = 400


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "jaxpaged.viz needs matplotlib, which is not installed: pip install matplotlib"
        ) from error
    return plt


def _engine(source: Any):
    return getattr(source, "llm_engine", source)


def _snapshot(source: Any) -> KVCacheSnapshot:
    if isinstance(source, KVCacheSnapshot):
        return source
    return _engine(source).kv_cache_snapshot()


def _records(source: Any) -> list[StepRecord]:
    if isinstance(source, list):
        return source
    return _engine(source).step_history.records()


def _axes(ax, figsize: tuple[float, float]):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=figsize, layout="constrained")
    return ax


def plot_block_pool(source: Any, ax=None, *, columns: int | None = None):
    """The device block pool as a grid: one cell per block id (row-major), coloured free /
    cached (evictable, keeps its prefix hash) / referenced, with the ref count written in
    referenced cells."""
    from matplotlib.patches import Patch

    snap = _snapshot(source)
    n = snap.num_blocks
    columns = columns or max(8, math.ceil(math.sqrt(n * 2)))
    rows = math.ceil(n / columns)
    ax = _axes(ax, (max(7, columns * 0.75), rows * 0.75 + 1.2))
    annotate = n <= _MAX_ANNOTATED_BLOCKS
    for block, state in enumerate(snap.block_states):
        r, c = divmod(block, columns)
        ax.add_patch(_cell(c, rows - 1 - r, STATE_COLORS[state]))
        if annotate and snap.ref_counts[block]:
            ax.text(c + 0.5, rows - 0.5 - r, str(snap.ref_counts[block]), ha="center",
                    va="center", color="white", fontsize=11, fontweight="bold")  # fmt: skip
        elif annotate:
            ax.text(c + 0.5, rows - 0.5 - r, str(block), ha="center", va="center",
                    color="#555555", fontsize=8)  # fmt: skip
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    counts = {s: snap.count(s) for s in (FREE, CACHED, REFERENCED)}
    ax.set_title(f"KV block pool: {n} blocks x {snap.block_size} tokens")
    notes = {FREE: "block id", CACHED: "evictable; block id", REFERENCED: "ref count"}
    ax.legend(
        handles=[
            Patch(color=STATE_COLORS[s], label=f"{s}: {counts[s]} ({notes[s]})") for s in counts
        ],
        loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False,
        title="state: count (number in the cell)",
    )  # fmt: skip
    return ax


def plot_block_tables(source: Any, ax=None, *, max_seqs: int = 24):
    """Each sequence's block table as a row: logical block i -> physical block id (written in
    the cell); blocks shared with another table (prefix hits, forks) are highlighted."""
    from matplotlib.patches import Patch

    snap = _snapshot(source)
    tables = list(snap.block_tables.items())[:max_seqs]
    if not tables:
        return _nothing_running(ax, "Block tables")
    width = max((len(t) for _, t in tables), default=1)
    ax = _axes(ax, (max(6, width * 0.55 + 2), max(2, len(tables) * 0.45 + 1.2)))
    for row, (_, table) in enumerate(tables):
        y = len(tables) - 1 - row
        for i, block in enumerate(table):
            shared = snap.ref_counts[block] > 1
            ax.add_patch(_cell(i, y, SHARED_COLOR if shared else STATE_COLORS[REFERENCED]))
            ax.text(i + 0.5, y + 0.5, str(block), ha="center", va="center", color="white",
                    fontsize=8)  # fmt: skip
    ax.set_xlim(0, width)
    ax.set_ylim(0, max(1, len(tables)))
    ax.set_yticks([len(tables) - 0.5 - r for r in range(len(tables))])
    ax.set_yticklabels([f"seq {seq_id}" for seq_id, _ in tables])
    ax.set_xticks([i + 0.5 for i in range(width)])
    ax.set_xticklabels([str(i) for i in range(width)])
    ax.set_xlabel(f"logical block (block_size = {snap.block_size} tokens)")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"Block tables of {len(snap.block_tables)} running sequences "
                 "(cell: physical block id)")  # fmt: skip
    ax.legend(
        handles=[Patch(color=STATE_COLORS[REFERENCED], label="private"),
                 Patch(color=SHARED_COLOR, label="shared (ref count > 1)")],
        loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False,
    )  # fmt: skip
    return ax


def plot_prefix_sharing(source: Any, ax=None, *, max_seqs: int = 16):
    """How many KV blocks each pair of running sequences shares (diagonal: the sequence's own
    table length); off-diagonal cells are prefix-cache hits or copy-on-write forks."""
    snap = _snapshot(source)
    seq_ids = list(snap.block_tables)[:max_seqs]
    n = len(seq_ids)
    if not n:
        return _nothing_running(ax, "KV blocks shared between sequences")
    matrix = [[snap.shared_blocks(a, b) for b in seq_ids] for a in seq_ids]
    ax = _axes(ax, (max(4, n * 0.7 + 2), max(3, n * 0.7 + 1.5)))
    image = ax.imshow(matrix or [[0]], cmap="Purples", vmin=0)
    for i in range(n):
        for j in range(n):
            dark = matrix[i][j] > 0.6 * max(max(row) for row in matrix)
            ax.text(j, i, str(matrix[i][j]), ha="center", va="center",
                    color="white" if dark else "black", fontsize=9)  # fmt: skip
    labels = [f"seq {s}" for s in seq_ids]
    ax.set_xticks(range(n), labels, rotation=45, ha="right")
    ax.set_yticks(range(n), labels)
    ax.set_title("KV blocks shared between sequences")
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label="shared blocks")
    return ax


def plot_step_timeline(source: Any, ax=None):
    """Tokens per step, stacked prefill / decode; steps that preempted are marked with their
    preemption count; KV cache usage on the right axis."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    records = _records(source)
    ax = _axes(ax, (10, 3.5))
    steps = [r.step for r in records]
    prefill = [r.num_prefill_tokens for r in records]
    decode = [r.num_decode_tokens for r in records]
    ax.bar(steps, prefill, width=0.9, color=PREFILL_COLOR)
    ax.bar(steps, decode, width=0.9, bottom=prefill, color=DECODE_COLOR)
    top = max((p + d for p, d in zip(prefill, decode, strict=True)), default=1)
    for r in records:
        if r.num_preempted:
            ax.axvline(r.step, color=PREEMPT_COLOR, lw=1.5, ls="--")
            ax.text(r.step + 0.4, top * 1.06, f"{r.num_preempted} preempted",
                    color=PREEMPT_COLOR, ha="left", va="center", fontsize=8)  # fmt: skip
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens scheduled")
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(-1, max(steps, default=0) + 1)
    usage_ax = ax.twinx()
    usage_ax.plot(steps, [100 * r.kv_cache_usage for r in records], color="black", lw=1.2)
    usage_ax.set_ylim(0, 105)
    usage_ax.set_ylabel("KV blocks in use (%)")
    ax.set_title(f"Step timeline: {len(records)} steps, "
                 f"{sum(r.num_preempted for r in records)} preemption(s)")  # fmt: skip
    ax.legend(
        handles=[Patch(color=PREFILL_COLOR, label="prefill tokens"),
                 Patch(color=DECODE_COLOR, label="decode tokens"),
                 Line2D([], [], color=PREEMPT_COLOR, ls="--", label="preemption (count)"),
                 Line2D([], [], color="black", label="KV usage")],
        loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False,
    )  # fmt: skip
    return ax


def plot_engine(source: Any):
    """All four pictures in one figure (pool, tables, sharing, timeline); returns the figure."""
    plt = _pyplot()
    fig = plt.figure(figsize=(14, 10), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1.2, 1.2, 1])
    plot_block_pool(source, fig.add_subplot(grid[0, 0]))
    plot_prefix_sharing(source, fig.add_subplot(grid[0:2, 1]))
    plot_block_tables(source, fig.add_subplot(grid[1, 0]))
    plot_step_timeline(_records(source) if not isinstance(source, KVCacheSnapshot) else [],
                       fig.add_subplot(grid[2, :]))  # fmt: skip
    return fig


def _nothing_running(ax, title: str):
    ax = _axes(ax, (4, 2))
    ax.text(0.5, 0.5, "no running sequences", ha="center", va="center", color="#777777")
    ax.set_title(title)
    ax.axis("off")
    return ax


def _cell(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=color)
