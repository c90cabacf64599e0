"""The MTP layer against its plain-torch reference (``mtp_reference``, from vLLM's and SGLang's
NextN forward), step by step, on tiny random checkpoints of both families with an appended MTP
layer: the rows a prefill writes, every draft step's selection and logits, the recycled hidden
state, and GLM-5.2's ``index_share_for_mtp_iteration``; in resident serving and over the
hierarchy with a hot cache too small for the history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dhisparse.family.hf_config import ConfigError
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.mla_decoder import MLADecoder
from services.worker.serving.cache import KVCache
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.worker.mtp_fixture import FAMILIES, mtp_checkpoint
from tests.worker.mtp_reference import MTPReference
from tests.worker.speculative.stats import chi2_test

STEPS = 5


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[MTPReference, Path]:
    return mtp_checkpoint(request.param, tmp_path_factory)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, hf_tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _kv(model: MLADecoder, mode: str) -> KVCache:
    kw: dict = dict(mode=mode, max_slots=2, max_model_len=256, spec_block=STEPS + 1)
    if mode == "hisparse":  # a hot cache of one selection: most rows come from the host
        kw |= dict(hot_cache_rows=16, kv_pool_bytes=32 << 20)
    return KVCache(model.cfg, KVCacheConfig(**kw))


def _prefill(model: MLADecoder, kv: KVCache, ids: torch.Tensor, chunks: list[int]) -> None:
    """Commits ``ids`` in slot 0 in prefill chunks, with room for the draft steps after."""
    assert kv.admit(0, "r", len(ids), len(ids) + STEPS + 1)
    assert kv.ensure(0, len(ids) + STEPS + 1)
    start = 0
    for n in chunks:
        batch = ForwardBatch.build([0], [start], [n], "cpu", prefill=True)
        model(ids[start : start + n], batch, kv)
        start += n
        kv.commit(batch, [start])


def test_the_mtp_layer_is_loaded_only_when_asked(family) -> None:
    _, path = family
    plain = load_model(path)
    assert isinstance(plain, MLADecoder) and plain.mtp is None
    assert not plain.cfg.draft_layers
    model = load_model(path, mtp=True)
    assert isinstance(model, MLADecoder) and model.mtp is not None
    n = model.family.num_layers
    assert model.cfg.draft_layers == (n,)
    assert model.cfg.sources[model.cfg.layers[n].source].lag == 1
    assert model.cfg.rows_for_tokens(model.cfg.layers[n].source, 10) == 9
    # its own head, not lm_head: the tiny checkpoint's differ
    assert model.mtp.shared_head.head is not model.lm_head


def test_a_copy_of_lm_head_is_not_kept(family, tmp_path: Path) -> None:
    """A checkpoint whose shared_head.head is lm_head (the released ones) serves lm_head."""
    _, path = family
    d = tmp_path / "shared"
    d.mkdir()
    for f in path.iterdir():
        if f.name != "model-mtp.safetensors":
            (d / f.name).symlink_to(f)
    mtp = load_file(str(path / "model-mtp.safetensors"))
    lm_head = load_model(path).lm_head.weight.detach()
    name = next(k for k in mtp if k.endswith("shared_head.head.weight"))
    save_file(mtp | {name: lm_head.clone()}, str(d / "model-mtp.safetensors"))
    model = load_model(d, mtp=True)
    assert model.mtp.shared_head.head is model.lm_head


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("length", [12, 70])
def test_draft_steps_equal_the_reference(family, mode: str, length: int) -> None:
    """A prompt committed in chunks (the MTP rows each pass completes, the carry between
    passes), then five draft steps teacher-forced with the reference's proposals: each step's
    selection equals the reference's as a set and its logits agree to 1e-4 relative. A prompt
    shorter than index_topk (16) and one over four times it."""
    ref, path = family
    model = load_model(path, mtp=True)
    share = model.family.mtp_index_share
    ids = _ids(length + 1, length)  # the last is the anchor
    want = ref.draft(ids, STEPS, share=share)
    proposals = [int(s.logits.argmax()) for s in want]
    kv = _kv(model, mode)
    chunks = [length] if length < 16 else [37, 1, length - 38]
    _prefill(model, kv, ids[:-1], chunks)
    src = model.cfg.layers[model.mtp_layer].source
    tails = kv.payload.store.tail_hi[0][:] if mode == "hisparse" else None
    hidden, first = None, None
    for i in range(STEPS):
        token = ids[-1] if i == 0 else torch.tensor(proposals[i - 1])
        batch = ForwardBatch.build([0], [length + i], [1], "cpu", sources=(src,))
        given = first if share and i else None
        step = model.mtp_step(token.view(1), batch, kv, hidden, given)
        got = {int(p) for p in step.selection[0] if p >= 0}
        assert got == want[i].selection, f"step {i}"
        err = (step.logits[0] - want[i].logits).abs().max() / want[i].logits.abs().max()
        assert err <= 1e-4, (i, err)
        hidden, first = step.hidden, first if i else step.selection
    if tails is not None:  # MTP-only passes leave the target's tails as they were
        after = kv.payload.store.tail_hi[0]
        assert after[:src] == tails[:src] and after[src] == length - 1 + STEPS
    if mode == "hisparse" and length > 64:
        census = kv.payload.census
        assert census.host > 0, census
    kv.close()


def _draft(
    model: MLADecoder, kv: KVCache, anchor: int, n: int, tokens: list[int]
) -> list[torch.Tensor]:
    """Draft steps from ``anchor`` at position n, step i > 0 reading ``tokens[i-1]``: their
    logits."""
    src = model.cfg.layers[model.mtp_layer].source
    share = model.family.mtp_index_share
    hidden, first, out = None, None, []
    for i in range(len(tokens) + 1):
        token = torch.tensor([anchor if i == 0 else tokens[i - 1]])
        batch = ForwardBatch.build([0], [n + i], [1], "cpu", sources=(src,))
        step = model.mtp_step(token, batch, kv, hidden, first if share and i else None)
        out.append(step.logits[0])
        hidden, first = step.hidden, first if i else step.selection
    return out


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_a_verify_round_commits_the_mtp_rows_of_its_accepted_prefix(family, mode: str) -> None:
    """Prefill, a round of draft steps (rows in the MTP tail), then a verify pass of four
    tokens that commits the anchor and two of them: the next round's steps equal the
    reference's over the committed tokens, so the verify pass's MTP rows of the accepted
    prefix (row n-1 from the carry) and the carry of its last accepted position are those of
    a prefill, and its rows past them were never read."""
    ref, path = family
    model = load_model(path, mtp=True)
    n, accepted = 50, 2
    ids = _ids(n + 5, 77)  # prompt, anchor, three verified tokens, the next anchor
    kv = _kv(model, mode)
    _prefill(model, kv, ids[:n], [n])
    _draft(model, kv, int(ids[n]), n, [5, 6, 7])
    verify = ForwardBatch.build([0], [n], [4], "cpu")
    model(ids[n : n + 4], verify, kv)
    kv.commit(verify, [n + accepted + 1])
    committed = torch.cat([ids[: n + accepted + 1], ids[n + 4 :]])  # with the next anchor
    want = ref.draft(committed, 3, tokens=[9, 10], share=model.family.mtp_index_share)
    got = _draft(model, kv, int(ids[n + 4]), n + accepted + 1, [9, 10])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w.logits).abs().max() / w.logits.abs().max()
        assert err <= 1e-4, (i, err)
    kv.close()


def test_sampled_proposals_follow_q(family) -> None:
    """Lossless verification assumes x ~ q: over 2,400 identical requests (sixteen slots with one
    committed context, each request its own generator), the MTP drafter's first proposals fit
    its q, and its second given the first fit the q it reports for them (chi-square, α = 1e-3).
    Greedy requests in the same batches propose deterministically and report no q."""
    _, path = family
    model = load_model(path, mtp=True)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=16, max_model_len=128, spec_block=3))
    ids = _ids(30, 3)
    for slot in range(16):
        assert kv.admit(slot, f"r{slot}", 30, 40) and kv.ensure(slot, 40)
        batch = ForwardBatch.build([slot], [0], [29], "cpu", prefill=True)
        model(ids[:29], batch, kv)
        kv.commit(batch, [29])
    src = model.cfg.layers[model.mtp_layer].source
    drafter = MTPDrafter(
        lambda t, b, h, sel: model.mtp_step(t, b, kv, h, sel), src, model.cfg.vocab_size, 3,
        model.family.mtp_index_share, torch.device("cpu"),
    )  # fmt: skip
    tokens, probs = [], []
    for call in range(150):
        gens = [torch.Generator().manual_seed(16 * call + j) for j in range(16)]
        prop = drafter.propose(
            list(range(16)), [int(ids[29])] * 16, [29] * 16, None, [0.7] * 16, gens
        )
        tokens.append(prop.tokens)
        probs.append(prop.probs)
    toks, q = torch.cat(tokens), torch.cat(probs)
    vocab = model.cfg.vocab_size
    first = torch.bincount(toks[:, 0], minlength=vocab).float()
    assert chi2_test([(first, q[0, 0])])[0] > 1e-3
    groups = []
    for a in toks[:, 0].unique().tolist():
        rows = toks[:, 0] == a
        groups.append((torch.bincount(toks[rows, 1], minlength=vocab).float(), q[rows][0, 1]))
    assert chi2_test(groups)[0] > 1e-3
    greedy = drafter.propose([0, 1], [int(ids[29])] * 2, [29] * 2, None, [0.0, 0.0])
    assert greedy.probs is None and torch.equal(greedy.tokens[0], greedy.tokens[1])
    kv.close()


def test_a_checkpoint_without_an_mtp_layer_is_refused(family, tmp_path: Path) -> None:
    _, path = family
    raw = json.loads((path / "config.json").read_text())
    d = tmp_path / "none"
    d.mkdir()
    for f in path.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0"):
        load_model(d, mtp=True)
    with pytest.raises(ValueError, match="MTP drafter needs"):
        load_model("tiny-glm", mtp=True)
