"""A worker's model and engine split over 2 ranks of a real gloo group (one process per rank):
tensor parallel, TP + expert parallel, and data-parallel attention (with EP, or with the
experts split by intermediate dimension) give one process's logits (max |Δ| / max |logit|
<= 1e-5, fp32) and greedy tokens, on tiny transformers checkpoints of both real families, in
resident and adaptive modes and with a drafter; each rank holds 1/N of every sharded tensor;
the TP ranks' resolvers choose the same locations; under data-parallel attention each rank
serves only the requests placed on it, and one request on two ranks completes; bad layouts
fail at start-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dhisparse.family.hf_config import parse_config
from dhisparse.family.hf_dir import read_config
from dhisparse.family.parallel_layout import LayoutError, ParallelConfig, RankLayout
from services.kv_host_store import KVHostStoreClient
from services.worker.parallel.comm import LOCAL
from tests import hf_tiny, ranks
from tests.group import run_group
from tests.kv_host_store.conftest import store_client

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}
LAYOUTS = ranks.LAYOUTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family, config in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        hf_tiny.save_hub_style(hf_tiny.build(config(), seed=5), path, max_shard_size="40KB")
        out[family] = path
    return out


V32, GLM = "deepseek_v32", "glm_moe_dsa"


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert (got - ref).abs().max() / ref.abs().max() <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "family,layout",
    [
        (V32, "tp"),
        (GLM, "tp"),
        (V32, "tp+ep"),
        (GLM, "tp+ep"),
        (V32, "dp-attention+ep"),
        (GLM, "dp-attention"),
    ],
)
def test_sharded_model_gives_one_process_logits(
    checkpoints: dict[str, Path], family: str, layout: str
) -> None:
    checkpoint = checkpoints[family]
    dp = "dp" in layout
    one = [ranks.model_pass(LOCAL, checkpoint, None, p) for p in range(2 if dp else 1)]
    group = run_group(ranks.model_pass, 2, checkpoint, LAYOUTS[layout])
    if dp:  # each rank its own prompt, in its own chunks
        for rank in range(2):
            _close(group[rank]["logits"], one[rank]["logits"])
            for a, b in zip(one[rank]["locations"], group[rank]["locations"], strict=True):
                assert torch.equal(a, b)
        # rank 1 ran fewer passes: it served rank 0's last rounds with no tokens of its own
        assert group[1]["rounds"][1] > 0 and group[0]["rounds"][0] == group[1]["rounds"][0]
        kind = "all_to_all" if "ep" in layout else "all_gather"
        assert all(g["collectives"][kind] > 0 for g in group)
    else:
        _close(group[0]["logits"], one[0]["logits"])
        # the same rows everywhere: every layer's locations equal across ranks and one process
        for a, b, c in zip(one[0]["locations"], group[0]["locations"], group[1]["locations"],
                           strict=True):  # fmt: skip
            assert torch.equal(a, b) and torch.equal(b, c)
    one = one[0]
    # each rank holds 1/N of each sharded tensor, all of each replicated one
    cfg = parse_config(read_config(checkpoint))
    lay = RankLayout(ParallelConfig(2, **LAYOUTS[layout]), 0, cfg)
    sharded = [n for n in one["sizes"] if lay.cut(n) is not None]
    assert any("experts" in n for n in sharded)
    # data-parallel attention: attention, dense MLPs and the vocabulary whole on every rank
    assert any("q_b_proj" in n for n in sharded) != dp
    for name, full in one["sizes"].items():
        per_rank = [g["sizes"][name] for g in group]
        assert per_rank == ([full // 2] * 2 if name in sharded else [full] * 2), name
    if layout == "tp+ep":
        n = cfg.moe.n_routed
        assert group[0]["sizes"]["layers.1.mlp.experts.down_proj"] == (n // 2) * 64 * 32
    if not dp:
        for g in group:
            assert g["collectives"]["all_reduce"] > 0 and g["collectives"]["all_gather"] > 0


# every layout once, both families, every mode, with and without a drafter (the logits test
# above runs every layout on both families)
@pytest.mark.parametrize(
    "family,layout,mode,drafter",
    [(GLM, "tp", "adaptive", None), (GLM, "tp+ep", "hisparse", "dflash"),
     (V32, "dp-attention+ep", "hisparse", "dflash"), (V32, "dp-attention", "resident", None)],
)  # fmt: skip
def test_group_engine_greedy_equals_one_process(
    checkpoints: dict[str, Path], family: str, layout: str, mode: str, drafter: str | None
) -> None:
    checkpoint = checkpoints[family]
    one = ranks.greedy(LOCAL, checkpoint, None, mode, drafter)
    group = run_group(ranks.greedy, 2, checkpoint, LAYOUTS[layout], mode, drafter)
    assert group[0]["tokens"] == one["tokens"]
    assert group[0]["steps"] == group[1]["steps"] > 0
    for g in group:
        assert g["collectives"]["broadcast"] >= g["steps"]
    if "dp" in layout:
        # each rank prefilled only the prompts placed on it: together, each prompt once
        assert group[0]["prefilled"] > 0 and group[1]["prefilled"] > 0
        assert group[0]["prefilled"] + group[1]["prefilled"] == one["prefilled"]
        if drafter:
            assert group[0]["drafts"] > 0 and group[1]["drafts"] > 0
        return
    assert group[0]["census"] == group[1]["census"] == one["census"]
    if drafter:
        assert group[0]["drafts"] == group[1]["drafts"] == one["drafts"] > 0


def test_one_request_on_two_data_parallel_ranks_completes(checkpoints: dict[str, Path]) -> None:
    checkpoint, layout = checkpoints[GLM], "dp-attention+ep"
    one = ranks.greedy(LOCAL, checkpoint, None, "adaptive", None, 1)
    group = run_group(ranks.greedy, 2, checkpoint, LAYOUTS[layout], "adaptive", None, 1)
    assert group[0]["tokens"] == one["tokens"]
    # rank 1 served none of it, yet joined every step's MoE rounds
    assert group[1]["prefilled"] == 0 and group[1]["steps"] == group[0]["steps"] > 0


def test_layouts_that_do_not_divide_fail_at_start_up() -> None:
    cfg = parse_config(hf_tiny.v32_config().to_dict())
    with pytest.raises(LayoutError, match="attention heads"):
        RankLayout(ParallelConfig(3), 0, cfg).validate(fp8=False)
    six = parse_config(hf_tiny.v32_config(n_routed_experts=6, n_group=2, topk_group=1).to_dict())
    with pytest.raises(LayoutError, match="routed experts"):
        RankLayout(ParallelConfig(4, expert_parallel=True), 0, six).validate(fp8=False)
    # FP8: 2 of 4 heads' q_b rows (64) per rank would cut 128 x 128 blocks
    with pytest.raises(LayoutError, match="FP8 block"):
        RankLayout(ParallelConfig(2), 0, cfg).validate(fp8=True)
    with pytest.raises(LayoutError, match="need --tensor-parallel-size >= 2"):
        ParallelConfig(1, expert_parallel=True)


@pytest.mark.parametrize("layout", ["tp", "dp-attention"])
def test_unseeded_sampling_streams_of_a_group(checkpoints: dict[str, Path], layout: str) -> None:
    """A worker's ranks draw unseeded samples from one stream under tensor parallelism (rank
    0's seed: they sample the same logits alike) and from their own under data-parallel
    attention; either way the worker's seed is its own, not the configured one."""
    group = run_group(ranks.sampled, 2, checkpoints[GLM], LAYOUTS[layout])
    seeds = [g["seed"] for g in group]
    assert 0 not in seeds
    assert (seeds[0] == seeds[1]) == (layout == "tp")
    tokens = group[0]["tokens"]
    assert [len(t) for t in tokens] == [12, 12] and tokens[0] != tokens[1]


