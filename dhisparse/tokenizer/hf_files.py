"""What a Hugging Face model directory says about its tokenizer besides ``tokenizer.json``:
the special tokens and added tokens of ``tokenizer_config.json`` (and the legacy
``special_tokens_map.json``), and the chat templates, read as transformers reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
MODEL_CONFIG = "config.json"

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens every tokenizer may have.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class AddedToken:
    """One entry of ``added_tokens_decoder``."""

    id: int
    content: str
    special: bool
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = True
    single_word: bool = False


def read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``; {} when the file does not exist."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """``tokenizer_config.json``, with the legacy ``special_tokens_map.json`` merged over it
    when the config has no ``added_tokens_decoder`` (transformers reads the map only then)."""
    cfg = read_json(model_dir / TOKENIZER_CONFIG)
    if "added_tokens_decoder" not in cfg:
        for key, value in read_json(model_dir / SPECIAL_TOKENS_MAP).items():
            if key != "additional_special_tokens" and key != "extra_special_tokens":
                cfg[key] = value
    return cfg


def _token_text(value: Any) -> str | None:
    """A special token given as a string or as a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    """Named special tokens -> their text: transformers' ``special_tokens_map``, which
    ``apply_chat_template`` passes to the template. Besides the standard names, every
    ``*_token`` key whose value is a token (``image_token``), and the named entries of an
    ``extra_special_tokens`` object."""
    out: dict[str, str] = {}
    for key, value in cfg.items():
        # A custom name counts only with a string or a serialized AddedToken (``__type``).
        custom = key.endswith("_token") and (
            isinstance(value, str) or (isinstance(value, dict) and "__type" in value)
        )
        text = _token_text(value) if key in NAMED_SPECIAL_TOKENS or custom else None
        if text is not None:
            out[key] = text
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            text = _token_text(value)
            if text is not None:
                out[key] = text
    return out


def added_tokens(cfg: dict[str, Any]) -> list[AddedToken]:
    """``added_tokens_decoder`` in id order."""
    out = []
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{TOKENIZER_CONFIG}: added_tokens_decoder[{key!r}] is not a token")
        out.append(
            AddedToken(
                id=int(key),
                content=entry["content"],
                special=bool(entry.get("special", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", True)),
                single_word=bool(entry.get("single_word", False)),
            )
        )
    return sorted(out, key=lambda t: t.id)


def chat_templates(model_dir: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Template name -> Jinja source. Files beside the config win over its ``chat_template``
    entry, as in transformers: ``chat_template.jinja`` is "default" and
    ``chat_templates/<name>.jinja`` are named. The entry is a string ("default") or a list of
    ``{name, template}``."""
    files: dict[str, str] = {}
    single = model_dir / CHAT_TEMPLATE_FILE
    if single.is_file():
        files["default"] = single.read_text(encoding="utf-8")
    named = model_dir / CHAT_TEMPLATE_DIR
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files
    entry = cfg.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry} if entry else {}
    if isinstance(entry, list):
        out = {}
        for item in entry:
            if not isinstance(item, dict) or not {"name", "template"} <= item.keys():
                raise ValueError(f"{TOKENIZER_CONFIG}: chat_template entries need name, template")
            out[str(item["name"])] = str(item["template"])
        return out
    return {}


def model_type(model_dir: Path | None) -> str | None:
    """``config.json``'s ``model_type``, or None (no directory, no file, no such key)."""
    if model_dir is None:
        return None
    value = read_json(model_dir / MODEL_CONFIG).get("model_type")
    return value if isinstance(value, str) else None


DEEPSEEK_V41 = "deepseek_v41"


def is_deepseek_v41(config: dict[str, Any]) -> bool:
    """Whether ``config.json`` is a DeepSeek-V4.1 checkpoint's: ``model_type`` "deepseek_v41",
    or a first architecture naming ``DeepseekV41`` (a V4.1 config may keep V4's model_type).
    SGLang decides so (``chat_encoding.is_deepseek_v41_arch``)."""
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else ""
    return config.get("model_type") == DEEPSEEK_V41 or (
        isinstance(first, str) and "DeepseekV41" in first
    )


def chat_family(model_dir: Path | None) -> str | None:
    """The model type that picks a checkpoint's chat format and reply parser: ``model_type``,
    except "deepseek_v41" for a DeepSeek-V4.1 checkpoint (``is_deepseek_v41``)."""
    if model_dir is None:
        return None
    config = read_json(model_dir / MODEL_CONFIG)
    return DEEPSEEK_V41 if is_deepseek_v41(config) else model_type(model_dir)
