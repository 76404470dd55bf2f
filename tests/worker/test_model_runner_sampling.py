"""Sampling through the paged engine against HF transformers (PyTorch, float32): logprobs,
prompt logprobs, penalties and seeds, with one compiled step per bucket throughout."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sample.metadata import SamplerVariant
from tests.conftest import SMALL_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 logits on CPU against PyTorch float32 (project standard)


@pytest.fixture(scope="module")
def hf_model(stories_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    """f64[len(ids), vocab]: next-token logits after each prefix of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _random_prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [1, *rng.integers(3, 512, size=n - 1).tolist()]


def check_entry(entry, chosen, reference, k):
    """A position's {token_id: Logprob} against its reference logprobs ``reference`` [vocab]."""
    assert chosen in entry and len(entry) in (k, k + 1)
    value = entry[chosen].logprob
    assert abs(value - reference[chosen]) < TOL
    # Rank = 1 + tokens strictly better; allow for near-ties within the tolerance.
    lo, hi = 1 + np.sum(reference > value + TOL), 1 + np.sum(reference > value - TOL)
    assert lo <= entry[chosen].rank <= hi
    order = np.sort(reference)[::-1]
    top = {t: e for t, e in entry.items() if t != chosen or e.rank <= k}
    assert sorted(e.rank for e in top.values()) == list(range(1, k + 1))
    for token_id, e in top.items():
        assert abs(e.logprob - reference[token_id]) < TOL
        assert abs(e.logprob - order[e.rank - 1]) < TOL
        assert isinstance(e.decoded_token, str)


@pytest.mark.parametrize("length", [65, 30])
def test_prompt_logprobs_equal_hf_log_softmax(stories_llm, hf_model, length):
    """65 tokens: a 64-token chunk, then a 1-token chunk run alone in a decode-only bucket."""
    prompt = _random_prompt(length, seed=length)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4)
    (out,) = stories_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == length
    reference = log_softmax(hf_logits(hf_model, prompt))
    for position in range(1, length):
        check_entry(out.prompt_logprobs[position], prompt[position], reference[position - 1], 4)


