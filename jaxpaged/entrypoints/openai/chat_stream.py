"""The chunks of one streamed chat completion, in vLLM's JSON, and what each choice has been sent.

Each choice opens with a chunk whose delta is ``{"role": "assistant", "content": ""}``; content,
reasoning and tool-call deltas follow, the last with ``finish_reason`` (sent once per choice).
A delta carries only what it adds, as OpenAI's do. ``stream_options``: ``include_usage`` adds a
last chunk with empty ``choices`` and the usage; ``continuous_usage_stats`` puts the usage so far
in every chunk (the opening ones included). ``return_token_ids`` adds the prompt's ids to the
first chunk and each chunk's new ids to its choice. The per-token chunk of plain content (no
usage, no ids, no logprobs) is written by ``sse.DeltaFrames``, cut from this writer's own event.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from jaxpaged.entrypoints.openai.chat_tools import ChatChoiceParser
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from jaxpaged.entrypoints.openai.protocol_base import UsageInfo
from jaxpaged.entrypoints.openai.sse import DeltaFrames, sse
from jaxpaged.outputs import RequestOutput


class ChatChunks:
    """Writes the events of one streamed chat response (made when the stream starts: its
    ``created`` time is then)."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, model: str):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)
        self.return_ids = bool(request.return_token_ids)
        self.frames: DeltaFrames | None = None
        """The per-token events, cut from ``chunk``'s own event; None when every chunk needs
        the general writer (usage or ids in each)."""
        if not (self.continuous_usage or self.return_ids):
            probe = ChatCompletionResponseStreamChoice(
                index=DeltaFrames.INDEX,
                delta=DeltaMessage(content=DeltaFrames.TEXT),
                finish_reason=DeltaFrames.FINISH,
                stop_reason=DeltaFrames.STOP,
            )
            self.frames = DeltaFrames.from_probe(self.chunk([probe]))

    @property
    def opening_needs_output(self) -> bool:
        """Whether the opening chunks wait for the core's first output (which knows the
        prompt's usage and ids)."""
        return self.continuous_usage or self.return_ids

    def chunk(
        self,
        choices: Sequence[ChatCompletionResponseStreamChoice],
        usage: UsageInfo | None = None,
        prompt_token_ids=None,
    ) -> str:
        """One event: ``choices``, with ``usage`` and ``prompt_token_ids`` where given."""
        response = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )
        data = response.model_dump()
        for choice, model_choice in zip(data["choices"], choices, strict=True):
            # A delta carries only what it adds (role first, then content), as OpenAI's do.
            choice["delta"] = model_choice.delta.model_dump(exclude_none=True)
            if not self.return_ids:
                del choice["token_ids"]
        if usage is None:
            del data["usage"]
        else:
            data["usage"] = usage.model_dump(exclude_none=True)
        if prompt_token_ids is None:
            del data["prompt_token_ids"]
        else:
            data["prompt_token_ids"] = list(prompt_token_ids)
        return sse(data)

    def opening(self, index: int, first_output: RequestOutput | None) -> str:
        """Choice ``index``'s first event: the assistant role and empty content (with the
        prompt's usage, and its ids in choice 0's, when asked for)."""
        choice = ChatCompletionResponseStreamChoice(
            index=index,
            delta=DeltaMessage(role="assistant", content=""),
            token_ids=[] if self.return_ids else None,
        )
        known = first_output is not None
        return self.chunk(
            [choice],
            usage=running_usage(first_output, 0) if self.continuous_usage and known else None,
            prompt_token_ids=(
                first_output.prompt_token_ids if self.return_ids and index == 0 and known else None
            ),
        )

    def delta(
        self, choice: ChatCompletionResponseStreamChoice, output: RequestOutput, tokens: int
    ) -> str:
        """The event of one choice's delta; ``tokens``: the choice's output tokens so far
        (its usage, with ``continuous_usage_stats``)."""
        return self.chunk(
            [choice], running_usage(output, tokens) if self.continuous_usage else None
        )


def running_usage(output: RequestOutput, completion_tokens: int) -> UsageInfo:
    """The usage of a stream so far: the prompt's tokens and ``completion_tokens``."""
    prompt_tokens = len(output.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


@dataclasses.dataclass
class SentSoFar:
    """What a stream has sent of each choice (by choice index)."""

    text: dict[int, str] = dataclasses.field(default_factory=dict)
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    done: set[int] = dataclasses.field(default_factory=set)
    """Choices whose finish_reason was sent (once each)."""
    parsers: dict[int, ChatChoiceParser | None] = dataclasses.field(default_factory=dict)
    """Each choice's reader of tools and reasoning, made at its first delta."""
