"""/v1/completions through the official ``openai`` client against a live server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.live_server import API_KEY, MODEL_NAME

openai = pytest.importorskip("openai")

PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben went to the park"]
MAX_TOKENS = 10


def test_completion_equals_llm_generate_greedy_for_several_prompts(client, greedy_reference):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0
    )
    expected = greedy_reference(PROMPTS, MAX_TOKENS)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == MODEL_NAME
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert all(c.finish_reason == "length" for c in response.choices)
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 3 * MAX_TOKENS
    assert response.usage.total_tokens == prompt_tokens + 3 * MAX_TOKENS


def _collect_stream(stream):
    chunks = list(stream)
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return chunks, texts


def test_streamed_text_equals_whole_text_and_usage_comes_only_when_asked(client, greedy_reference):
    expected = greedy_reference(PROMPTS[:2], MAX_TOKENS)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    chunks, texts = _collect_stream(stream)
    assert texts == {i: e.outputs[0].text for i, e in enumerate(expected)}
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.id == chunks[0].id and chunk.id.startswith("cmpl-") for chunk in chunks)
    finishes = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert sorted((c.index, c.finish_reason) for c in finishes) == [(0, "length"), (1, "length")]

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[:2],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks, texts = _collect_stream(stream)
    assert texts == {i: e.outputs[0].text for i, e in enumerate(expected)}
    *body, last = chunks
    assert all(chunk.usage is None for chunk in body)
    assert last.choices == []
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.completion_tokens == 2 * MAX_TOKENS
    assert last.usage.total_tokens == prompt_tokens + 2 * MAX_TOKENS


def test_token_id_prompts_and_echo(client, greedy_reference, stories_llm):
    ids = [[1, 403, 407, 263], [1, 365, 452]]
    expected = greedy_reference([{"prompt_token_ids": p} for p in ids], 6)
    batch = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in batch.choices] == [e.outputs[0].text for e in expected]
    single = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected[0].outputs[0].text
    assert single.usage.prompt_tokens == len(ids[0])

    tokenizer = stories_llm.get_tokenizer()
    reference = greedy_reference([PROMPTS[0], {"prompt_token_ids": ids[1]}], 6)
    # A token-id prompt is echoed decoded with its special tokens (vLLM's echo).
    prompt_texts = [PROMPTS[0], tokenizer.decode(ids[1])]
    assert prompt_texts[1].startswith(tokenizer.bos_token)
    echoed = [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, echo=True
        ).choices[0]
        for prompt in (PROMPTS[0], ids[1])
    ]
    assert [c.text for c in echoed] == [
        p + r.outputs[0].text for p, r in zip(prompt_texts, reference, strict=True)
    ]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert _collect_stream(stream)[1] == {0: echoed[0].text}


def test_sampling_knobs_pass_through_seed_top_k_min_p_stop_token_ids(client, stories_llm):
    from jaxpaged import SamplingParams

    knobs = dict(temperature=1.0, top_p=0.9, seed=11)
    extra = dict(top_k=20, min_p=0.05)
    (expected,) = stories_llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, **knobs, **extra), use_tqdm=False
    )
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, extra_body=extra, **knobs
    )
    assert response.choices[0].text == expected.outputs[0].text

    stop_id = expected.outputs[0].token_ids[3]
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        extra_body=extra | {"stop_token_ids": [stop_id]},
        **knobs,
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    first = expected.outputs[0].token_ids.index(stop_id)
    assert stopped.usage.completion_tokens == first + 1

    ignoring = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert ignoring.usage.completion_tokens == 40


def test_64_concurrent_streams_get_their_own_outputs_and_free_every_block(server, stories_llm):
    from jaxpaged import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(3, 512, size=int(n)).tolist()] for n in rng.integers(1, 40, 64)]
    max_tokens = [int(m) for m in rng.integers(1, 12, 64)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    references = stories_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    expected = [r.outputs[0].text for r in references]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)

    async def one(prompt, max_tokens):
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish

    async def all_clients():
        async with client:
            return await asyncio.gather(*map(one, prompts, max_tokens))

    results = asyncio.run(all_clients())
    assert [text for text, _ in results] == expected
    assert all(finish == "length" for _, finish in results)
    stats = server.wait_idle()  # checks the block pool's invariants
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


TRICKY_TEXTS = [" hello", 'a "q" \\ \n\t\x01\x7f é 😀 \u2028', ""]
ENDINGS = [(None, None), ("stop", 2), ("stop", "</s>"), ("length", None)]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
def test_per_token_text_events_equal_the_pydantic_chunk_byte_for_byte(
    text, finish_reason, stop_reason
):
    from jaxpaged.entrypoints.openai.serving_completion import text_chunk
    from jaxpaged.entrypoints.openai.sse import DeltaFrames, sse

    def event(*choice):
        return sse(text_chunk('c-"1"', 7, "m/é", *choice))

    frames = DeltaFrames.from_probe(
        event(DeltaFrames.INDEX, DeltaFrames.TEXT, DeltaFrames.FINISH, DeltaFrames.STOP)
    )
    assert frames.frame(3, text, finish_reason, stop_reason) == event(
        3, text, finish_reason, stop_reason
    )


def test_a_request_id_holding_a_probe_sentinel_keeps_events_exact():
    """A client names the request (``request_id``): a sentinel in it either leaves the cut
    unambiguous (the text's, JSON-quoted) or turns the fast path off (the index's digits)."""
    from jaxpaged.entrypoints.openai.serving_completion import text_chunk
    from jaxpaged.entrypoints.openai.sse import DeltaFrames, sse

    def event(request_id, *choice):
        return sse(text_chunk(request_id, 7, "m", *choice))

    probe = (DeltaFrames.INDEX, DeltaFrames.TEXT, DeltaFrames.FINISH, DeltaFrames.STOP)
    assert DeltaFrames.from_probe(event(f"cmpl-{DeltaFrames.INDEX}", *probe)) is None
    request_id = f"cmpl-{DeltaFrames.TEXT}"
    frames = DeltaFrames.from_probe(event(request_id, *probe))
    assert frames.frame(2, "x", None, None) == event(request_id, 2, "x", None, None)
