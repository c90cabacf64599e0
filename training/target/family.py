"""What the training loop needs to know of a model family, behind one interface: how the model
is built and initialised, its losses on a batch, what happens after each optimizer step, its
held-out logits and how its weights ship.

- ``HomeMade``: the engine's own family (``DSAModel``, ``forward.train_forward``), shipped in
  the home-made format (``io.save_pretrained``);
- ``MLAFamily``: DeepSeek-V3.2 / GLM-5 (``MLADecoder``, ``mla_forward.mla_train_forward``) from a
  Hugging Face ``config.json``: the LM loss, the indexer's distillation, the MTP layer's loss
  (trained jointly, weighted ``mtp_weight``) and DeepSeek-V3's auxiliary-loss-free expert
  balancing after each step; shipped as a Hugging Face checkpoint (``hf_export``).

``family_of(cfg)`` picks one from ``cfg.preset``: a home-made preset name or config JSON, or a
JSON whose ``model_type`` is a real family's."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import parse_config, topology
from dhisparse.family.presets import PRESETS, home_made
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.preset_decoder import DSAModel
from services.worker.weights.hf_export import save_hf_checkpoint
from services.worker.weights.model_io import save_pretrained
from training.target.config import TrainConfig
from training.target.forward import Mode, lm_loss, train_forward
from training.target.mla_forward import mla_train_forward
from training.target.mla_moe import update_expert_bias
from training.target.weights import init_for_training, init_mla_for_training

REAL_FAMILIES = ("deepseek_v32", "glm_moe_dsa")


class StepLosses(NamedTuple):
    """One batch's losses: ``loss`` (what is minimised) and its named parts, detached (read
    them only when logging: a device sync each); ``aux``: what ``after_step`` needs."""

    loss: torch.Tensor  # [] with its graph
    parts: dict[str, torch.Tensor]
    aux: Any = None


class Family(Protocol):
    name: str

    def build(self, seed: int) -> nn.Module: ...

    def losses(
        self, model: nn.Module, crop: torch.Tensor, mode: Mode, gen: torch.Generator
    ) -> StepLosses: ...

    def after_step(self, model: nn.Module, aux: Any) -> dict[str, float]: ...

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor: ...

    def describe(self, model: nn.Module) -> dict[str, Any]: ...

    def export(self, model: nn.Module, out: Path, max_shard_bytes: int) -> None: ...


@dataclass(frozen=True)
class HomeMade:
    """The home-made family: a preset's or a config JSON's ``ModelConfig``."""

    cfg: ModelConfig
    index_loss_weight: float = 1.0

    @property
    def name(self) -> str:
        return self.cfg.name

    def build(self, seed: int) -> nn.Module:
        model = DSAModel(self.cfg)
        init_for_training(model, seed)
        return model

    def losses(
        self, model: nn.Module, crop: torch.Tensor, mode: Mode, gen: torch.Generator
    ) -> StepLosses:
        assert isinstance(model, DSAModel)
        out = train_forward(model, crop[:, :-1], mode)
        lm = lm_loss(out.logits, crop[:, 1:])
        loss = lm + self.index_loss_weight * out.index_kl
        return StepLosses(loss, {"lm_loss": lm.detach(), "idx_kl": out.index_kl.detach()})

    def after_step(self, model: nn.Module, aux: Any) -> dict[str, float]:
        return {}

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, DSAModel)
        return train_forward(model, tokens, "sparse", index_loss=False).logits

    def describe(self, model: nn.Module) -> dict[str, Any]:
        return self.cfg.to_dict()

    def export(self, model: nn.Module, out: Path, max_shard_bytes: int) -> None:
        assert isinstance(model, DSAModel)
        save_pretrained(model, out, dtype=torch.bfloat16, max_shard_bytes=max_shard_bytes)


@dataclass(frozen=True)
class MLAFamily:
    """DeepSeek-V3.2 / GLM-5 from ``config`` (a ``config.json`` dict). With
    ``num_nextn_predict_layers`` 1 the MTP layer trains alongside, its head the target's
    (``tie_mtp_head``: the checkpoint stores no copy). ``kl_queries``: queries per sequence
    that the indexer's KL is estimated on (None: all). ``balance_rate``: the step of the
    routers' correction biases (``update_expert_bias``)."""

    config: dict[str, Any] = field(hash=False)
    name: str = "model"
    index_loss_weight: float = 1.0
    mtp_weight: float = 0.3
    kl_queries: int | None = None
    balance_rate: float = 1e-3

    def build(self, seed: int) -> nn.Module:
        cfg = parse_config(self.config)
        mtp = cfg.mtp_layers > 0
        model = MLADecoder(cfg, topology(cfg, self.name, mtp=mtp))
        if mtp:
            model.tie_mtp_head()
        init_mla_for_training(model, seed)
        return model

    def losses(
        self, model: nn.Module, crop: torch.Tensor, mode: Mode, gen: torch.Generator
    ) -> StepLosses:
        assert isinstance(model, MLADecoder)
        targets = crop[:, 1:]
        out = mla_train_forward(
            model, crop[:, :-1], mode, kl_queries=self.kl_queries, gen=gen,
            mtp=model.mtp is not None,
        )  # fmt: skip
        lm = lm_loss(out.logits, targets)
        loss = lm + self.index_loss_weight * out.index_kl
        parts = {"lm_loss": lm.detach(), "idx_kl": out.index_kl.detach()}
        if out.mtp_logits is not None:  # at i: the token after the next, targets[:, i + 1]
            mtp = lm_loss(out.mtp_logits, targets[:, 1:])
            loss = loss + self.mtp_weight * mtp
            parts["mtp_loss"] = mtp.detach()
        return StepLosses(loss, parts, out.expert_load)

    def after_step(self, model: nn.Module, aux: Any) -> dict[str, float]:
        """Moves the routers' biases toward balance; logs the least and most loaded expert's
        share of the routed tokens over the MoE layers."""
        assert isinstance(model, MLADecoder)
        if not aux:
            return {}
        shares = update_expert_bias(model, aux, self.balance_rate)
        return {
            "expert_share_min": min(s.min for s in shares.values()),
            "expert_share_max": max(s.max for s in shares.values()),
        }

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, MLADecoder)
        return mla_train_forward(model, tokens, "sparse", index_loss=False, mtp=False).logits

    def describe(self, model: nn.Module) -> dict[str, Any]:
        return dict(self.config)

    def export(self, model: nn.Module, out: Path, max_shard_bytes: int) -> None:
        """bf16 weights (the indexer's ``weights_proj`` and the router biases fp32, as
        transformers keeps them) and config.json with ``dtype`` bfloat16."""
        assert isinstance(model, MLADecoder)
        shipped = copy.deepcopy(model).cast(torch.bfloat16)
        config = {**self.config, "dtype": "bfloat16"}
        save_hf_checkpoint(shipped, out, config, max_shard_bytes=max_shard_bytes)


def family_of(cfg: TrainConfig) -> Family:
    """The family of ``cfg.preset``: a home-made preset name, or a config JSON — a real
    family's when its ``model_type`` is one, else the home-made format — with the run's loss
    weights and options."""
    spec, weight = cfg.preset, cfg.index_loss_weight
    if spec in PRESETS:
        return HomeMade(home_made(spec), weight)
    raw = json.loads(Path(spec).read_text())
    if raw.get("model_type") not in REAL_FAMILIES:
        return HomeMade(ModelConfig.load(spec), weight)
    return MLAFamily(
        raw, name=Path(spec).stem, index_loss_weight=weight, mtp_weight=cfg.mtp_weight,
        kl_queries=cfg.kl_queries or None, balance_rate=cfg.balance_rate,
    )  # fmt: skip
