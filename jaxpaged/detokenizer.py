"""Incremental, UTF-8-safe detokenization of one request's output, and its stop strings.

Text grows one token at a time and reads as it does after the prompt: concatenating every
increment gives ``decode(prompt + output)`` minus ``decode(prompt)`` (so the space a
SentencePiece tokenizer drops at the start of a text is kept). A token that ends inside a
multi-byte character (byte-fallback pieces such as ``<0xE6>``) adds nothing until the character
is complete, so no increment holds a U+FFFD that the whole text does not; when the request
finishes, bytes still pending are flushed as ``decode`` would show them.

Two decoders give the same text: tokenizers' Rust ``DecodeStream`` for fast tokenizers (what
vLLM's ``FastIncrementalDetokenizer`` uses), and, for any other tokenizer, a window of recent
ids decoded with ``tokenizer.decode`` (the prefix/read-offset scheme of vLLM's
``detokenize_incrementally``, from HF text-generation-inference).

Stop strings follow vLLM v1 (``vllm/v1/engine/detokenizer.py``): they are searched only in new
text (plus the tail a match could straddle) once more than ``min_tokens`` tokens exist; the text
is cut before the match, or after it with ``include_stop_str_in_output``. Where two stop strings
match in the same new text the earliest one wins (vLLM takes the first in list order). When EOS
or a stop token id ended the request, that token's text is left out (unless
``include_stop_str_in_output``) and no stop string is searched.
"""

from __future__ import annotations

