"""Incremental detokenization for streaming (the prefix/read-offset scheme of TGI and vLLM).

Decoding only a short window per step keeps streaming cost independent of how much was generated;
a delta is released only once it no longer ends in an incomplete UTF-8 sequence ("\\ufffd").
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:])   # a little prompt context so the first piece spaces right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids) -> str:
        self.ids.extend(int(t) for t in new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        text = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # keep the window short: drop ids before the prefix offset
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
            return text[len(prefix):]
        return ""
