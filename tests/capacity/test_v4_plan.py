"""``dhisparse plan --model DIR`` on a DeepSeek-V4 directory, with and without DeepSeek-V4.1's
shared sources: the profile is the engine's V4 topology (a shared source and its index keys
counted once, host backups of each source once) beside its per-slot rings (each compressor's
token projections, each consumer's own window), read from config.json alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dhisparse.capacity import profile_from_model_dir
from dhisparse.capacity.model import host_bytes, session_bytes
from dhisparse.capacity.model_size import model_size_from_dir
from dhisparse.capacity.profile import SourceGroup
from dhisparse.cli import main as cli_main
from tests.fixtures import CONFIGS

HUB = json.loads((CONFIGS / "deepseek-v4-flash" / "config.json").read_text())
# 10 layers: two sliding-only, eight CSA (rate 4); V4.1: sources at 2 and 6, indexers at 2, 4,
# 6 and 8 (layers 3, 5, 7, 9 Reuse, 4 and 8 Reindex)
TEN = HUB | {"num_hidden_layers": 10, "compress_ratios": [0, 0, *[4] * 8, 0]}
SHARED = {"kv_source_layers": [2, 6], "index_source_layers": [2, 4, 6, 8]}


def _dir(tmp_path: Path, name: str, raw: dict) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _groups(profile, kind: str) -> list[tuple[int, int, int, int]]:
    return [(g.count, g.row_bytes, g.compress, g.window) for g in profile.sources if g.kind == kind]


def test_a_shared_source_and_its_keys_count_once(tmp_path) -> None:
    own = profile_from_model_dir(_dir(tmp_path, "v4", TEN))
    shared = profile_from_model_dir(_dir(tmp_path, "v41", TEN | SHARED))
    row = 512 * 2  # the K=V head in bf16
    # the sliding layers hold no source: their windows are rings of their own
    assert _groups(own, "sparse") == [(8, row, 4, 128)]
    assert _groups(shared, "sparse") == [(2, row, 4, 128)]
    # the compressors' rings (index: 2·4 positions of 4·128; KV: 2·4 of 4·512), the sliding
    # layers' and the consumers' own windows (128 K=V rows)
    assert _groups(own, "window") == [
        (8, 4 * 128 * 2, 1, 8), (8, 4 * 512 * 2, 1, 8), (2, row, 1, 128),
    ]  # fmt: skip
    assert _groups(shared, "window") == [
        (2, 4 * 128 * 2, 1, 8), (2, 4 * 512 * 2, 1, 8), (8, row, 1, 128),
    ]  # fmt: skip
    # index keys: the KV sources', once (the sliding layers run no indexer)
    assert [(g.count, g.compress) for g in own.indexers] == [(8, 4)]
    assert [(g.count, g.compress) for g in shared.indexers] == [(2, 4)]
    assert own.chi == shared.chi == 1
    tokens = 32768
    history = SourceGroup(count=1, row_bytes=row, compress=4)
    per_source = host_bytes(own, tokens) - host_bytes(shared, tokens)
    assert per_source == 6 * host_bytes(replace(own, sources=(history,)), tokens) > 0


def test_the_mtp_layer_adds_a_window_and_no_byte_per_token(capsys) -> None:
    """``--drafter mtp`` on DeepSeek-V4-Flash: the MTP layer's source keeps no history, so a
    token adds 6,880 B in bf16 with it as without it (docs/capacity.md), host backups are the
    same, and its 128-row window joins the sliding layers' window group."""
    flash = CONFIGS / "deepseek-v4-flash"
    alone, with_mtp = profile_from_model_dir(flash), profile_from_model_dir(flash, mtp=True)

    def grown(profile, tokens: int) -> int:  # history and index keys of one session
        sb = [session_bytes(profile, n, "resident") for n in (tokens, 2 * tokens)]
        return sb[1].history + sb[1].index_keys - sb[0].history - sb[0].index_keys

    tokens = 8192  # whole pages of every source's rows and keys
    assert grown(with_mtp, tokens) == grown(alone, tokens) == 6880 * tokens
    assert host_bytes(with_mtp, tokens) == host_bytes(alone, tokens)
    assert _groups(with_mtp, "sparse") == _groups(alone, "sparse")
    windows = set(_groups(with_mtp, "window")) - set(_groups(alone, "window"))
    assert windows == {(3, 512 * 2, 1, 128)}  # the two sliding layers' and the MTP layer's
    assert (2, 512 * 2, 1, 128) in _groups(alone, "window")
    args = ["plan", "--model", str(flash), "--context", "8192"]
    assert cli_main([*args, "--drafter", "mtp"]) == 0
    out = capsys.readouterr().out
    assert "3 × window 1024 B/row (m=1, window 128)" in out and "one more window" in out


def test_plan_prints_a_v41_directory(tmp_path, capsys) -> None:
    path = _dir(tmp_path, "v41", TEN | SHARED)
    assert model_size_from_dir(path) is None  # V4's parameters are not counted
    assert cli_main(["plan", "--model", str(path), "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "2 × sparse 1024 B/row (m=4, window 128)" in out
    assert "8 × window 1024 B/row (m=1, window 128)" in out


def test_fp8_rows_and_unsupported_sources_are_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype auto"):
        profile_from_model_dir(_dir(tmp_path, "v41", TEN | SHARED), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="heavily_compressed_attention"):
        profile_from_model_dir(_dir(tmp_path, "hca", HUB | SHARED | {"kv_source_layers": [2]}))
