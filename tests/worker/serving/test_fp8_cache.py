"""``kv_cache_dtype="fp8"`` through the KV cache: the flag and its start-up errors, packed rows
and keys in the pools (the reference codec's bytes), the fixed attention workspace, the sizes,
and the engine in every mode (the modes' exactness over packed rows:
``hierarchy/test_hierarchy.py``, ``residency/test_residency.py``; durability:
``durable/test_resume.py``; graphs: ``graphs/test_cuda_graph.py``)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from dhisparse import up
from dhisparse.family.fp8_kv_format import index_key_format, mla_row_format
from dhisparse.family.presets import preset, preset_topology
from services.worker import cli
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.kv.workspace import attention_rows_bytes, workspace_bytes
from services.worker.model.decoder import LayerTrace
from services.worker.ops.fp8_kv_codec import pack, unpack
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.settings import WorkerSettings
from services.worker.weights.model_io import build_model

TINY = preset_topology("tiny-glm")


def kv_config(**kw) -> KVCacheConfig:
    kw.setdefault("max_slots", 3)
    kw.setdefault("max_model_len", 512)
    return KVCacheConfig(kv_pool_bytes=16 << 20, host_arena_bytes=16 << 20, **kw)


# ---- the flag ------------------------------------------------------------------------------
def test_the_default_stays_the_serving_dtype() -> None:
    assert KVCacheConfig().kv_cache_dtype == "auto"
    assert EngineConfig().kv_config(torch.float32).kv_cache_dtype == "auto"
    assert WorkerSettings().engine_config().kv_cache_dtype == "auto"
    kv = KVCache(TINY, kv_config())
    assert kv.payload.pool(0).dtype == torch.float32 and kv.attention_block is None
    assert kv.layout()["kv_cache_dtype"] == "auto" and kv.layout()["row_bytes"] == 80 * 4


def test_the_worker_and_up_flags_reach_the_kv_config() -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    settings = cli.settings_from_args(p.parse_args(["--kv-cache-dtype", "fp8"]))
    cfg = settings.engine_config()
    sized = replace(cfg, kv_pool_mib=64.0)  # the worker sizes an automatic pool at start-up
    assert cfg.kv_cache_dtype == "fp8" and sized.kv_config(torch.bfloat16).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp16"])
    q = argparse.ArgumentParser()
    up.add_arguments(q)
    argv = up.worker_argv(q.parse_args(["--kv-cache-dtype", "fp8"]), 0, "cpu")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    argv = up.worker_argv(q.parse_args([]), 0, "cpu")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "auto"


@pytest.mark.parametrize(
    ("model", "kw", "match"),
    [
        (TINY, {"kv_cache_dtype": "fp16"}, "unknown kv_cache_dtype 'fp16'"),
        (TINY, {"kv_cache_dtype": "fp8", "dtype": torch.float16}, "kv_cache_dtype='fp8'"),
        # a 48-wide latent: tiles of 48 values, not a power of two
        (replace(TINY, d_latent=48), {"kv_cache_dtype": "fp8"}, "d_latent=48 .* no FP8 row format"),
        (replace(TINY, d_index=24), {"kv_cache_dtype": "fp8"}, "d_index=24, which have no FP8"),
    ],
)
def test_unsupported_combinations_fail_at_start_up_naming_the_field(model, kw, match) -> None:
    for mode in ("resident", "hisparse"):
        with pytest.raises(ValueError, match=match):
            KVCache(model, kv_config(mode=mode, **kw))


def test_an_fp8_engine_that_cannot_start_says_why() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        Engine(EngineConfig(model="tiny-glm", dtype="float16", kv_cache_dtype="fp8"))


# ---- what the pools hold -------------------------------------------------------------------
def _prefill(kv: KVCache, model, n: int, seed: int) -> list[LayerTrace]:
    tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    assert kv.admit(1, "r", n, n + 8)
    batch = ForwardBatch.build([1], [0], [n], "cpu")
    trace: list[LayerTrace] = []
    model(tokens, batch, kv, trace=trace)
    kv.commit(batch, [n])
    return trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_fp8_pools_hold_the_reference_codecs_bytes(dtype: torch.dtype) -> None:
    """The first layer's rows and keys depend on the embeddings only, so a run in the serving
    dtype computes the same ones: the fp8 pools hold exactly their reference packing, and
    attention reads exactly their dequantization."""
    model = build_model(preset("tiny-glm"), seed=4, dtype=dtype)
    cfg = model.cfg
    rows_fmt, key_fmt = mla_row_format(cfg.d_latent, cfg.d_rope), index_key_format(cfg.d_index)
    plain = KVCache(cfg, kv_config(dtype=dtype))
    fp8 = KVCache(cfg, kv_config(dtype=dtype, kv_cache_dtype="fp8"))
    n = 150  # > the attention block (64): prefill attends in blocks
    _prefill(plain, model, n, 0)
    trace = _prefill(fp8, model, n, 0)
    assert fp8.attention_block == 64
    slots, rows = torch.full((n,), 1), torch.arange(n)
    want = plain.payload.pools[0].data[plain.payload.pools[0].locations(slots, rows)]
    pool = fp8.payload.pools[0]
    assert pool.data.dtype == torch.uint8 and pool.data.shape[1] == rows_fmt.row_bytes == 100
    got = pool.data[pool.locations(slots, rows)]
    assert torch.equal(got, pack(rows_fmt, want))
    layer = cfg.index_producers[0]
    keys = plain.index_keys.gather(layer, slots[:1], torch.tensor([n]), n)[0]
    kpool = fp8.index_keys.pools[layer]
    assert kpool.data.shape[1] == key_fmt.row_bytes == 36
    assert torch.equal(kpool.data[kpool.locations(slots, rows)], pack(key_fmt, keys))
    # the indexer reads the keys dequantized, in the serving dtype
    read = fp8.index_keys.gather(layer, slots[:1], torch.tensor([n]), n)[0]
    assert read.dtype == dtype and torch.equal(read, unpack(key_fmt, pack(key_fmt, keys), dtype))
    # attention inputs: the selected stored rows, dequantized, in selection order
    t = trace[0]
    stored = pool.data[t.locations.clamp(min=0).view(-1)]
    deq = unpack(rows_fmt, stored, dtype).view(*t.locations.shape, -1)
    deq = deq.masked_fill((t.locations < 0).unsqueeze(-1), 0)
    assert t.rows.dtype == dtype and torch.equal(t.rows, deq)


def test_the_attention_workspace_is_one_fixed_allocation() -> None:
    model = build_model(preset("tiny-glm"), seed=1)
    kv = KVCache(model.cfg, kv_config(kv_cache_dtype="fp8", mode="hisparse"))
    ws = kv._attention_ws
    assert ws is not None and ws.shape == (64 * TINY.index_topk, TINY.d_kv)
    ptr = ws.data_ptr()
    _prefill(kv, model, 200, 2)
    assert kv._attention_ws is ws and ws.data_ptr() == ptr
    # held by the KV budget on a GPU, like the index-score workspace
    cuda = kv_config(kv_cache_dtype="fp8", device="cuda", spec_block=4)
    assert attention_rows_bytes(TINY, cuda) == max(3 * 4, 64) * 32 * 80 * 4
    auto = replace(cuda, kv_cache_dtype="auto")
    assert workspace_bytes(TINY, cuda) - workspace_bytes(TINY, auto) == 64 * 32 * 80 * 4
    assert attention_rows_bytes(TINY, auto) == 0
    kv.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_fp8_rows_and_host_backups_take_the_packed_bytes(mode: str) -> None:
    plain = KVCache(TINY, kv_config(mode=mode, dtype=torch.bfloat16))
    fp8 = KVCache(TINY, kv_config(mode=mode, dtype=torch.bfloat16, kv_cache_dtype="fp8"))
    assert plain.row_bytes == 160 and fp8.row_bytes == 100  # 64 + 16 bf16 vs 64 + 4 + 32
    lay = fp8.layout()
    assert lay["kv_cache_dtype"] == "fp8" and lay["row_bytes"] == 100
    if mode == "resident":
        assert lay["index_key_bytes"] == 36
        assert fp8.tokens_capacity > plain.tokens_capacity
    else:
        assert fp8.host_backups.row_bytes == 100 and fp8.host_backups.dtype == torch.uint8
        assert fp8.payload.store.page_bytes == 16 * 100
        # keys in pages of packed rows: 36 B padded to 40 (a page of 1600 B holds 40 of them)
        assert lay["index_key_bytes"] == 40 and lay["index_key_page_rows"] == 40
        assert fp8.payload.store.pages.total > plain.payload.store.pages.total
    for kv in (plain, fp8):
        kv.close()


# ---- the engine ----------------------------------------------------------------------------
def test_fp8_engine_gives_resident_fp8_tokens_in_every_mode() -> None:
    """Chunked prefill (a prompt's later chunks read its earlier chunks' packed rows) and
    decoding, in each mode; unchunked prefill passes: ``hierarchy/test_hierarchy.py``."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 33, 260)]
    common = dict(model="tiny-glm", kv_cache_dtype="fp8", max_num_seqs=4,
                  max_prefill_tokens=96)  # fmt: skip
    ref = Engine(EngineConfig(kv_pool_mib=16, **common))
    want = [r.output_ids for r in ref.generate(prompts, params)]
    plain = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=16, max_num_seqs=4))
    assert [r.output_ids for r in plain.generate(prompts, params)] != want  # rows are quantized
    for mode in ("hisparse", "adaptive"):
        eng = Engine(EngineConfig(mode=mode, kv_pool_mib=32, host_arena_mib=32, **common))
        assert [r.output_ids for r in eng.generate(prompts, params)] == want, mode
        eng.close()
    ref.close()


