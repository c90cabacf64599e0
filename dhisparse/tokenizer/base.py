from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Tokenizer(Protocol):
    """What the gateway and the worker need of a tokenizer.

    ``encode`` recognises special-token strings (as rendered by the chat template) and maps
    them to their ids; ordinary text never produces special ids.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    mask_token_id: int | None
    # Named special tokens -> their text (``bos_token``, ``eos_token``, ...): the variables
    # transformers gives a chat template besides the messages.
    special_tokens: Mapping[str, str]
    # Chat template name -> Jinja source ("default" among them when the model has one).
    chat_templates: Mapping[str, str]
    chat_template: str  # the "default" template, "" when there is none

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (a completion's, not a chat's) with the special tokens the checkpoint's
        own rule adds, as transformers' ``tokenizer(text)`` gives it: no BOS unless that rule
        adds one."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """The text of one token as shown in logprobs (may be a partial UTF-8 sequence)."""

    def is_special(self, token_id: int) -> bool: ...
