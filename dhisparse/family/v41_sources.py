"""DeepSeek-V4.1's shared sources, read from a V4 ``config.json`` that names them
(``/work/shared/notes/real-models.md`` §3.9; DeepSeek's ``inference/model.py`` as third-party
ports quote it).

- ``kv_source_layers``: the layers that compute compressed KV rows and their index keys (a
  *KV source*, role ``full``). Every other compressed layer reads the rows and index keys of
  the most recent KV source at or below it (a consumer of that source); it keeps its own
  sliding window.
- ``index_source_layers``: the layers that run an indexer (an *index source*). A consumer
  that is one (role ``reindex``) scores its own queries over its KV source's index keys; the
  others (role ``reuse``) attend the top-k of the most recent index source at or below them.
- ``candidate_source_layer`` (with ``candidate_block_size``, ``candidate_topk_blocks``): the
  candidate blocks that index source selects per query token from its index scores, inside
  which every later index source scores (``v41_candidates``: the rule, its sources and what
  it refuses).

What the facts leave undefined is refused by name: a layer before every source, a consumer
whose source compresses at another rate, a KV source that is not an index source, and V4's
HCA layers (no indexer: ``index_source_layers`` has no meaning for them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dhisparse.family.hf_config import ConfigError

Role = Literal["sliding", "full", "reindex", "reuse"]

KEYS = frozenset({"kv_source_layers", "index_source_layers"})


@dataclass(frozen=True)
class SharedSources:
    """Per layer: whose compressed rows and index keys it reads (``kv_source``) and whose
    selection it attends (``index_source``); -1 on a sliding-only layer and, for
    ``index_source``, on an HCA layer (it attends every row it sees)."""

    kv_source: tuple[int, ...]
    index_source: tuple[int, ...]
    shared: bool  # the config names V4.1's sources (else every layer is its own, as in V4)

    def role(self, layer: int) -> Role:
        if self.kv_source[layer] < 0:
            return "sliding"
        if self.kv_source[layer] == layer:
            return "full"
        return "reindex" if self.index_source[layer] == layer else "reuse"

    def owns_rows(self, layer: int) -> bool:
        """The layer computes the compressed rows (and, CSA, index keys) it attends."""
        return self.kv_source[layer] == layer

    def runs_indexer(self, layer: int) -> bool:
        return self.index_source[layer] == layer

    def with_sliding_layer(self) -> SharedSources:
        """The same with a sliding-only layer appended (DeepSeek-V4's MTP layer)."""
        return SharedSources((*self.kv_source, -1), (*self.index_source, -1), self.shared)


def own_sources(kinds: tuple[str, ...]) -> SharedSources:
    """V4: every compressed layer its own KV source, every CSA layer its own index source."""
    kv = tuple(-1 if k == "sliding" else i for i, k in enumerate(kinds))
    index = tuple(i if k == "csa" else -1 for i, k in enumerate(kinds))
    return SharedSources(kv, index, shared=False)


def parse_shared_sources(
    raw: dict[str, Any], kinds: tuple[str, ...], rates: tuple[int, ...]
) -> SharedSources:
    """The sources ``raw`` (config.json) names over layers of ``kinds`` ("sliding" / "csa" /
    "hca") and compression ``rates``; V4's own sources when it names none. Raises ConfigError
    naming the field for anything the facts do not define."""
    named = sorted(k for k in KEYS if raw.get(k) is not None)
    if not named:
        return own_sources(kinds)
    if len(named) != len(KEYS):
        missing = sorted(KEYS - set(named))[0]
        raise ConfigError(f"config.json: {named[0]} needs {missing} (DeepSeek-V4.1 names both)")
    n = len(kinds)
    kv_layers = _layers(raw, "kv_source_layers", n, kinds)
    index_layers = _layers(raw, "index_source_layers", n, kinds)
    hca = [i for i, k in enumerate(kinds) if k == "hca"]
    if hca:
        raise ConfigError(
            f"config.json: kv_source_layers / index_source_layers with layer {hca[0]} "
            "heavily_compressed_attention: V4.1's shared sources are defined over indexed "
            "compressed layers only (an HCA layer has no indexer)"
        )
    stray = sorted(set(kv_layers) - set(index_layers))
    if stray:
        raise ConfigError(
            f"config.json: kv_source_layers has layer {stray[0]}, not in index_source_layers: "
            "a KV source that attends another source's top-k is not served"
        )
    kv, index = [], []
    for i, kind in enumerate(kinds):
        if kind == "sliding":
            kv.append(-1), index.append(-1)
            continue
        src = max((s for s in kv_layers if s <= i), default=-1)
        if src < 0:
            raise ConfigError(
                f"config.json: kv_source_layers has no layer at or below compressed layer {i}"
            )
        if rates[src] != rates[i]:
            raise ConfigError(
                f"config.json: kv_source_layers: layer {i} compresses by {rates[i]} but reads "
                f"layer {src}'s rows, compressed by {rates[src]}"
            )
        kv.append(src)
        index.append(max(s for s in index_layers if s <= i))  # >= src: kv ⊆ index
    return SharedSources(tuple(kv), tuple(index), shared=True)


def _layers(raw: dict[str, Any], key: str, n: int, kinds: tuple[str, ...]) -> tuple[int, ...]:
    value = raw[key]
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ConfigError(f"config.json: {key} must be a non-empty list of layer indices")
    if list(value) != sorted(set(value)) or not 0 <= value[0] <= value[-1] < n:
        raise ConfigError(f"config.json: {key} {list(value)} must ascend within 0..{n - 1}")
    sliding = [v for v in value if kinds[v] == "sliding"]
    if sliding:
        raise ConfigError(
            f"config.json: {key} has layer {sliding[0]}, a sliding-only layer: a source compresses"
        )
    return tuple(value)
