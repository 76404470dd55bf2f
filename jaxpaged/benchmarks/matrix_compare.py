"""How ``jaxpaged bench matrix`` compares a row's outputs with its reference's.

Per completion: the tokens must be equal up to the first position where they differ; that
position (if any) must be a near-tie (each side's token is in the other's top logprobs and the
reference's logprobs of the two differ by at most the tolerance; later positions follow
different prefixes and are not compared, as vLLM's ``check_logprobs_close`` does); and the
sampled tokens' logprobs before it must differ by at most the tolerance. Beam search compares
each ranked beam's cumulative logprob per generated token within the tolerance (beams of equal
score may swap: a near-tie); tokens without logprobs (golden tokens) must be equal.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Completion:
    """One completion of a request: tokens, per-token ``{token_id: logprob}`` (None for beam
    search and golden tokens) and the cumulative logprob (None without logprobs)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    cumulative: float | None


def compare(
    test: list, ref: list, tolerance: float, *, beam: bool = False
) -> tuple[bool, float, str]:
    """``(matches, max |delta logprob|, note)`` of ``test`` against ``ref`` (per request, per
    completion); see the module docstring for the rule."""
    worst, notes = 0.0, []
    for r, (test_req, ref_req) in enumerate(zip(test, ref, strict=True)):
        if len(test_req) != len(ref_req):
            return False, math.inf, f"request {r}: {len(test_req)} completions vs {len(ref_req)}"
        for c, (a, b) in enumerate(zip(test_req, ref_req, strict=True)):
            if beam:
                if a.cumulative is None or b.cumulative is None:
                    if a.tokens != b.tokens:
                        return False, worst, f"request {r} beam {c}: tokens differ"
                    continue
                delta = abs(a.cumulative - b.cumulative) / max(len(b.tokens), 1)
                if not delta <= tolerance:  # NaN fails too
                    return False, math.inf, f"request {r} beam {c}: score differs by {delta:.3g}"
                if a.tokens != b.tokens:  # two beams of (nearly) equal score swapped
                    notes.append(f"near-tie at request {r} beam {c}")
                else:
                    worst = max(worst, delta)
                continue
            diverged = next(
                (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
                None,
            )
            if len(a.tokens) != len(b.tokens) and diverged is None:
                return False, worst, f"request {r}: {len(a.tokens)} tokens vs {len(b.tokens)}"
            end = len(a.tokens) if diverged is None else diverged
            if a.logprobs is not None and b.logprobs is not None:
                for i in range(end):
                    token = a.tokens[i]
                    delta = abs(a.logprobs[i][token] - b.logprobs[i][token])
                    if math.isnan(delta):  # max() would drop a NaN
                        return False, math.inf, f"request {r}.{c}: NaN logprob at token {i}"
                    worst = max(worst, delta)
            if diverged is None:
                continue
            i = diverged
            x, y = a.tokens[i], b.tokens[i]
            if a.logprobs is None or b.logprobs is None:
                return False, worst, f"request {r}.{c}: token {i} is {x}, reference {y}"
            near_tie = (
                x in b.logprobs[i]
                and y in a.logprobs[i]
                and abs(b.logprobs[i][x] - b.logprobs[i][y]) <= tolerance
            )
            if not near_tie:
                return False, worst, f"request {r}.{c}: token {i} is {x}, reference {y}"
            notes.append(f"near-tie at request {r}.{c} token {i}")
    if not worst <= tolerance:
        return False, worst, f"max |delta logprob| {worst:.3g} > {tolerance:g}"
    return True, worst, "; ".join(notes)


def same_checksum(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Two ``Worker.weights_checksum`` pairs agree: equal counts, sums within 1e-4 relative."""
    return a[1] == b[1] and abs(a[0] - b[0]) <= 1e-4 * max(abs(b[0]), 1e-30)
