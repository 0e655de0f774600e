"""Turning one choice's tokens into what the client reads: its text released piece by piece (:class:`TextStream`)
and OpenAI's ``logprobs`` objects (:class:`LogprobStream`), for whole responses and streamed chunks alike."""

from __future__ import annotations


class TextStream:
    """Incremental detokenisation of one choice: text is released once it cannot change (no trailing partial
    UTF-8 character) and cannot turn out to be the start of a stop string; a stop string and what follows it are
    cut from the final text, as OpenAI does."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, tokens: list[int], finished: bool) -> str:
        """Add tokens; return the newly releasable text."""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if finished:
            cuts = [text.find(s) for s in self.stop if s in text]
            ready = text[: min(cuts)] if cuts else text
        else:
            ready = text[: max(0, len(text) - self._hold)] if self.stop else text
            ready = ready.rstrip("\ufffd")
        piece = ready[self.sent :] if len(ready) > self.sent else ""
        self.sent = max(self.sent, len(ready))
        return piece


class LogprobStream:
    """OpenAI's ``logprobs`` of one choice, from the engine's (log-probability, [(alternative id, log-probability)])
    per emitted token. Chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``; completions:
    ``{tokens, token_logprobs, top_logprobs, text_offset}``. A token's text is its id decoded alone (``bytes``: that
    text's UTF-8); every emitted token is listed, an end-of-sequence token included."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # characters of text before the next token (completions' text_offset)
        self._texts: dict[int, tuple[str, int]] = {}
        self.whole = self._empty()

    def _empty(self) -> dict:
        if self.chat:
            return {"content": [], "refusal": None}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _text(self, token: int) -> tuple[str, int]:
        """(the token's text, its length in the response text, where special tokens are skipped)."""
        if token not in self._texts:
            shown = self.tokenizer.decode([token])
            self._texts[token] = (shown, len(self.tokenizer.decode([token], skip_special_tokens=True)))
        return self._texts[token]

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._text(token)[0]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def push(self, tokens: list[int], logprobs) -> dict | None:
        """The ``logprobs`` object of these tokens (for their chunk), also added to :attr:`whole`; None if the
        engine sent none."""
        if not logprobs:
            return None
        part = self._empty()
        for token, (logprob, alternatives) in zip(tokens, logprobs, strict=True):
            if self.chat:
                entry = self._entry(token, logprob)
                entry["top_logprobs"] = [self._entry(alt, value) for alt, value in alternatives]
                part["content"].append(entry)
                continue
            part["tokens"].append(self._text(token)[0])
            part["token_logprobs"].append(logprob)
            part["top_logprobs"].append({self._text(alt)[0]: value for alt, value in alternatives})
            part["text_offset"].append(self.offset)
            self.offset += self._text(token)[1]
        for key, values in part.items():
            if isinstance(values, list):
                self.whole[key] += values
        return part
