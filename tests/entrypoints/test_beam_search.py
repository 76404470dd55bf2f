"""LLM.beam_search against HF transformers' beam search on stories260k, token for token.

HF runs `generate(num_beams=W, num_return_sequences=W, length_penalty=..., early_stopping=False,
do_sample=False)` on PyTorch with its own KV cache; ours runs the beams as forked sequences
sharing paged KV blocks. stories260k never emits EOS (id 2) in these lengths, so every beam runs
to max_tokens and both rank the W beams by cumulative log-probability.
"""

from __future__ import annotations

import pytest

from jaxpaged import BeamSearchParams, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BEAM_WIDTH = 4
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def hf_model(stories_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    return model.eval()


def _hf_beam_search(model, prompt_ids, length_penalty):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            num_beams=BEAM_WIDTH,
            num_return_sequences=BEAM_WIDTH,
            length_penalty=length_penalty,
            early_stopping=False,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    beams = [seq[len(prompt_ids) :].tolist() for seq in out.sequences]
    # sequences_scores = cumulative logprob / generated_len ** length_penalty.
    cums = [float(s) * MAX_TOKENS**length_penalty for s in out.sequences_scores]
    return beams, cums


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_hf_transformers_token_for_token(
    stories_llm, hf_model, golden, length_penalty
):
    prompts = [case["prompt_ids"] for case in golden["cases"][:3]]
    params = BeamSearchParams(
        beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS, length_penalty=length_penalty
    )
    outputs = stories_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, expected_cums = _hf_beam_search(hf_model, prompt, length_penalty)
        assert 2 not in sum(expected, [])  # no EOS: every beam ran to max_tokens
        got = [seq.tokens[len(prompt) :] for seq in output.sequences]
        assert got == expected
        for seq, cum in zip(output.sequences, expected_cums, strict=True):
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.cum_logprob == pytest.approx(cum, rel=1e-4, abs=1e-4)
            assert len(seq.logprobs) == MAX_TOKENS
            assert all(len(step) == 2 * BEAM_WIDTH for step in seq.logprobs)
            assert seq.finish_reason == "length"
            assert seq.text == stories_llm.get_tokenizer().decode(seq.tokens[len(prompt) :])
    kv = stories_llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_beam_width_one_is_greedy_decoding(stories_llm, golden):
    case = golden["cases"][0]
    params = BeamSearchParams(beam_width=1, max_tokens=8)
    (output,) = stories_llm.beam_search([{"prompt_token_ids": case["prompt_ids"]}], params)
    greedy = stories_llm.generate(
        [{"prompt_token_ids": case["prompt_ids"]}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )[0]
    (beam,) = output.sequences
    assert beam.tokens[len(case["prompt_ids"]) :] == greedy.outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be at least 1, got 0"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be at least 1, got 0"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    ],
)
def test_invalid_beam_search_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_beam_width_above_max_num_seqs_is_rejected_and_queues_nothing(stories_llm):
    params = BeamSearchParams(beam_width=9, max_tokens=4)  # SMALL_ENGINE: max_num_seqs=8
    with pytest.raises(ValueError, match="max_num_seqs is 8"):
        stories_llm.beam_search(["Once upon a time"], params)
    assert not stories_llm.llm_engine.has_unfinished_requests()
