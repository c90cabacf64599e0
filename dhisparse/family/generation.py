"""A checkpoint's generation defaults (``generation_config.json``) and its end-of-sequence
ids, which ``config.json`` and ``generation_config.json`` may each give as one id or a list
(GLM-5: ``[154820, 154827, 154829]``). Pure Python: the gateway reads them too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"


def token_ids(value: Any) -> tuple[int, ...]:
    """An id or a list of ids (None: none) as a tuple, in order, without repeats."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in items):
        raise ValueError(f"token ids must be non-negative integers, got {value!r}")
    return tuple(dict.fromkeys(items))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _number(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{GENERATION_CONFIG}: {key} must be a number, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class GenerationDefaults:
    """What ``generation_config.json`` states; None (or ``()``) where it states nothing.
    Sampling fields are defaults for requests that leave them out."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    do_sample: bool | None = None
    max_length: int | None = None  # prompt plus completion
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        do_sample = data.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"{GENERATION_CONFIG}: do_sample must be true or false")
        out = cls(
            eos_token_ids=token_ids(data.get("eos_token_id")),
            temperature=_number(data, "temperature", float),
            top_p=_number(data, "top_p", float),
            top_k=_number(data, "top_k", int),
            do_sample=do_sample,
            max_length=_number(data, "max_length", int),
            max_new_tokens=_number(data, "max_new_tokens", int),
        )
        if out.temperature is not None and out.temperature < 0:
            raise ValueError(f"{GENERATION_CONFIG}: temperature must be >= 0")
        if out.top_p is not None and not 0 < out.top_p <= 1:
            raise ValueError(f"{GENERATION_CONFIG}: top_p must be in (0, 1]")
        for name in ("max_length", "max_new_tokens"):
            if (getattr(out, name) or 1) < 1:
                raise ValueError(f"{GENERATION_CONFIG}: {name} must be >= 1")
        return out

    @classmethod
    def read(cls, model_dir: Path | None) -> GenerationDefaults:
        """The directory's ``generation_config.json``; empty defaults without one."""
        if model_dir is None:
            return cls()
        return cls.from_dict(_read(Path(model_dir) / GENERATION_CONFIG))

    @property
    def default_temperature(self) -> float | None:
        """The temperature of a request that gives none: 0 (greedy) where ``do_sample`` is
        false, as in transformers, else ``temperature``."""
        return 0.0 if self.do_sample is False else self.temperature


def eos_token_ids(model_dir: Path | None) -> tuple[int, ...]:
    """Every end-of-sequence id the directory names: ``config.json``'s, then
    ``generation_config.json``'s."""
    if model_dir is None:
        return ()
    config = token_ids(_read(Path(model_dir) / MODEL_CONFIG).get("eos_token_id"))
    return token_ids([*config, *GenerationDefaults.read(model_dir).eos_token_ids])
