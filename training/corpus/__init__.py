"""The corpus and tokenizer of the shipped model (``python -m training.corpus``): Python
sources as documents, a held-out split, a byte-level BPE tokenizer and the token files.

- ``sources``: the ``*.py`` files of the roots, filtered and deduplicated by content;
- ``import_order``: a package's files with each module after the modules it imports;
- ``documents``: one document per package, the held-out modules and their copies kept apart;
- ``chunks``: cutting a document where tokenization is unchanged, for parallel encoding;
- ``bpe``: training the tokenizer and writing its Hugging Face directory, bytes per token id;
- ``tokens``: the token files and their checked loader;
- ``build``: the stages in order, each skipped when up to date.

Exports are lazy so that the parsing workers and ``python -m training.corpus`` import only
what they use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Document": "documents",
    "HELDOUT_MODULES": "documents",
    "SourceFile": "sources",
    "Split": "documents",
    "TokenCorpus": "tokens",
    "build": "build",
    "find_sources": "sources",
    "import_order": "import_order",
    "load_tokens": "tokens",
    "split_documents": "documents",
    "token_byte_lengths": "bpe",
    "train_tokenizer": "bpe",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
