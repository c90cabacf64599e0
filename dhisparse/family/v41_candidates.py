"""DeepSeek-V4.1's candidate blocks (the first level of its two-level top-k), read from a V4
``config.json`` that names them beside the shared sources (``v41_sources``).

The facts, from DeepSeek's ``inference/model.py`` (``Indexer.__init__`` / ``Indexer.forward``
and ``select_candidate_blocks``) as third-party ports quote it (code index ids 70871433627,
66954683869, 70219165078, 69667794745; its span hashes recorded by id 68586562989) and
transformers' V4.1 port (PR #48721, as copied in id 69580654096):

- the candidate source is the index source ``candidate_source_layer`` (``is_candidate_source =
  layer_id == args.candidate_source_layer``; the flag lives on the ``Indexer``, which only an
  index source has); its own selection is not filtered;
- a consumer is every later index source (``uses_candidates = 0 <= candidate_source_layer <
  layer_id``): it masks its own scores outside the source's candidate blocks with -inf before
  its top-k; a Reuse layer attends its index source's selection, filtered or not;
- per query token, from the source's index scores over the compressed positions it sees
  (``compress_lens = (t + 1) // ratio``, the rest -inf): a block of ``candidate_block_size``
  positions scores the max of its positions (the last block padded with -inf); the block
  holding the query's newest visible position (``(compress_lens - 1) // block_size``) is
  pinned in (+inf); the ``candidate_topk_blocks`` best blocks are kept, a kept block of score
  -inf (unreachable) dropped;
- a loader check of SGLang's V4.1 port (id 70900738478): with a candidate source,
  ``candidate_topk_blocks * block - (block - 1) < index_topk`` leaves the selection undefined
  (the candidates could hold fewer visible positions than a consumer keeps);
- the key is ``candidate_source_layer`` in ``inference/config.json`` (beside
  ``kv_source_layers``) and ``candidate_source_layer_id`` in the Hugging Face ``config.json``
  (beside ``kv_source_layer_ids``; ids 70354872143, 68502056332, 69598741387); both are read.

Ties between blocks of equal score are broken by the lower block first (DeepSeek's code uses
``torch.topk``, which leaves them unordered): the engine's rule for positions, applied to
blocks. Refused by name, as undefined: a candidate source that runs no indexer, a consumer
that compresses at another rate than the source (its scores are over other positions),
block sizes or counts that are not positive integers or are missing, and too few blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dhisparse.family.hf_config import ConfigError
from dhisparse.family.v41_sources import SharedSources

SOURCE_KEYS = ("candidate_source_layer", "candidate_source_layer_id")
KEYS = frozenset({*SOURCE_KEYS, "candidate_block_size", "candidate_topk_blocks"})

CandidateRole = Literal["source", "consumer"]


@dataclass(frozen=True)
class CandidateBlocks:
    """The candidate source layer, its blocks (``block_size`` compressed positions each, the
    ``topk_blocks`` best kept per query token) and the layers whose indexers score only inside
    them (``consumers``, ascending)."""

    source: int
    block_size: int
    topk_blocks: int
    consumers: tuple[int, ...]

    def role(self, layer: int) -> CandidateRole | None:
        if layer == self.source:
            return "source"
        return "consumer" if layer in self.consumers else None


def parse_candidates(
    raw: dict[str, Any], sharing: SharedSources, rates: tuple[int, ...], index_topk: int
) -> CandidateBlocks | None:
    """The candidate blocks ``raw`` (config.json) names over layers whose indexers ``sharing``
    places, compressing by ``rates``; None without a candidate source (absent, null or
    negative: the reference's ``0 <= src`` test). Raises ConfigError naming the field for
    anything the facts do not define."""
    src = _source_layer(raw)
    if src is None or src < 0:
        return None
    n = len(rates)
    if src >= n:
        raise ConfigError(f"config.json: candidate_source_layer={src} is not a layer (0..{n - 1})")
    if not sharing.runs_indexer(src):
        raise ConfigError(
            f"config.json: candidate_source_layer={src} runs no indexer (not an index source): "
            "the candidate blocks are made from its index scores"
        )
    block, count = _positive(raw, "candidate_block_size"), _positive(raw, "candidate_topk_blocks")
    if count * block - (block - 1) < index_topk:
        raise ConfigError(
            f"config.json: candidate_topk_blocks={count} blocks of candidate_block_size={block} "
            f"can hold fewer than the index_topk={index_topk} positions an indexer keeps: its "
            "selection would be undefined"
        )
    consumers = tuple(i for i in range(src + 1, n) if sharing.runs_indexer(i))
    other = [i for i in consumers if rates[i] != rates[src]]
    if other:
        raise ConfigError(
            f"config.json: candidate_source_layer={src} compresses by {rates[src]} but layer "
            f"{other[0]}, an index source after it, by {rates[other[0]]}: its scores are over "
            "other positions than the candidate blocks"
        )
    return CandidateBlocks(src, block, count, consumers)


def _source_layer(raw: dict[str, Any]) -> int | None:
    values = {key: raw[key] for key in SOURCE_KEYS if raw.get(key) is not None}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: {key}={value!r} is not a layer index")
    if len(set(values.values())) > 1:
        raise ConfigError(
            f"config.json: candidate_source_layer={values[SOURCE_KEYS[0]]} and "
            f"candidate_source_layer_id={values[SOURCE_KEYS[1]]} disagree"
        )
    return next(iter(values.values()), None)


def _positive(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if value is None:
        raise ConfigError(f"config.json: a candidate_source_layer needs {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key}={value!r} must be a positive integer")
    return value
