"""Chat prompts: conversations rendered with the tokenizer's (or a given) Jinja chat template.

As vLLM does, the template is rendered to text first and the text tokenized with
``add_special_tokens=False``: templates write BOS themselves (``{{ bos_token }}``), and letting
the tokenizer add another would give a double BOS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxpaged.sequence import check_prompt_text

ChatMessage = Mapping[str, object]
Conversation = Sequence[ChatMessage]


def is_single_conversation(messages) -> bool:
    """True for one conversation (a list of message dicts), False for a list of them."""
    return bool(messages) and isinstance(messages[0], Mapping)


def render_chat_prompt(
    tokenizer,
    conversation: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Mapping] | None = None,
) -> str:
    """The prompt text of ``conversation`` under the chat template.

    Args:
        conversation: messages ``{"role": ..., "content": ...}`` in order.
        chat_template: a Jinja template; None uses the tokenizer's own.
        add_generation_prompt: end with the template's opening of an assistant turn.
        continue_final_message: leave the last message open so the model continues it.
        chat_template_kwargs: extra variables for the template.
        tools: OpenAI-style tool dicts (``{"type": "function", "function": {...}}``) passed
            to the template as ``tools`` (vLLM's ``LLM.chat(tools=...)``).

    Raises:
        ValueError: a malformed conversation, or no template available.
    """
    if not conversation:
        raise ValueError("messages must hold at least one message, got an empty conversation")
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}"
            )
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "chat_template is None and the tokenizer has no chat template; pass chat_template"
        )
    return tokenizer.apply_chat_template(
        [dict(m) for m in conversation],
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=[dict(tool) for tool in tools] if tools else None,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )


def chat_prompt(tokenizer, conversation: Conversation, **kwargs) -> dict:
    """``{"prompt": text, "prompt_token_ids": ids}`` for the engine; ``kwargs`` as for
    ``render_chat_prompt``."""
    text = render_chat_prompt(tokenizer, conversation, **kwargs)
    check_prompt_text(text)  # a lone surrogate: our message, not the tokenizer's TypeError
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
