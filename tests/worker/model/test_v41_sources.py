"""DeepSeek-V4.1's shared sources on a tiny random V4 checkpoint built and saved by transformers
5.17.0, its config.json extended with ``kv_source_layers`` / ``index_source_layers`` (which
transformers ignores), against the plain-torch reference ``tests.v41_reference``: layer 0
sliding, layer 1 a KV and index source, 2 a Reuse consumer of it, 3 a Reindex consumer (its
own top-k over layer 1's index keys), 4 a Reuse consumer of 3's selection over layer 1's rows,
5 a second KV and index source. Teacher-forced logits in chunks and decode steps, the loader
leaving the consumers' compressors unread (or meeting a checkpoint without them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.weights.v4_names import load_v4_model
from tests import hf_tiny, hf_tiny_v4, v41_reference

RTOL = 1e-4
KV, INDEX = [1, 5], [1, 3, 5]
CSA = "compressed_sparse_attention"
LAYERS = ["sliding_attention", *[CSA] * 5]


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    config = hf_tiny_v4.v4_config(
        num_hidden_layers=6, layer_types=LAYERS,
        mlp_layer_types=["hash_moe", "hash_moe", *["moe"] * 4],
    )  # fmt: skip
    return hf_tiny_v4.build(config, seed=41)


@pytest.fixture(scope="module")
def path(ref, tmp_path_factory) -> Path:
    path = hf_tiny_v4.save_hub_style(ref, tmp_path_factory.mktemp("v41"))
    return with_shared_sources(path)


def with_shared_sources(path: Path) -> Path:
    raw = json.loads((path / "config.json").read_text())
    raw |= {"kv_source_layers": KV, "index_source_layers": INDEX}
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def test_the_consumers_build_no_compressor_and_reuse_builds_no_indexer(path) -> None:
    model = load_v4_model(path)
    share = model.cfg.sharing
    assert [share.role(i) for i in range(6)] == [
        "sliding", "full", "reuse", "reindex", "reuse", "full",
    ]  # fmt: skip
    assert share.kv_source == (-1, 1, 1, 1, 1, 5) and share.index_source == (-1, 1, 1, 3, 3, 5)
    names = model.state_dict()
    for i, (rows, index, keys) in enumerate(
        [(False, False, False), (True, True, True), (False, False, False),
         (False, True, False), (False, False, False), (True, True, True)]
    ):  # fmt: skip
        at = f"layers.{i}.attn."
        assert (f"{at}compressor.wkv.weight" in names) == rows, i
        assert (f"{at}indexer.wq_b.weight" in names) == index, i
        assert (f"{at}indexer.compressor.wkv.weight" in names) == keys, i
        assert f"{at}wkv.weight" in names  # every layer's own window


def test_chunks_and_decode_steps_give_the_reference_logits(ref, path) -> None:
    """A prefill of 13, seven one-token decode steps and a chunk of 26: 46 tokens hold 11 rows
    of each source (index_topk 4), past the window of 8; each step's logits are the
    reference's over the whole sequence, and differ from V4's (the sources matter)."""
    ids = hf_tiny_v4.token_ids(46, 11)
    model = load_v4_model(path)
    state = model.new_state()
    steps = [(0, 13), *((i, i + 1) for i in range(13, 20)), (20, 46)]
    got = torch.cat([model(ids[a:b], state) for a, b in steps])
    want = v41_reference.logits(ref, KV, INDEX, ids)
    hf_tiny_v4.assert_close(got, want, RTOL)
    v4 = v41_reference.logits(ref, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], ids)
    assert torch.equal(v4, hf_tiny.reference_logits(ref, ids))  # every layer its own: V4
    assert (v4 - want).abs().max() > 1e-2 * want.abs().max()


def test_a_checkpoint_without_the_consumers_compressors_loads_the_same(path, tmp_path) -> None:
    """The form a V4.1 checkpoint would have: no compressor on a consumer, no indexer on a
    Reuse layer; the same model as the V4 checkpoint whose unused tensors were left unread."""
    weights = load_file(str(path / "model.safetensors"))
    unbuilt = tuple(
        f"layers.{i}.attn.{part}." for i in (2, 4) for part in ("compressor", "indexer")
    )
    unbuilt += ("layers.3.attn.compressor.", "layers.3.attn.indexer.compressor.")
    keep = {n: t for n, t in weights.items() if not n.startswith(unbuilt)}
    # a compressor: wkv, wgate, ape, norm; an indexer: its compressor, wq_b, weights_proj
    assert len(weights) - len(keep) == 2 * (4 + 6) + 4 + 4
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_text((path / name).read_text())
    save_file(keep, str(tmp_path / "model.safetensors"))
    want, got = load_v4_model(path).state_dict(), load_v4_model(tmp_path).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
