"""The MTP drafter's hot vocabulary from its configuration (``--speculative-token-map``,
``--draft-vocab-size``): the token-map file read and checked, and the hot ids it gives.

A token map lists token ids, most frequent first (FR-Spec ranks the vocabulary by frequency in
a corpus; ``python -m training.corpus.token_map`` writes one for a shipped model). Accepted as
SGLang's loader takes it, a torch file (``.pt`` / ``.pth``: a 1-D integer tensor or a list),
and as a JSON list (a ``.json`` file, or any file whose text begins with ``[``) or a text file
of one id per line. Every problem is a start-up error that names the file."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from dhisparse.paths import resolve_path
from services.worker.speculative.config import SpeculationConfig

FLAG = "--speculative-token-map"
TORCH_SUFFIXES = (".pt", ".pth")


def read_token_map(path: str | Path) -> list[int]:
    """The ids ``path`` lists, in its order. Raises ValueError naming the file when it is
    missing or unreadable, lists something other than integers, lists nothing, or lists an id
    twice."""
    where = f"{FLAG} {path}"
    path = resolve_path(path)  # a shipped map resolves from any working directory
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    if path.suffix in TORCH_SUFFIXES:
        ids = _torch_ids(path, where)
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: neither a torch file ({TORCH_SUFFIXES}) nor text") from None
        is_json = path.suffix == ".json" or text.lstrip().startswith("[")
        ids = _json_ids(text, where) if is_json else _line_ids(text, where)
    if not ids:
        raise ValueError(f"{where}: lists no token id (a hot vocabulary needs at least one)")
    twice = [i for i, n in Counter(ids).items() if n > 1]
    if twice:
        raise ValueError(f"{where}: {len(twice)} ids listed more than once (the first: {twice[0]})")
    return ids


def hot_ids(
    cfg: SpeculationConfig, vocab_size: int, ranked: Sequence[int] | None
) -> torch.Tensor | None:
    """[N] int64, sorted: the hot ids ``cfg`` asks for over a vocabulary of ``vocab_size`` —
    the first ``draft_vocab_size`` ids of ``ranked`` (the token map's, ``read_token_map``; all
    of them when no size is given), or without a map the ids 0 .. N-1. None: no hot
    vocabulary. Raises ValueError naming the flag when an id is outside the vocabulary or the
    size exceeds what there is to take."""
    if not cfg.hot_vocab:
        return None
    n = cfg.draft_vocab_size
    if ranked is None:
        assert n is not None
        if n > vocab_size:
            raise ValueError(f"--draft-vocab-size {n}: the vocabulary has {vocab_size} ids")
        return torch.arange(n, dtype=torch.int64)
    where = f"{FLAG} {cfg.token_map}"
    outside = [i for i in ranked if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"{where}: {len(outside)} ids outside the vocabulary [0, {vocab_size}) "
            f"(the first: {outside[0]})"
        )
    if n is not None and n > len(ranked):
        raise ValueError(f"--draft-vocab-size {n}: {where} lists only {len(ranked)} ids")
    return torch.tensor(sorted(ranked[:n]), dtype=torch.int64)


def _torch_ids(path: Path, where: str) -> list[int]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torch file that does not load: any of pickle's errors
        raise ValueError(f"{where}: not a torch file of token ids ({e})") from None
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.dtype.is_floating_point or data.dtype == torch.bool:
            raise ValueError(
                f"{where}: a 1-D integer tensor is needed, got {data.dtype} of shape "
                f"{tuple(data.shape)}"
            )
        return [int(i) for i in data.tolist()]
    return _integers(data, where)


def _json_ids(text: str, where: str) -> list[int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON list of token ids ({e})") from None
    return _integers(data, where)


def _line_ids(text: str, where: str) -> list[int]:
    ids = []
    for no, line in enumerate(text.splitlines(), 1):
        item = line.strip()
        if not item:
            continue
        try:
            ids.append(int(item))
        except ValueError:
            raise ValueError(f"{where}: line {no}: {item[:40]!r} is not a token id") from None
    return ids


def _integers(data: object, where: str) -> list[int]:
    if not isinstance(data, list):
        raise ValueError(f"{where}: a list of token ids is needed, got {type(data).__name__}")
    bad = [x for x in data if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} is not a token id (integers only)")
    return list(data)
