"""Chat prompts: rendered with a chat template, tokenized without a second BOS."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.entrypoints.chat import chat_prompt, render_chat_prompt

# A template that writes BOS itself, as Llama-style templates do (stories260k ships none).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "Tell me about Lily and the big dog."},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_ids_equal_hf_apply_chat_template_with_one_bos(
    stories_llm, add_generation_prompt
):
    tokenizer = stories_llm.get_tokenizer()
    prompt = chat_prompt(
        tokenizer, CONVERSATION, chat_template=TEMPLATE, add_generation_prompt=add_generation_prompt
    )
    hf = tokenizer.apply_chat_template(
        CONVERSATION,
        chat_template=TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
    )
    hf_ids = hf["input_ids"] if hasattr(hf, "keys") else hf
    assert prompt["prompt_token_ids"] == list(hf_ids)
    assert prompt["prompt_token_ids"].count(tokenizer.bos_token_id) == 1
    assert prompt["prompt_token_ids"][0] == tokenizer.bos_token_id
    assert prompt["prompt"].endswith("assistant:") == add_generation_prompt
    # Tokenizing the rendered text the ordinary way would have added a second BOS.
    assert tokenizer.encode(prompt["prompt"])[:2] == [tokenizer.bos_token_id] * 2


def test_llm_chat_takes_one_conversation_or_a_list(stories_llm):
    tokenizer = stories_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=5)
    (single,) = stories_llm.chat(CONVERSATION, params, chat_template=TEMPLATE, use_tqdm=False)
    other = [{"role": "user", "content": "Hi"}]
    both = stories_llm.chat([CONVERSATION, other], params, chat_template=TEMPLATE, use_tqdm=False)
    expected = chat_prompt(tokenizer, CONVERSATION, chat_template=TEMPLATE)
    assert single.prompt == expected["prompt"]
    assert single.prompt_token_ids == expected["prompt_token_ids"]
    assert both[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert both[1].prompt == render_chat_prompt(tokenizer, other, chat_template=TEMPLATE)
    # The same ids given as a plain token prompt give the same continuation.
    (plain,) = stories_llm.generate(
        [{"prompt_token_ids": expected["prompt_token_ids"]}], params, use_tqdm=False
    )
    assert plain.outputs[0].token_ids == single.outputs[0].token_ids


def test_continue_final_message_leaves_the_last_turn_open(stories_llm):
    tokenizer = stories_llm.get_tokenizer()
    conversation = [*CONVERSATION, {"role": "assistant", "content": "Once upon"}]
    text = render_chat_prompt(
        tokenizer,
        conversation,
        chat_template=TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("assistant: Once upon")


@pytest.mark.parametrize(
    "conversation, kwargs, message",
    [
        (CONVERSATION, {}, "chat_template is None and the tokenizer has no chat template"),
        ([], dict(chat_template=TEMPLATE), "at least one message"),
        (["hello"], dict(chat_template=TEMPLATE), r"messages\[0\] must be a dict"),
        (
            CONVERSATION,
            dict(chat_template=TEMPLATE, continue_final_message=True),
            "cannot both be True",
        ),
    ],
)
def test_bad_chat_input_is_a_value_error(stories_llm, conversation, kwargs, message):
    with pytest.raises(ValueError, match=message):
        stories_llm.chat(conversation, use_tqdm=False, **kwargs)
    assert not stories_llm.llm_engine.has_unfinished_requests()


def test_llm_chat_passes_tools_to_the_template(stories_llm):
    from tests.entrypoints.openai.tool_template import SHORT_TOOL_CHAT_TEMPLATE, WEATHER_TOOL

    params = SamplingParams(temperature=0.0, max_tokens=2)
    (out,) = stories_llm.chat(
        CONVERSATION, params, chat_template=SHORT_TOOL_CHAT_TEMPLATE, tools=[WEATHER_TOOL],
        use_tqdm=False,
    )  # fmt: skip
    assert out.prompt.startswith("tools: get_weather\nsystem: You tell stories.")


def test_llm_chat_refuses_a_lone_surrogate_as_generate_does(stories_llm):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at character 3"):
        stories_llm.chat([{"role": "user", "content": "hi \ud800"}], chat_template=template)
    out = stories_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                           chat_template=template)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
