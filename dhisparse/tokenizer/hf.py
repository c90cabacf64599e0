from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken as _AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from dhisparse.tokenizer import hf_files


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json with what transformers reads beside it: the special
    tokens and ``added_tokens_decoder`` of tokenizer_config.json (or special_tokens_map.json)
    and the chat templates (``hf_files.chat_templates``)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = hf_files.tokenizer_config(model_dir)
        declared = hf_files.added_tokens(cfg)
        self._add_missing(declared)
        self.special_tokens: dict[str, str] = hf_files.special_tokens(cfg)

        def _id(name: str) -> int | None:
            text = self.special_tokens.get(name)
            return self._tok.token_to_id(text) if text else None

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = _id("bos_token")
        eos = _id("eos_token")
        if eos is None:
            raise ValueError(f"{model_dir / hf_files.TOKENIZER_CONFIG}: eos_token is required")
        self.eos_token_id = eos
        self.pad_token_id = _id("pad_token")
        self.mask_token_id = _id("mask_token")
        self.chat_templates: dict[str, str] = hf_files.chat_templates(model_dir, cfg)
        self.chat_template: str = self.chat_templates.get("default", "")
        self._special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        } | {t.id for t in declared if t.special}

    def _add_missing(self, declared: list[hf_files.AddedToken]) -> None:
        """Adds the config's added tokens that tokenizer.json lacks, at their declared ids
        (transformers adds them on load); a declared id the next free id is not is an error."""
        for t in declared:
            if self._tok.token_to_id(t.content) is not None:
                continue
            token = _AddedToken(
                t.content,
                single_word=t.single_word,
                lstrip=t.lstrip,
                rstrip=t.rstrip,
                normalized=t.normalized,
                special=t.special,
            )
            if t.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])
            got = self._tok.token_to_id(t.content)
            if got != t.id:
                raise ValueError(
                    f"added token {t.content!r} is declared with id {t.id} but lands at {got}"
                )

    @property
    def backend(self) -> _HFTokenizer:
        """The ``tokenizers`` tokenizer, its added tokens included (for vocabulary-level tools
        such as a grammar's token masks)."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """The post-processor of tokenizer.json decides (none: nothing is added). transformers
        5 drops tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` when a
        tokenizer.json is there, which it always is here."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
