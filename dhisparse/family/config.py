"""Model configuration for the DSA-style decoder family.

Topology vocabulary (DESIGN §2):

- A *KV source* stores one row of ``d_kv`` elements per ``compress`` tokens (m). The first layer
  that names a source is its *owner* and computes its rows; later layers naming the same source
  are *consumers* of a shared source.
- Every layer attends over rows selected by a top-k indexer. How it gets its selection:
  ``producer``  runs its own lightning indexer over its source (a Reindex consumer when it is not
                the owner);
  ``follower``  uses the positions selected by ``leader`` (an index producer over a different
                source with the same compression): shared indices, distinct payloads;
  ``reuse``     inherits ``leader``'s selected-location vector (same source): no new selection
                and no new resolution.
  A producer scores index keys of its own, or (``keys_from``) those an earlier producer over
  the same source writes: DeepSeek-V4.1's Reindex consumer scores its KV source's keys, so
  the source's keys are stored once.
- A source with ``window > 0`` adds a local sliding-window branch over the last ``window``
  uncompressed token rows, attended jointly with the selected rows.
- A source with ``lag > 0`` trails the tokens: its row t needs token t + lag, so after n tokens
  it holds n - lag complete rows (the MTP layer's source: row t is computed from the token at
  t+1 and the target's hidden state at t). A lagged source with a window keeps its window rows
  in its token ring under the token that completes them (row t at position t + lag), so the
  window of a query at token p is rows p - lag - window + 1 .. p - lag, positions below ``lag``
  holding no row (DeepSeek-V4's MTP layer: a sliding-window layer).
- A source with ``stored=False`` keeps no history: its rows live only in its token ring's
  window, so the payload, the host backups, durable sessions and cached prefixes hold nothing
  of it but the ring (``rows_for_tokens`` is 0). Its one reader attends only that window
  (DeepSeek-V4's MTP layer). Such sources come after every stored one, so the stored sources
  are ``0 .. len(stored_sources) - 1`` wherever a list is kept per stored source.
- A ``draft`` layer is a drafter's layer (the checkpoint's MTP layer): the target's forward
  writes its source's rows but does not run it; its index producer's keys join the index-key
  caches like any producer's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

# how a layer chooses its rows: its own indexer over index keys (producer), a producer's
# selection over its own source (follower), an earlier layer's resolved locations (reuse), or
# no indexer and no keys (none: a layer attending only its window, or every visible row)
IndexMode = Literal["producer", "follower", "reuse", "none"]


@dataclass(frozen=True)
class SourceSpec:
    compress: int = 1  # m tokens per stored row (1 = none)
    window: int = 0  # local sliding-window branch over uncompressed tokens (0 = none)
    lag: int = 0  # rows trail tokens: row t needs token t + lag (the MTP source: 1)
    stored: bool = True  # False: rows only in the token ring's window, no history kept


@dataclass(frozen=True)
class LayerSpec:
    source: int  # -1: none (index "none": the layer attends a window the model keeps itself)
    index: IndexMode = "producer"
    leader: int = -1  # follower: the index producer it follows; reuse: the layer it inherits from
    draft: bool = False  # a drafter's layer (MTP): not run by the target's forward
    keys_from: int = -1  # producer: the earlier producer whose index keys it scores (-1: own)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    d_model: int
    n_heads: int
    d_latent: int  # MLA latent (kv_lora_rank): the value part of a stored row
    d_rope: int  # decoupled RoPE key part of a stored row
    d_ff: int
    n_index_heads: int
    d_index: int
    index_topk: int  # k: rows each query attends to (besides the local window)
    sources: tuple[SourceSpec, ...]
    layers: tuple[LayerSpec, ...]
    max_position: int = 65536
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    eos_token_id: int = 257
    bos_token_id: int | None = 256
    mask_token_id: int | None = 259
    tie_embeddings: bool = True
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------------------
    @property
    def d_kv(self) -> int:
        """Elements per stored KV row (latent + rope), the MQA key width."""
        return self.d_latent + self.d_rope

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def source_owner(self, source: int) -> int:
        """The layer that computes and writes the rows of ``source``."""
        for i, spec in enumerate(self.layers):
            if spec.source == source:
                return i
        raise ValueError(f"source {source} is read by no layer")

    def is_owner(self, layer: int) -> bool:
        return self.source_owner(self.layers[layer].source) == layer

    @property
    def index_producers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s.index == "producer")

    @property
    def key_producers(self) -> tuple[int, ...]:
        """The producers that write index keys of their own: the layers of the key caches."""
        return tuple(i for i in self.index_producers if self.layers[i].keys_from < 0)

    def key_layer(self, layer: int) -> int:
        """The producer whose index keys producer ``layer`` scores."""
        keys_from = self.layers[layer].keys_from
        return layer if keys_from < 0 else keys_from

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """The drafter's layers (the MTP layer), after every target layer."""
        return tuple(i for i, s in enumerate(self.layers) if s.draft)

    @property
    def stored_sources(self) -> range:
        """The sources whose rows are stored (payload, host backups, durable sessions, cached
        prefixes): the first ones, every source with ``stored=False`` after them."""
        return range(sum(src.stored for src in self.sources))

    def rows_for_tokens(self, source: int, num_tokens: int) -> int:
        """Complete stored rows of ``source`` after ``num_tokens`` tokens (eq. 8; a lagged
        source's row t needs token t + lag; a source that keeps no history stores none)."""
        src = self.sources[source]
        if not src.stored:
            return 0
        return max(0, num_tokens - src.lag) // src.compress

    def validate(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if self.index_topk < 1:
            raise ValueError("index_topk must be >= 1")
        for s, src in enumerate(self.sources):
            if src.compress < 1:
                raise ValueError(f"source {s}: compress must be >= 1")
            if src.window < 0:
                raise ValueError(f"source {s}: window must be >= 0")
            if src.compress > 1 and src.window < 1:
                # Until a group completes its tokens are visible only through the window.
                raise ValueError(f"source {s}: a compressed source needs a local window")
            if src.lag < 0 or (src.lag and src.compress > 1):
                raise ValueError(f"source {s}: a lag is >= 0, on an uncompressed source")
            self.source_owner(s)
            if not src.stored:
                self._validate_unstored(s)
        self._validate_draft_layers()
        for i, spec in enumerate(self.layers):
            if spec.source == -1 and spec.index == "none" and not spec.draft:
                continue  # a layer attending only a window of its own (a model's state ring)
            if not 0 <= spec.source < len(self.sources):
                raise ValueError(f"layer {i}: unknown source {spec.source}")
            if spec.keys_from >= 0:
                self._validate_keys_from(i)
            if spec.index in ("producer", "none"):
                continue  # "none": no indexer, no keys (a layer attending its window or every row)
            if not 0 <= spec.leader < i:
                raise ValueError(f"layer {i}: leader must be an earlier layer, got {spec.leader}")
            leader = self.layers[spec.leader]
            if spec.index == "follower":
                if leader.index != "producer":
                    raise ValueError(f"layer {i}: follows layer {spec.leader}, not a producer")
                ms = self.sources[spec.source].compress, self.sources[leader.source].compress
                if ms[0] != ms[1]:
                    raise ValueError(
                        f"layer {i}: follower and leader sources differ in compression"
                    )
            elif spec.index == "reuse":
                if leader.source != spec.source:
                    raise ValueError(f"layer {i}: reuse needs the leader's source {leader.source}")
                if self.is_owner(i):
                    raise ValueError(f"layer {i}: a reuse consumer cannot own its source")
                later = [
                    j
                    for j in range(spec.leader + 1, i)
                    if self.layers[j].source == spec.source and self.layers[j].index != "reuse"
                ]
                if later:
                    # Layer j resolved the source after the leader and may have evicted or
                    # overwritten rows behind the leader's locations.
                    raise ValueError(
                        f"layer {i}: reuses layer {spec.leader}'s locations, but layer {later[0]} "
                        "resolved the same source in between"
                    )
            else:
                raise ValueError(f"layer {i}: unknown index mode {spec.index!r}")

    def _validate_unstored(self, s: int) -> None:
        """Source ``s`` keeps no history: a windowed, uncompressed source after every stored
        source, read by one layer that runs no indexer (it attends only the window)."""
        src = self.sources[s]
        readers = [self.layers[i] for i, o in enumerate(self.layers) if o.source == s]
        if src.window < 1 or src.compress != 1:
            raise ValueError(f"source {s}: a source that keeps no history is windowed, m = 1")
        if len(readers) != 1 or readers[0].index != "none":
            raise ValueError(
                f"source {s}: a source that keeps no history is read by one layer with index "
                '"none" (its window alone)'
            )
        if any(o.stored for o in self.sources[s + 1 :]):
            raise ValueError(f"source {s}: a source that keeps no history follows every stored one")

    def _validate_keys_from(self, i: int) -> None:
        """Layer ``i`` scores the keys of an earlier producer over its source that writes keys
        of its own."""
        spec = self.layers[i]
        owner = self.layers[spec.keys_from] if 0 <= spec.keys_from < i else None
        if (
            spec.index != "producer"
            or owner is None
            or owner.index != "producer"
            or owner.keys_from >= 0
            or owner.source != spec.source
        ):
            raise ValueError(
                f"layer {i}: keys_from {spec.keys_from} must be an earlier producer over the "
                "same source with keys of its own, read by a producer"
            )

    def _validate_draft_layers(self) -> None:
        """A draft layer follows every target layer, owns a source of its own that no other
        layer reads, and runs its own indexer; only a draft layer's source may lag."""
        drafts = self.draft_layers
        if drafts and drafts != tuple(range(self.n_layers - len(drafts), self.n_layers)):
            raise ValueError(f"draft layers {list(drafts)} must follow every target layer")
        if len(drafts) == self.n_layers:
            raise ValueError("a model needs at least one target layer")
        for i in drafts:
            spec = self.layers[i]
            readers = [j for j, o in enumerate(self.layers) if o.source == spec.source]
            if spec.index not in ("producer", "none") or readers != [i]:
                raise ValueError(
                    f"layer {i}: a draft layer is a producer (or keyless) over a source of its own"
                )
            if any(o.index != "producer" and o.leader == i for o in self.layers):
                raise ValueError(f"layer {i}: no layer may follow a draft layer")
        for s, src in enumerate(self.sources):
            if src.lag and not self.layers[self.source_owner(s)].draft:
                raise ValueError(f"source {s}: only a draft layer's source may lag")

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = [asdict(s) for s in self.sources]
        d["layers"] = [asdict(s) for s in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        d = dict(d)
        d["sources"] = tuple(SourceSpec(**s) for s in d["sources"])
        d["layers"] = tuple(LayerSpec(**s) for s in d["layers"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