@pytest.fixture
def store() -> Iterator[KVHostStoreClient]:
    """A node's ``dhisparse kv-host-store`` process, for the ranks' prefixes."""
    with store_client("group-prefix") as client:
        yield client


@pytest.mark.parametrize("layout", ["tp", "dp-attention"])
def test_a_resident_group_shares_device_pages_with_the_uncached_tokens(
    checkpoints: dict[str, Path], layout: str
) -> None:
    """Resident mode on two ranks: every tensor-parallel rank keeps and shares the same pages
    (the same requests end and arrive on each), each data-parallel rank its own (a next turn
    on the other rank than its first computes its prompt): the tokens of one process with no
    cache."""
    checkpoint = checkpoints[V32]
    one = ranks.prefix_turns(LOCAL, checkpoint, {}, None, "one", False)
    group = run_group(ranks.prefix_turns, 2, checkpoint, LAYOUTS[layout], None, layout)
    assert group[0]["tokens"] == one["tokens"]
    hit = [(n + 24 - 1) // 16 * 16 for n in (100, 70)]
    if layout == "tp":
        assert group[0]["prefix"] == group[1]["prefix"]
        assert group[0]["prefix"]["hits"] == 2 and group[0]["prefix"]["hit_tokens"] == sum(hit)
        assert group[0]["prefilled"] == group[1]["prefilled"] == one["prefilled"] - sum(hit)
    else:  # a rank's device pages are its own
        assert group[0]["total"]["hits"] == 0
        assert group[0]["prefilled"] + group[1]["prefilled"] == one["prefilled"]


@pytest.mark.parametrize("layout", ["tp", "dp-attention+ep"])
def test_a_group_reuses_prefixes_with_the_uncached_tokens(
    checkpoints: dict[str, Path], layout: str, store: KVHostStoreClient
) -> None:
    """A conversation's next turn imports its first turn's pages from the node's store on a
    worker of two ranks: tensor parallel (rank 0 asks the store and copies, both ranks seat the
    rows) and data-parallel attention (each next turn on the other rank than its first: the
    ranks share the node's cache) — the tokens of one process with no cache, and only the new
    tokens computed."""
    checkpoint = checkpoints[GLM]
    one = ranks.prefix_turns(LOCAL, checkpoint, {}, store.target, "one", False)
    group = run_group(ranks.prefix_turns, 2, checkpoint, LAYOUTS[layout], store.target, layout)
    assert group[0]["tokens"] == one["tokens"]
    firsts = [100, 70]
    nexts = [n + 24 + 3 for n in firsts]
    hit = [(n + 24 - 1) // 16 * 16 for n in firsts]  # whole pages of a turn's computed tokens
    assert one["prefilled"] == sum(firsts) + sum(nexts)
    computed = sum(firsts) + sum(n - h for n, h in zip(nexts, hit, strict=True))
    total = group[0]["total"]
    assert total["hits"] == 2 and total["hit_tokens"] == sum(hit)
    if layout == "tp":
        assert group[0]["prefilled"] == group[1]["prefilled"] == computed
        assert group[0]["prefix"]["left"] == 4 and group[1]["prefix"]["left"] == 0  # rank 0's
        assert group[0]["prefix"] == group[1]["prefix"] | {"left": 4}
    else:
        assert group[0]["prefilled"] + group[1]["prefilled"] == computed
        for g in group:  # each imported the other's first turn
            assert g["prefix"]["hits"] == 1 and g["prefix"]["left"] == 2
    assert store.stats().prefix_hits == 2
