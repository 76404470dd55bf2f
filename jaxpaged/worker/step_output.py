"""What one step returns to the host: ``ModelRunnerOutput``, read back from the device outputs.

The sample stage leaves its outputs on the device (``StepProgram.step_segment``: ``token_ids i32[B]``,
``sampled_logprobs f32[B]``, ``logprobs`` and ``prompt_logprobs`` as ``TopLogprobs``, ``beams``);
``read_back`` waits for them and copies to the host only what the step's requests asked for: the
token ids and their logprobs always, the top logprobs when some sampled row wants logprobs, the
prompt logprobs when some token wants its prompt logprob, the beam candidates of a beam step.
All of it is keyed by sequence id.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.sample.logprobs import TokenLogprobs


@dataclasses.dataclass
class ModelRunnerOutput:
    """What one step returns to the engine, keyed by sequence id."""

    sampled_token_ids: dict[str, int]
    """The token sampled for each sequence whose step computed its last token."""
    sampled_logprobs: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each sampled token's logprob (``sample.logprobs.sampled_logprobs``), summed by the engine
    into ``cumulative_logprob`` (best_of ranking, beam scores, ``CompletionOutput``)."""
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)
    """For sampled sequences that asked for logprobs."""
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = dataclasses.field(
        default_factory=dict
    )
    """For sequences that asked for prompt logprobs: (prompt position >= 1, its logprobs) for the
    positions this step's tokens predict."""
    beam_candidates: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict
    )
    """Beam steps: each sampled row's best next tokens, ``seq_id -> (token_ids i32[k],
    logprobs f32[k])`` best first (``worker/beam_candidates.py``); empty otherwise."""


def read_back(scheduled: list, out: dict) -> ModelRunnerOutput:
    """Wait for a launched step's outputs ``out`` and read them back for its ``scheduled``
    sequences (``ScheduledSequence``s, in row order)."""
    token_ids = np.asarray(out["token_ids"])
    chosen = np.asarray(out["sampled_logprobs"])
    sampled = [(i, s.seq.seq_id) for i, s in enumerate(scheduled) if s.do_sample]
    result = ModelRunnerOutput(
        {seq_id: int(token_ids[i]) for i, seq_id in sampled},
        sampled_logprobs={seq_id: float(chosen[i]) for i, seq_id in sampled},
    )
    if "beams" in out:
        beam_ids, beam_logprobs = (np.asarray(x) for x in out["beams"])
        result.beam_candidates = {seq_id: (beam_ids[i], beam_logprobs[i]) for i, seq_id in sampled}
    # Logprob arrays leave the device only when some request of the step wants them.
    if any(s.do_sample and s.seq.sampling_params.logprobs is not None for s in scheduled):
        top = {k: np.asarray(v) for k, v in vars(out["logprobs"]).items()}
        for i, s in enumerate(scheduled):
            if s.do_sample and s.seq.sampling_params.logprobs is not None:
                result.logprobs[s.seq.seq_id] = host_token_logprobs(top, i, token_ids[i])
    if any(s.seq.sampling_params.prompt_logprobs is not None for s in scheduled):
        top = {k: np.asarray(v) for k, v in vars(out["prompt_logprobs"]).items()}
        t = 0
        for s in scheduled:
            if s.seq.sampling_params.prompt_logprobs is not None:
                result.prompt_logprobs[s.seq.seq_id] = _prompt_entries(top, t, s)
            t += s.num_new_tokens
    return result


def _prompt_entries(top: dict[str, np.ndarray], t: int, s) -> list[tuple[int, TokenLogprobs]]:
    """(prompt position, its logprobs) for the prompt positions that the ``num_new_tokens``
    tokens of ``s`` starting at token row ``t`` predict."""
    entries = []
    prompt = s.seq.prompt_token_ids
    for j in range(s.num_new_tokens):
        position = s.num_computed_tokens + j + 1
        if position < len(prompt):
            entries.append((position, host_token_logprobs(top, t + j, prompt[position])))
    return entries


def host_token_logprobs(top: dict[str, np.ndarray], i: int, token_id: int) -> TokenLogprobs:
    """Row ``i`` of fetched ``TopLogprobs`` arrays (numpy, by field name)."""
    wanted = top["wanted_ranks"][i]
    count = int(np.count_nonzero(wanted))  # ranks are >= 1 where an id was asked for
    return TokenLogprobs(
        token_id=int(token_id),
        logprob=float(top["logprobs"][i]),
        rank=int(top["ranks"][i]),
        top_ids=top["top_ids"][i].tolist(),
        top_logprobs=top["top_logprobs"][i].tolist(),
        wanted_logprobs=top["wanted_logprobs"][i, :count].tolist(),
        wanted_ranks=wanted[:count].tolist(),
    )