def test_sampled_logprobs_equal_hf_and_greedy_tokens_have_rank_1(stories_llm, hf_model):
    prompts = [_random_prompt(n, seed=n) for n in (9, 21)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(  # processed: the renormalised top-8 of logits / 0.7
            temperature=0.7,
            top_k=8,
            seed=6,
            max_tokens=12,
            logprobs=2,
            ignore_eos=True,
            logprobs_mode="processed",
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # no logprobs
    ]
    outs = stories_llm.generate(
        [{"prompt_token_ids": prompts[i % 2]} for i in range(4)], params, use_tqdm=False
    )
    for out, p in zip(outs, params, strict=True):
        completion = out.outputs[0]
        if p.logprobs is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            continue
        ids = out.prompt_token_ids + completion.token_ids
        logits = hf_logits(hf_model, ids)[len(out.prompt_token_ids) - 1 : -1]
        if p.logprobs_mode == "processed_logprobs":
            scaled = logits / p.temperature
            kth = np.sort(scaled, -1)[:, -p.top_k][:, None]
            reference = log_softmax(np.where(scaled >= kth, scaled, -np.inf))
        else:
            reference = log_softmax(logits)
        assert len(completion.logprobs) == len(completion.token_ids)
        for entry, token, ref in zip(
            completion.logprobs, completion.token_ids, reference, strict=True
        ):
            if p.logprobs_mode == "processed_logprobs":
                assert abs(entry[token].logprob - ref[token]) < TOL
                assert np.isfinite(entry[token].logprob)
            else:
                check_entry(entry, token, ref, p.logprobs)
            if p.temperature == 0.0:
                assert entry[token].rank == 1
        chosen = [
            entry[t].logprob
            for entry, t in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-6)


def _numpy_penalized_greedy(model, prompt, steps, presence, frequency, repetition):
    """Greedy decoding with penalties applied by hand to HF logits (vLLM's semantics)."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf_logits(model, ids)[-1]
        outputs = ids[len(prompt) :]
        counts = np.bincount(outputs, minlength=logits.size)
        seen = np.zeros(logits.size, bool)
        seen[ids] = True  # prompt + generated
        logits = np.where(
            seen, np.where(logits > 0, logits / repetition, logits * repetition), logits
        )
        logits = logits - frequency * counts - presence * (counts > 0)
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :]


def test_penalties_end_to_end_equal_hf_reference_beside_plain_requests(stories_llm, hf_model):
    prompts = [_random_prompt(n, seed=100 + n) for n in (12, 40, 7)]
    penalized = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.4,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = stories_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [penalized, plain, penalized], use_tqdm=False
    )
    for out, p in zip(outs, [penalized, plain, penalized], strict=True):
        want = _numpy_penalized_greedy(
            hf_model,
            out.prompt_token_ids,
            16,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        assert out.outputs[0].token_ids == want
    # The penalties changed something (otherwise the test would prove nothing).
    assert (
        outs[0].outputs[0].token_ids
        != stories_llm.generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_logit_bias_and_allowed_token_ids_restrict_the_draws(stories_llm):
    allowed = [300, 301, 302, 303]
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, logit_bias={"410": 100}),
        SamplingParams(temperature=0.0, max_tokens=20, logit_bias={410: -100, 432: -100}),
    ]
    outs = stories_llm.generate(["Once upon a time"] * 3, params, use_tqdm=False)
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert len(set(outs[0].outputs[0].token_ids)) > 1
    assert set(outs[1].outputs[0].token_ids) == {410}
    assert not {410, 432} & set(outs[2].outputs[0].token_ids)


def test_same_seed_same_tokens_whatever_the_batch_and_different_seeds_differ(stories_llm):
    prompt = {"prompt_token_ids": _random_prompt(10, seed=7)}

    def seeded(seed):
        return SamplingParams(
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=20, ignore_eos=True
        )

    alone = stories_llm.generate([prompt], seeded(123), use_tqdm=False)[0].outputs[0].token_ids
    engine = stories_llm.llm_engine
    engine.add_request("seeded", prompt, seeded(123), final_only=True)
    others = [_random_prompt(n, seed=n) for n in (33, 5, 50)]
    done = {}
    for step in range(200):
        if step == 3:  # company arrives while "seeded" decodes: new buckets, new neighbours
            for i, p in enumerate(others):
                engine.add_request(
                    f"other{i}",
                    {"prompt_token_ids": p},
                    SamplingParams(temperature=0.8, max_tokens=20, presence_penalty=0.5),
                    final_only=True,
                )
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        if len(done) == 4:
            break
    assert done["seeded"] == alone
    other = stories_llm.generate([prompt], seeded(124), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def _varied_params(scale: float, common: dict) -> list[SamplingParams]:
    """Every sampling feature on, with values that move with ``scale``."""
    return [
        SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=3, **common),
        SamplingParams(
            temperature=0.5 * scale,
            top_k=int(3 * scale),
            top_p=0.9 / scale,
            min_p=0.05 * scale,
            seed=int(scale),
            logprobs=1,
            logprobs_mode="processed",
            **common,
        ),
        SamplingParams(
            presence_penalty=1.0 * scale,
            frequency_penalty=-0.5 * scale,
            repetition_penalty=0.8 * scale,
            min_tokens=int(3 * scale),
            **common,
        ),
        SamplingParams(
            logit_bias={5: 3.0 * scale}, allowed_token_ids=list(range(3, 400)), **common
        ),
    ]


def test_changing_sampling_parameter_values_never_traces_again(stories_llm):
    """Which sampler stages a step compiles is static (``SamplerVariant``): a run with every
    feature on compiles the variants it needs; the same schedule with other parameter values
    then runs without tracing anything. Plain parameters need only the default variant."""
    runner = stories_llm.llm_engine.worker.model_runner
    prompts = [{"prompt_token_ids": _random_prompt(n, seed=n)} for n in (3, 70, 17, 40)]
    common = dict(max_tokens=6, ignore_eos=True)  # same steps, so the same buckets, every time
    plain = [SamplingParams(temperature=0.0, **common)] * 4
    before = set(runner._executables)  # the engine is shared with other tests
    stories_llm.generate(prompts, plain, use_tqdm=False)
    assert {key.variant for key in set(runner._executables) - before} <= {SamplerVariant()}
    stories_llm.generate(prompts, _varied_params(1.0, common), use_tqdm=False)
    compiled = runner.num_compilations
    with jax.no_tracing(True):
        outs = stories_llm.generate(prompts, _varied_params(1.5, common), use_tqdm=False)
    assert runner.num_compilations == compiled
    assert outs[0].prompt_logprobs is not None and outs[1].outputs[0].logprobs is not None


@pytest.mark.parametrize("num_seqs, decode_only", [(1, True), (16, False)])
def test_step_never_copies_the_logits_state(stories_llm, num_seqs, decode_only):
    """The donated LogitsState is updated in place: a copy would cost [S, vocab] per step."""
    runner = stories_llm.llm_engine.worker.model_runner
    key = runner.bucket_for(num_seqs, num_seqs, decode_only)
    executable = runner._executables.get(key) or runner.executable(key)
    rows = "{},{}".format(*runner.logits_state.output_counts.shape)
    copies = [
        line
        for line in executable.as_text().splitlines()
        if re.search(rf"\[{rows}\]\S* copy\(", line)
    ]
    assert not copies, copies[:3]


@pytest.mark.parametrize(
    "params, message",
    [
        (
            SamplingParams(logprobs=21),
            "logprobs must be at most the engine's max_logprobs \\(20\\)",
        ),
        (SamplingParams(prompt_logprobs=25), "max_logprobs"),
        # n > 1 is served (parallel sampling), but not more samples than max_num_seqs seats.
        (SamplingParams(n=2, best_of=9), "needs 9 sequences at once .* max_num_seqs is 8"),
        (
            SamplingParams(allowed_token_ids=[3, 512]),
            "allowed_token_ids has token ids out of vocabulary",
        ),
        (SamplingParams(logit_bias={9999: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
    ],
)
def test_engine_rejects_what_the_model_cannot_serve(stories_llm, params, message):
    engine = stories_llm.llm_engine
    with pytest.raises(ValueError, match=message):
        stories_llm.generate(
            ["Once upon a time", "The cat"], [SamplingParams(), params], use_tqdm=False
        )
    assert not engine.has_unfinished_requests()


def test_max_logprobs_is_an_engine_argument():
    from jaxpaged.config import EngineArgs

    with pytest.raises(ValueError, match="max_logprobs must be non-negative or -1, got -2"):
        EngineArgs(max_logprobs=-2, **SMALL_ENGINE).create_engine_config()
    # -1 (vLLM's "no cap") is the whole vocabulary of stories260k.
    config = EngineArgs(max_logprobs=-1, **SMALL_ENGINE).create_engine_config()
    assert config.model_config.max_logprobs == 512


def test_prompt_logprobs_of_one_token_chunks_in_decode_only_buckets(stories_llm, hf_model):
    """Chunks of 5, 1, 1 and 13 tokens: the 1-token chunks run in decode-only buckets, where
    the sampled rows' logits give the prompt logprobs."""
    from jaxpaged.core.scheduler import ScheduledSequence, SchedulerOutput
    from jaxpaged.sequence import Sequence

    engine = stories_llm.llm_engine
    runner = engine.worker.model_runner
    prompt = _random_prompt(20, seed=20)
    seq = Sequence("chunks", prompt, SamplingParams(prompt_logprobs=2, max_tokens=1), 2)
    seq.sampling_seed = 0
    assert engine.kv_cache_manager.allocate_slots(seq, len(prompt))
    table = engine.kv_cache_manager.get_block_table(seq.seq_id)
    got, start = {}, 0
    try:
        for n in (5, 1, 1, 13):
            item = ScheduledSequence(seq, start, n, table, do_sample=start + n == len(prompt))
            output = runner.execute_model(SchedulerOutput([item], n))
            got.update(output.prompt_logprobs[seq.seq_id])
            start += n
    finally:
        engine.kv_cache_manager.free(seq)
    assert sorted(got) == list(range(1, len(prompt)))
    reference = log_softmax(hf_logits(hf_model, prompt))
    builder = engine.output_processor.logprobs_builder
    for position, entry in got.items():
        check_entry(builder.build(entry, 2), prompt[position], reference[position - 1], 2)