# ---- the kernels as the cache calls them -----------------------------------------------------
def _strided_kernels(device: str) -> None:
    """Index keys in pages of rows are a strided view (36 B keys in 40 B slots) and attention
    gathers into a workspace: the Triton store and gather over both equal the references, and
    a slot's padding is never written."""
    from services.worker.kv.row_codec import RowCodec
    from services.worker.ops.fp8_gather_triton import fp8_gather_triton
    from services.worker.ops.fp8_kv import fp8_gather_ref, fp8_store_ref
    from services.worker.ops.fp8_store_triton import fp8_store_triton

    g = torch.Generator().manual_seed(5)
    for fmt, slot in ((index_key_format(32), 40), (mla_row_format(64, 16), 100),
                      (index_key_format(128), 164)):  # fmt: skip
        backing = [torch.full((50, slot), 0xAB, dtype=torch.uint8, device=device) for _ in "ab"]
        pools = [b[:, : fmt.row_bytes] for b in backing]
        rows = (torch.randn(20, fmt.width, generator=g) * 3).to(device)
        dst = torch.randperm(50, generator=g)[:20].to(device)
        dst[3] = -1
        fp8_store_triton(fmt, pools[0], rows, dst)
        fp8_store_ref(fmt, pools[1], rows, dst)
        assert torch.equal(backing[0], backing[1])
        assert (backing[0][:, fmt.row_bytes :] == 0xAB).all()
        src = torch.randint(-1, 50, (33,), generator=g).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            ws = torch.empty(64, fmt.width, dtype=dtype, device=device)
            got = fp8_gather_triton(fmt, pools[0], src, dtype, out=ws[:33])
            assert got.data_ptr() == ws.data_ptr()
            assert torch.equal(got, fp8_gather_ref(fmt, pools[1], src, dtype))
            codec = RowCodec(fmt.width, dtype, fmt)
            view = codec.gather(pools[0], src.view(3, 11), out=ws)
            assert view.shape == (3, 11, fmt.width) and view.data_ptr() == ws.data_ptr()
            assert torch.equal(view.reshape(33, -1), got)


def test_the_kernels_over_strided_pools_and_a_workspace() -> None:
    _strided_kernels("cpu")  # the Triton interpreter


@pytest.mark.gpu
def test_the_kernels_over_strided_pools_and_a_workspace_on_gpu() -> None:
    _strided_kernels("cuda")
