"""A prefix common to every session (``dhisparse plan --shared-prefix``): the GPU bytes held once
per GPU by mode, the worker's rules for when nothing is shared, sessions per GPU with the prefix
held once, the store's copy on the host, and the plan's table and JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dhisparse.capacity import (
    MODES,
    IndexGroup,
    Profile,
    SourceGroup,
    dsv4_flash,
    get_profile,
    glm53,
    host_bytes,
    prefix_unshared,
    session_bytes,
    sessions_per_gpu,
    sessions_that_fit,
    shared_prefix_bytes,
    shared_prefix_host_bytes,
)
from dhisparse.capacity.model import complete_page_tokens
from dhisparse.cli import main
from dhisparse.family.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
DSV32 = str(ROOT / "tests" / "fixtures" / "configs" / "deepseek-v3.2")


def shareable() -> Profile:
    """One row per token everywhere, p=4, index keys in pages of 6: small enough to add up."""
    return Profile(
        name="shareable",
        sources=(
            SourceGroup(count=3, row_bytes=70),  # sparse, m=1
            SourceGroup(count=1, row_bytes=40, kind="dense"),  # m=1
        ),
        indexers=(IndexGroup(count=2, key_bytes=30),),
        top_k=4,
        hot_cache_rows=8,
        chi=2,
        page_size=4,
        key_page_rows=6,
    )


def test_complete_page_tokens() -> None:
    assert complete_page_tokens(10, 1, 4) == 8
    assert complete_page_tokens(8, 1, 6) == 6
    assert complete_page_tokens(50, 4, 4) == 48  # 12 rows: three pages of 4 rows
    assert complete_page_tokens(3, 1, 4) == 0


def test_a_prefix_of_two_and_a_half_pages_shares_two() -> None:
    prof = shareable()
    # 10 tokens: 2 complete pages of 4 tokens (8 tokens); their 8 keys fill one page of 6 keys
    rows = 3 * 8 * 70 + 1 * 8 * 40  # 1680 + 320: every source's rows, dense included
    keys = 2 * 6 * 30  # 360
    assert shared_prefix_bytes(prof, 10, "resident") == rows + keys == 2360
    assert shared_prefix_bytes(prof, 10, "hierarchy") == keys == 360
    assert shared_prefix_bytes(prof, 8, "resident") == 2360  # the same two pages
    assert shared_prefix_bytes(prof, 3, "resident") == 0  # no complete page
    # 12 tokens: three pages of rows, still one of keys (12 keys fill two of 6)
    assert shared_prefix_bytes(prof, 12, "hierarchy") == 2 * 12 * 30 == 720
    assert shared_prefix_bytes(prof, 12, "resident") == 3 * 12 * 70 + 12 * 40 + 720 == 3720


def test_sessions_per_gpu_hold_the_prefix_once() -> None:
    prof = shareable()
    resident = session_bytes(prof, 30, "resident")
    hierarchy = session_bytes(prof, 30, "hierarchy")
    # resident: rows 3·32·70 + 32·40 = 8000, keys 2·30·30 = 1800 (30 keys: five pages of 6),
    # page map 4·8 = 32; hierarchy: dense 1280, hot 3·8·70 = 1680, tail 3·4·70 = 840
    assert resident.total == 8000 + 1800 + 32 == 9832
    assert hierarchy.total == 1280 + 1680 + 840 + 1800 + 32 == 5632
    pool = 50_000
    assert sessions_per_gpu(prof, 30, "resident", pool) == 5  # 5·9832 = 49,160
    # 2360 + 6·(9832 − 2360) = 47,192 <= 50,000 < 54,664 = 2360 + 7·7472
    assert sessions_per_gpu(prof, 30, "resident", pool, shared_bytes=2360) == 6
    assert sessions_per_gpu(prof, 30, "hierarchy", pool) == 8  # 8·5632 = 45,056 < 50,688
    # 360 + 9·5272 = 47,808 <= 50,000 < 53,080
    assert sessions_per_gpu(prof, 30, "hierarchy", pool, shared_bytes=360) == 9


def test_sessions_that_fit_with_shared_bytes() -> None:
    # 4 sessions need 10 + 12 + 4·18 = 94 bytes, 5 need 112
    assert sessions_that_fit(100, 30, 10, shared_bytes=12) == 4
    assert sessions_that_fit(100, 30, 10) == 3
    assert sessions_that_fit(29, 30, 0, shared_bytes=12) == 0  # the first pays for it whole
    assert sessions_that_fit(100, 30, 10, slots=2, shared_bytes=12) == 2
    with pytest.raises(ValueError, match="bytes of its own"):
        sessions_that_fit(100, 30, shared_bytes=30)
    with pytest.raises(ValueError):
        sessions_that_fit(100, 30, shared_bytes=-1)


def test_a_compressed_key_source_shares_nothing() -> None:
    base = shareable()
    prof = replace(
        base,
        sources=(*base.sources, SourceGroup(count=1, row_bytes=50, compress=4)),
        indexers=(*base.indexers, IndexGroup(count=1, key_bytes=12, compress=4)),
    )
    assert prefix_unshared(prof, "hierarchy") == "index keys of compressed or windowed sources"
    assert prefix_unshared(prof, "resident") == (
        "rows that are not one per token (compressed or windowed sources)"
    )
    assert shared_prefix_bytes(prof, 400, "hierarchy") == 0
    assert shared_prefix_bytes(prof, 400, "resident") == 0
    # the uncompressed producers alone would share 66 pages of 6 keys of the 100 pages' 400
    assert shared_prefix_bytes(base, 400, "hierarchy") == 2 * 396 * 30 == 23_760


def test_compressed_or_windowed_sources_share_nothing_resident() -> None:
    windowed = replace(shareable(), sources=(SourceGroup(count=3, row_bytes=70, window=16),))
    assert shared_prefix_bytes(windowed, 400, "resident") == 0
    assert shared_prefix_bytes(windowed, 400, "hierarchy") == 0  # a producer's source, windowed
    assert prefix_unshared(windowed, "resident") == (
        "rows that are not one per token (compressed or windowed sources)"
    )
    ring = replace(
        shareable(), sources=(*shareable().sources, SourceGroup(1, 20, window=8, kind="window"))
    )
    assert shared_prefix_bytes(ring, 400, "resident") == 0
    assert shared_prefix_bytes(ring, 400, "hierarchy") == 2 * 396 * 30  # 66 pages of 6 keys
    dsv4 = dsv4_flash()
    assert all(shared_prefix_bytes(dsv4, 8192, m) == 0 for m in MODES)


PROFILES = [shareable(), glm53(), dsv4_flash(), *(get_profile(n) for n in sorted(PRESETS))]


@pytest.mark.parametrize("prof", PROFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("mode", MODES)
def test_shared_bytes_are_whole_pages_within_the_session(prof: Profile, mode: str) -> None:
    p = prof.page_size
    for context in (1, p - 1, 5 * p + 3, 1000, 4096):
        sb = session_bytes(prof, context, mode)  # type: ignore[arg-type]
        parts = sb.index_keys + (sb.history if mode == "resident" else 0)
        for prefix in {0, 1, p, context // 2, context - 1, context}:
            if prefix > context:
                continue
            shared = shared_prefix_bytes(prof, prefix, mode)  # type: ignore[arg-type]
            assert 0 <= shared <= parts
            # the incomplete page adds nothing
            assert shared == shared_prefix_bytes(prof, prefix // p * p, mode)  # type: ignore[arg-type]


def test_glm53_shares_whole_pages() -> None:
    prof = glm53()
    page_rows, page_keys = 64 * 78 * 576, 64 * 21 * 132
    assert shared_prefix_bytes(prof, 8192, "resident") == 128 * (page_rows + page_keys)
    assert shared_prefix_bytes(prof, 8192, "hierarchy") == 128 * page_keys == 22_708_224
    assert shared_prefix_bytes(prof, 8255, "hierarchy") == 22_708_224  # 128.98 pages: 128


def test_the_store_keeps_one_copy_of_the_prefix_rows() -> None:
    prof = shareable()
    assert shared_prefix_host_bytes(prof, 10) == 3 * 8 * 70 == 1680  # sparse rows, 2 pages
    assert shared_prefix_host_bytes(prof, 10) == host_bytes(prof, 8)
    assert shared_prefix_host_bytes(glm53(), 8192) == 8192 * 78 * 576 == 368_050_176


# ---- dhisparse plan --shared-prefix -----------------------------------------------------------
PLAN = ["plan", "--profile", "glm-5.3", "--context", "100000", "--shared-prefix", "8192"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([*PLAN, "--json"], capsys)
    assert rc == 0
    shared = json.loads(out)["shared_prefix"]
    assert shared["tokens"] == 8192
    assert shared["shares"] == [
        {"mode": "resident", "bytes": 390_758_400, "unshared": None},  # 8192·(78·576 + 21·132)
        {"mode": "hierarchy", "bytes": 22_708_224, "unshared": None},  # 8192·21·132
    ]
    assert shared["admissions"] == [
        {"mode": "resident", "drafter": None, "own_bytes": 4_771_532_652 - 390_758_400,
         "per_gpu": 5, "total": 20},
        # ⌊(24,427,626,496 − 22,708,224) / 441,487,212⌋ = 55 of the 22.75 GiB pool
        {"mode": "hierarchy", "drafter": None, "own_bytes": 464_195_436 - 22_708_224,
         "per_gpu": 55, "total": 220},
    ]  # fmt: skip
    # 220 backups of 4,494,237,696 B, whole, and the store's copy of the prefix's rows
    assert shared["host"] == {
        "record": 368_050_176,
        "sessions": 220,
        "bytes": 220 * 4_494_237_696 + 368_050_176,
        "holds": 956,  # ⌊(4.3e12 − 368,050,176) / 4,494,237,696⌋
    }


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([*PLAN, "--drafter", "dflash2"], capsys)
    assert rc == 0
    lines = out.splitlines()
    for line in (
        "shared prefix: the first 8,192 tokens of every session, 128 complete pages of 64",
        "  the prefix, held once                         0.364        0.021",
        "  each session besides                          4.080        0.411",
        "  each session besides, with dflash2            4.105        0.471",
        "  no drafter, prefix shared                    5 (20)     55 (220)",
        "  dflash2, prefix shared                       4 (16)     36 (144)",
        "  the cached prefix (once, in the store)        0.368 GB",
        "  220 sessions and the cached prefix            0.989 TB",
    ):
        assert line in lines, line


def test_plan_says_why_nothing_is_shared(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "dsv4-flash", "--context", "50000", "--shared-prefix", "4096"]
    rc, out, _ = run([*argv, "--pool-gib", "20"], capsys)
    assert rc == 0
    assert "  the prefix, held once                             -            -" in out
    assert "  hierarchy shares nothing: index keys of compressed or windowed sources" in out
    assert "  resident shares nothing: rows that are not one per token" in out


def test_without_the_flag_the_plan_has_no_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([*PLAN[:-2], "--json"], capsys)
    assert rc == 0 and "shared_prefix" not in json.loads(out)
    rc, out, _ = run(PLAN[:-2], capsys)
    assert rc == 0 and "prefix" not in out


def test_a_prefix_longer_than_the_context_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["plan", "--profile", "glm-5.3", "--context", "4096", "--shared-prefix",
                      "4097"], capsys)  # fmt: skip
    assert rc == 2
    assert "--shared-prefix 4097 is longer than --context 4096" in err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--profile", "glm-5.3", "--context", "4096", "--shared-prefix", "0"])
    assert exc.value.code == 2
    assert "a prefix of 0 tokens" in capsys.readouterr().err


def test_layouts_share_no_key_in_a_tensor_parallel_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", DSV32, "--context", "131072", "--kv-cache-dtype", "fp8",
            "--tensor-parallel-size", "8", "--layouts", "all", "--gpu-gib", "139",
            "--reserve-gib", "10", "--host-gib", "1800", "--shared-prefix", "8192"]  # fmt: skip
    rc, out, _ = run([*argv, "--json"], capsys)
    assert rc == 0
    layouts = {lp["name"]: lp["shared_prefix"] for lp in json.loads(out)["layouts"]}
    keys, rows = 8192 * 61 * 132, 8192 * 61 * 656  # 61 producers of 132 B FP8 keys, 656 B rows
    for name, shared in layouts.items():
        resident, hierarchy = shared["shares"]
        assert resident["bytes"] == rows + keys
        if name.startswith("tp"):
            assert hierarchy == {"mode": "hierarchy", "bytes": 0,
                                 "unshared": "a tensor-parallel group keeps no key records"}  # fmt: skip
        else:
            assert hierarchy["bytes"] == keys == 65_961_984
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    assert "  hierarchy shares nothing under tp, tp+ep: a tensor-parallel group keeps" in out
    lines = out.splitlines()
    assert (
        "  hierarchy, shared                              42               42     "
        "240 (30/GPU)     240 (30/GPU)"
    ) in lines


def test_the_documented_example_prints_what_it_shows(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (ROOT / "docs" / "capacity.md").read_text()
    section = doc.split("## A shared prefix", 1)[1]
    block = section.split("```\n", 2)[1]
    command, shown = block.split("\n", 1)
    assert command == "$ dhisparse plan " + " ".join(PLAN[1:])
    rc, out, _ = run(PLAN, capsys)
    assert rc == 0
    assert out[out.index("shared prefix:") :] == shown