from collections import deque

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt ids decoded as context before the output; vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
_CONTEXT_TOKENS = 5
# DecodeStream is primed with a prompt suffix of at least this many ids that starts on a character
# boundary (no U+FFFD), searched up to _MAX_PRIME ids back, as vLLM does.
_MIN_PRIME, _MAX_PRIME = 4, 24
# A UTF-8 character has at most 4 bytes, so a prompt ends with at most 3 bytes of an unfinished one.
_MAX_TAIL = 3
# Start of the error tokenizers' DecodeStream raises when a step's text no longer extends the
# text it decoded before.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """The output text of one request, grown token by token, with stop strings applied.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the request's prompt (context for the first output tokens).
        params: the request's ``SamplingParams`` (stop, include_stop_str_in_output, min_tokens,
            skip_special_tokens, spaces_between_special_tokens).
        use_fast: use DecodeStream when the tokenizer has a Rust backend (tests turn it off to
            compare the two decoders).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params, *, use_fast: bool = True):
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.stop_buffer_length
        self.output_text = ""
        self.num_output_tokens = 0
        self._sent_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if tokenizer is None:  # skip_tokenizer_init: token ids only, empty text
            self._decoder = _NoTextDecoder()
        elif use_fast and isinstance(backend, Tokenizer):
            self._decoder = _StreamDecoder(tokenizer, backend, prompt_token_ids, params)
        else:
            self._decoder = _WindowDecoder(tokenizer, prompt_token_ids, params)

    def update(self, new_token_ids: list[int], *, stop_terminated: bool, finished: bool):
        """Append ``new_token_ids``' text and look for stop strings.

        Args:
            stop_terminated: EOS or a stop token id ended the request with the last new token.
            finished: the request ends with these tokens (for any reason): flush pending bytes.

        Returns:
            The stop string that matched (the text is already cut), or None.
        """
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        offset_before = len(self.output_text)
        for token_id in new_token_ids:
            self.output_text += self._decoder.decode_next(token_id)
        if finished or stop_terminated:
            self.output_text += self._decoder.flush()
        if stop_terminated or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - offset_before)

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        if new_char_count == 0:
            return None
        best = None  # (index, stop string)
        for stop in self.stop:
            # A match must end inside the new text, so it starts at most len(stop)-1 before it.
            start = max(0, len(self.output_text) - new_char_count - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def get_next_output_text(self, *, finished: bool, delta: bool) -> str:
        """The text to report now: all of it, or (``delta``) what was not reported before.

        While unfinished, the last ``max(len(stop)) - 1`` characters are held back because they
        could still become the start of a stop string that must not be shown.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold, 0)
        if not delta:
            return self.output_text[:end]
        start = self._sent_offset
        if end <= start:
            return ""
        self._sent_offset = end
        return self.output_text[start:end]


def _unfinished_tail(decode, prompt_token_ids: list[int]) -> int:
    """How many of the prompt's last ids are the first bytes of a character the prompt does not
    finish (byte-fallback pieces), 0 to ``_MAX_TAIL``: the fewest ids whose removal leaves text
    that does not end in U+FFFD (0 when none does, e.g. bytes that are not UTF-8 at all)."""
    n = len(prompt_token_ids)
    for tail in range(min(_MAX_TAIL, n - 1) + 1):
        end = n - tail
        start = max(0, end - _CONTEXT_TOKENS)
        # A window that starts inside a character decodes its whole byte run as U+FFFD, its
        # finished last character too: move the start back to a character boundary.
        floor = max(0, start - _MAX_TAIL)
        while start > floor and decode(prompt_token_ids[start:end]).startswith("\ufffd"):
            start -= 1
        if not decode(prompt_token_ids[start:end]).endswith("\ufffd"):
            return tail
    return 0


class _NoTextDecoder:
    """Decoder of an engine without a tokenizer (``skip_tokenizer_init``): no text."""

    def decode_next(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class _WindowDecoder:
    """Decode ``ids[prefix:]`` and ``ids[prefix:read]`` with ``tokenizer.decode``; the new text is
    the difference, released only once it does not end in U+FFFD (an unfinished character)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self.tokenizer = tokenizer
        self.kwargs = dict(skip_special_tokens=params.skip_special_tokens)
        if not params.skip_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = params.spaces_between_special_tokens
        # The prompt's unfinished last character (if any) is unread: its bytes come out with
        # the output token that completes it, and nothing before it does.
        tail = _unfinished_tail(self._decode, prompt_token_ids)
        head = prompt_token_ids[: len(prompt_token_ids) - tail]
        self.ids = list(head[-_CONTEXT_TOKENS:]) + list(prompt_token_ids[len(head) :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids) - tail

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def decode_next(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        # Keep only the window: the ids of the text just released become the next prefix.
        del self.ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return new_text[len(prefix_text) :]


class _StreamDecoder:
    """tokenizers' ``DecodeStream`` primed with a prompt suffix; it returns None while a
    character is incomplete. Pending ids are kept so that ``flush`` can decode them anyway."""

    def __init__(self, tokenizer, backend: Tokenizer, prompt_token_ids: list[int], params):
        self.tokenizer = tokenizer
        self.backend = backend
        self.skip_special_tokens = params.skip_special_tokens
        # DecodeStream must be primed on a character boundary (primed inside a character, its
        # first text repeats the whole prime): the prompt's unfinished last character is fed
        # after priming, so its bytes come out with the output token that completes it.
        tail = _unfinished_tail(backend.decode, prompt_token_ids)
        prime = list(prompt_token_ids[: len(prompt_token_ids) - tail])
        tail_ids = list(prompt_token_ids[len(prime) :])
        if len(prime) > _MIN_PRIME:
            for n in range(_MIN_PRIME, min(len(prime), _MAX_PRIME) + 1):
                if "\ufffd" not in backend.decode(prime[-n:]):
                    prime = prime[-n:]
                    break
        self.stream = DecodeStream(prime, skip_special_tokens=self.skip_special_tokens)
        for token_id in tail_ids:  # an unfinished character: DecodeStream returns None
            self.stream.step(backend, token_id)
        # Context for flush(): the prompt's last ids, its unfinished character included.
        self.recent: deque[int] = deque(
            (prime + tail_ids)[-_CONTEXT_TOKENS - len(tail_ids) :],
            maxlen=_CONTEXT_TOKENS + _MAX_TAIL,
        )
        self.pending: list[int] = []
        # spaces_between_special_tokens=False: adjacent special tokens show their bare content
        # (vLLM's FastIncrementalDetokenizer); skipped specials make it moot.
        self.special: dict[int, str] = {}
        if not self.skip_special_tokens and not params.spaces_between_special_tokens:
            self.special = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self.last_special = False

    def decode_next(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.backend, token_id)
        except Exception as error:  # tokenizers raises a bare Exception
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            # Byte-fallback pieces that are not valid UTF-8 (random or out-of-domain ids) can
            # break DecodeStream's prefix invariant; vLLM's FastIncrementalDetokenizer resets
            # the stream and carries on, which loses no text already released.
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            text = self.stream.step(self.backend, token_id)
        if self.special:
            content = self.special.get(token_id)
            if content is not None and self.last_special:
                text = content
            self.last_special = content is not None
        if text is None:
            self.pending.append(token_id)
            return ""
        self.recent.extend(self.pending)
        self.recent.append(token_id)
        self.pending.clear()
        return text

    def flush(self) -> str:
        if not self.pending:
            return ""
        context = list(self.recent)
        kwargs = dict(skip_special_tokens=self.skip_special_tokens)
        before = self.tokenizer.decode(context, **kwargs)
        after = self.tokenizer.decode(context + self.pending, **kwargs)
        self.recent.extend(self.pending)
        self.pending.clear()
        return after[len(before) :]
