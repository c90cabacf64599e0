from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json with the specials and chat template of
    tokenizer_config.json (Hugging Face layout)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def _id(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return self._tok.token_to_id(tok) if tok else None

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = _id("bos_token")
        eos = _id("eos_token")
        if eos is None:
            raise ValueError(f"{cfg_path}: eos_token is required")
        self.eos_token_id = eos
        self.pad_token_id = _id("pad_token")
        self.mask_token_id = _id("mask_token")
        self.chat_template: str = cfg.get("chat_template") or ""
        self._special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
