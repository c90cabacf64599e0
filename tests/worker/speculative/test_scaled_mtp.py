"""The scaled presets (``dhisparse/family/scaled.py``) carry the MTP layer their checkpoints
ship: built with it (random weights, the head the target's), a model speculates with
``--drafter mtp``. On the CPU at shrunk dimensions — the scaled topology kept (V3.2's YaRN and
expert groups, GLM-5.2's IndexShare), every per-layer size and the layer count reduced — its
verified greedy output is plain greedy decoding's, in resident and hisparse serving."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.presets import preset
from dhisparse.family.scaled import SCALED
from services.worker.model.mla_decoder import MLADecoder
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.weights.model_io import build_model, load_model
from tests.worker.scaled_shrunk import VOCAB, engine, shrunk


def test_the_scaled_presets_name_their_mtp_layer() -> None:
    for name, d in SCALED.items():
        family, topo = d.parse(mtp=True)
        assert family.mtp_layers == 1, name
        assert topo.draft_layers == (family.num_layers,)
        assert d.parse()[1].draft_layers == ()  # the target alone without --drafter mtp


@pytest.mark.parametrize("name", sorted(SCALED))
def test_built_with_its_mtp_layer_it_speculates_as_plain_greedy(name: str) -> None:
    d = shrunk(name)
    model = build_model(d, seed=3, mtp=True)
    assert isinstance(model, MLADecoder) and model.mtp is not None and model.lm_head is not None
    assert model.mtp.shared_head.head.weight is model.lm_head.weight
    plain_model = build_model(d, seed=3)
    assert plain_model.mtp is None
    # the target's tensors are drawn before the MTP layer's: the same target either way
    ours = model.state_dict()
    assert all(torch.equal(t, ours[n]) for n, t in plain_model.state_dict().items())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (70, 33, 101)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = engine(d.name, plain_model, "resident", None)
    want = [r.output_ids for r in plain.generate(prompts, params)]
    plain.close()
    for mode in ("resident", "hisparse"):
        eng = engine(d.name, model, mode, SpeculationConfig("mtp", 4, "fixed"))
        assert isinstance(eng.speculator.drafter, MTPDrafter)
        assert [r.output_ids for r in eng.generate(prompts, params)] == want, mode
        assert eng.speculator.counters.drafts > 0
        eng.close()


def test_only_a_family_preset_builds_an_mtp_layer() -> None:
    with pytest.raises(ValueError, match="MTP drafter needs"):
        load_model("tiny-indexshare", mtp=True)
    with pytest.raises(ValueError, match="MTP layer are for the real families"):
        build_model(preset("tiny-indexshare"), mtp=True)
