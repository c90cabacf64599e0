from __future__ import annotations

import re

from dhisparse.tokenizer.chat import DEFAULT_CHAT_TEMPLATE

# Ids 0..255 are the bytes themselves; special tokens follow.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|mask|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)


class ByteTokenizer:
    """A byte-level tokenizer that needs no download: one id per UTF-8 byte plus specials."""

    def __init__(self) -> None:
        self.special_to_id = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: s for s, i in self.special_to_id.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.bos_token_id = self.special_to_id["<|bos|>"]
        self.eos_token_id = self.special_to_id["<|eos|>"]
        self.pad_token_id = self.special_to_id["<|pad|>"]
        self.mask_token_id = self.special_to_id["<|mask|>"]
        self.end_token_id = self.special_to_id["<|end|>"]
        self.special_tokens = {
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "mask_token": "<|mask|>",
        }
        self.chat_templates = {"default": DEFAULT_CHAT_TEMPLATE}
        self.chat_template = DEFAULT_CHAT_TEMPLATE
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids: list[int] = [self.bos_token_id] if add_bos else []
        for piece in self._special_re.split(text):
            if not piece:
                continue
            special = self.special_to_id.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """The byte-level models start every prompt with BOS."""
        return self.encode(text, add_bos=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if not skip_special_tokens and i in self.id_to_special:
                out.append(self.id_to_special[i])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, token_id: int) -> str:
        if token_id in self.id_to_special:
            return self.id_to_special[token_id]
        if 0 <= token_id < 256:
            return bytes([token_id]).decode("utf-8", errors="replace")
        return ""

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256
