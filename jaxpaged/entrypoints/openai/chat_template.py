"""Chat templates: ``--chat-template`` read once, messages made template-ready, and a request's
own template rendered in the sandbox.

vLLM's rules (``vllm/entrypoints/chat_utils.py``): text content parts are joined with newlines;
the rendered text is tokenized without adding special tokens (the template writes them). A
request's own ``chat_template`` is a client's program: it renders in a sandboxed worker process
with limits on time, memory, output and ``range`` (``template_sandbox.py``). The server's and the
tokenizer's templates are the operator's and render in process (transformers'
``apply_chat_template``, in ``OpenAIServingChat.render_messages``).
"""

from __future__ import annotations

import os

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.protocol import ChatMessageParam
from jaxpaged.entrypoints.openai.template_sandbox import TemplateLimitError, TemplateSandbox

# transformers' marker (``render_jinja_template``) for the end of the message to continue.
CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def load_chat_template(chat_template: str | None) -> str | None:
    """``--chat-template``: a file path (read) or an inline Jinja template (kept as is).

    Raises:
        ValueError: the value is neither an existing file nor looks like Jinja.
    """
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(marker in chat_template for marker in ("{{", "{%", "\n")):
        return chat_template
    raise ValueError(
        f"chat_template must be a file path or an inline Jinja template, got "
        f"{chat_template!r} (no such file, and no '{{{{' or '{{%' in it)"
    )


def message_dict(message: ChatMessageParam, position: int) -> dict:
    """A template-ready message: text parts joined by newlines; other fields passed through.

    Raises:
        BadRequestError: a content part that is not text (param ``messages.<i>.content``).
    """
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(
                    f"messages[{position}].content: only text parts are supported, got a part "
                    f"of type {part.get('type')!r}",
                    param=f"messages.{position}.content",
                )
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    return data


async def render_in_sandbox(
    sandbox: TemplateSandbox,
    tokenizer,
    template: str,
    conversation: list[dict],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    documents,
    tools: list[dict] | None,
    chat_template_kwargs: dict,
) -> str:
    """What ``apply_chat_template(tokenize=False)`` gives, rendered by ``sandbox``: the
    template sees the tokenizer's special tokens, ``chat_template_kwargs``, ``messages``,
    ``tools``, ``documents`` and ``add_generation_prompt``; ``continue_final_message``
    cuts the text after the last message, as transformers does (a marker after it).

    Raises:
        TemplateLimitError: the sandbox's, or the final message lost by the template.
        TemplateQueueFullError: the sandbox's queue is full.
    """
    if continue_final_message:
        conversation = [dict(m) for m in conversation]
        final = conversation[-1]["content"]
        conversation[-1]["content"] = final + CONTINUE_MARK
    special = {
        key: value
        for key, value in getattr(tokenizer, "special_tokens_map", {}).items()
        if isinstance(value, (str, list))
    }
    context = {
        **special,
        **chat_template_kwargs,
        "messages": conversation,
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
    }
    text = await sandbox.render_async(template, context)
    if continue_final_message:
        where = text.rfind(CONTINUE_MARK.strip())
        if where < 0 or final.strip() not in text:
            raise TemplateLimitError(
                "continue_final_message is set but the chat template dropped the final message"
            )
        if text[where : where + len(CONTINUE_MARK)] == CONTINUE_MARK:
            text = text[:where]
        else:  # the template trimmed the spacing after the message
            text = text[:where].rstrip()
    return text
