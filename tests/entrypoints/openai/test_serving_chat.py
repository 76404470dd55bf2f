"""/v1/chat/completions through the official ``openai`` client against a live server."""

from __future__ import annotations

import asyncio

import pytest

from tests.live_server import MODEL_NAME

openai = pytest.importorskip("openai")

MESSAGES = [
    {"role": "system", "content": "Tell a story."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}],
    },
]
# The test template (conftest.CHAT_TEMPLATE) rendered by hand: text parts joined by newlines.
RENDERED = "system: Tell a story.\nuser: Once upon\na time\nassistant:"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def expected(stories_llm, greedy_reference):
    """LLM.generate on the rendered text, tokenized without special tokens (vLLM's rule)."""
    ids = stories_llm.get_tokenizer().encode(RENDERED, add_special_tokens=False)
    (output,) = greedy_reference([{"prompt_token_ids": ids}], MAX_TOKENS)
    return output


def test_chat_equals_llm_generate_on_the_rendered_template(client, expected):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + MAX_TOKENS


def test_max_completion_tokens_wins_over_deprecated_max_tokens(client, expected):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0
    )
    assert response.usage.completion_tokens == 3
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=3,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.choices[0].message.content == expected.outputs[0].text


def test_streamed_chat_starts_with_role_and_adds_usage_only_when_asked(client, expected):
    for include_usage in (False, True):
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True} if include_usage else None,
        )
        chunks = list(stream)
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].choices[0].delta.content == ""
        if include_usage:
            *chunks, last = chunks
            assert last.choices == []
            assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
            assert last.usage.completion_tokens == MAX_TOKENS
        assert all(c.usage is None for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert content == expected.outputs[0].text
        finishes = [c.choices[0].finish_reason for c in chunks]
        assert finishes[-1] == "length"
        assert set(finishes[:-1]) == {None}


def test_request_chat_template_replaces_the_server_one(client, stories_llm, greedy_reference):
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    ids = stories_llm.get_tokenizer().encode(
        "Tell a story. Once upon\na time ", add_special_tokens=False
    )
    (reference,) = greedy_reference([{"prompt_token_ids": ids}], 5)
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"chat_template": template},
    )
    assert response.choices[0].message.content == reference.outputs[0].text
    assert response.usage.prompt_tokens == len(ids)


def test_model_without_any_chat_template_is_a_400(server):
    from jaxpaged.entrypoints.openai.errors import BadRequestError
    from jaxpaged.entrypoints.openai.protocol import ChatMessageParam
    from jaxpaged.entrypoints.openai.serving_chat import OpenAIServingChat

    tokenizer = server.engine.tokenizer
    assert not getattr(tokenizer, "chat_template", None)
    chat = OpenAIServingChat(server.engine, tokenizer, [MODEL_NAME], 128, chat_template=None)
    with pytest.raises(BadRequestError, match="no chat template"):
        asyncio.run(chat.render_messages([ChatMessageParam(role="user", content="hi")]))


def test_chat_template_flag_accepts_a_file_or_inline_jinja(tmp_path):
    from jaxpaged.entrypoints.openai.chat_template import load_chat_template

    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% if x %}y{% endif %}") == "{% if x %}y{% endif %}"
    with pytest.raises(ValueError, match="file path or an inline Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def _chat_event(choice) -> str:
    """What ``_stream``'s general ``chunk`` writes for ``choice`` without usage or token ids:
    the models dumped, ``None`` dropped from the delta."""
    from jaxpaged.entrypoints.openai.protocol import ChatCompletionStreamResponse
    from jaxpaged.entrypoints.openai.sse import sse

    data = ChatCompletionStreamResponse(
        id='c-"1"', created=7, model="m/é", choices=[choice]
    ).model_dump()
    data["choices"][0]["delta"] = choice.delta.model_dump(exclude_none=True)
    del data["usage"], data["prompt_token_ids"], data["choices"][0]["token_ids"]
    return sse(data)


@pytest.mark.parametrize("content", [" hello", 'a "q" \\ \n\t\x01\x7f é 😀 \u2028', ""])
@pytest.mark.parametrize("finish_reason, stop_reason", [(None, None), ("stop", 2), ("stop", "x")])
def test_per_token_chat_events_equal_the_general_chunk_byte_for_byte(
    content, finish_reason, stop_reason
):
    """The per-token fast path (``sse.DeltaFrames``, cut from a probe event) against the
    general chunk, in vLLM's compact JSON (no spaces, UTF-8 as is)."""
    from jaxpaged.entrypoints.openai.protocol import (
        ChatCompletionResponseStreamChoice,
        DeltaMessage,
    )
    from jaxpaged.entrypoints.openai.sse import DeltaFrames

    def choice(index, text, finish, stop):
        return ChatCompletionResponseStreamChoice(
            index=index, delta=DeltaMessage(content=text), finish_reason=finish, stop_reason=stop
        )

    frames = DeltaFrames.from_probe(
        _chat_event(
            choice(DeltaFrames.INDEX, DeltaFrames.TEXT, DeltaFrames.FINISH, DeltaFrames.STOP)
        )
    )
    event = _chat_event(choice(1, content, finish_reason, stop_reason))
    assert frames.frame(1, content, finish_reason, stop_reason) == event
    assert event.startswith('data: {"id":"c-\\"1\\"","object":"chat.completion.chunk","created":7,')
    assert '"model":"m/é"' in event
