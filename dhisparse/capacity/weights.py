"""The weights a worker holds on each GPU under a parallel layout (``--tensor-parallel-size``,
``--expert-parallel``, ``--data-parallel-attention``), from a DeepSeek-V3.2 / GLM-5 config
alone.

The tensors are the worker's (``held_weights``), in the format it holds them: FP8 blocks with
their fp32 scales where the checkpoint is FP8 (or ``--weight-dtype fp8``), the serving dtype
elsewhere. A rank's share of each is the layout's one table of cuts
(``parallel_layout.RankLayout.cut``): a tensor the table cuts is *split* (the rank holds its
slice), any other *replicated* (every rank holds it whole). Every rank holds the same bytes:
a layout divides every split dimension evenly, or ``RankLayout.validate`` refuses it with the
message the worker gives at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dhisparse.family.held_weights import (
    PARTS,
    SERVING_DTYPE_BYTES,
    HeldTensor,
    held_tensors,
)
from dhisparse.family.hf_config import MLAConfig, parse_config
from dhisparse.family.hf_dir import is_hf_model_dir, read_config
from dhisparse.family.parallel_layout import ParallelConfig, RankLayout
from dhisparse.family.presets import PRESETS, FamilyPreset, preset
from dhisparse.family.quantization_config import (
    fp8_as_stored,
    modules_not_converted,
    serves_fp8,
)


@dataclass(frozen=True)
class PartBytes:
    """One part of the model on one rank: bytes it holds whole and bytes of its slices."""

    part: str
    replicated: int
    split: int

    @property
    def total(self) -> int:
        return self.replicated + self.split


@dataclass(frozen=True)
class RankWeights:
    """What one rank of ``layout`` (``ParallelConfig.name``) over ``ranks`` GPUs holds, by part
    (``held_weights.PARTS`` order; parts the model lacks left out)."""

    layout: str
    ranks: int
    parts: tuple[PartBytes, ...]

    @property
    def replicated(self) -> int:
        return sum(p.replicated for p in self.parts)

    @property
    def split(self) -> int:
        return sum(p.split for p in self.parts)

    @property
    def total(self) -> int:
        return self.replicated + self.split

    @property
    def whole(self) -> int:
        """The whole model's bytes: every rank holds an equal slice of each split tensor."""
        return self.replicated + self.ranks * self.split

    def part(self, name: str) -> PartBytes | None:
        return next((p for p in self.parts if p.part == name), None)

    def as_dict(self) -> dict:
        return {
            "layout": self.layout,
            "ranks": self.ranks,
            "parts": {p.part: {"replicated": p.replicated, "split": p.split} for p in self.parts},
            "replicated": self.replicated,
            "split": self.split,
            "total": self.total,
            "whole": self.whole,
        }


@dataclass(frozen=True)
class ModelWeights:
    """A real family's model as a worker holds it: ``fp8`` projections and experts or not,
    ``dtype`` the serving dtype, ``mtp`` with its MTP layer; ``tensors`` every tensor whole."""

    family: MLAConfig
    fp8: bool
    dtype: str
    mtp: bool
    tensors: tuple[HeldTensor, ...]

    @property
    def format(self) -> str:
        """The weight format in words, for a plan's header."""
        if self.fp8:
            return f"fp8 e4m3 with fp32 128x128 block scales, the rest {self.dtype}"
        return self.dtype

    @property
    def total(self) -> int:
        """Bytes of the whole model (one GPU)."""
        return self.per_rank(ParallelConfig()).total

    def per_rank(self, cfg: ParallelConfig) -> RankWeights:
        """What each rank of ``cfg`` holds, by part; raises LayoutError (the worker's start-up
        check) for a layout that does not divide the model, or that cuts FP8 blocks."""
        RankLayout(cfg, 0, self.family).validate(self.fp8)
        held = self.on_rank(cfg, 0)
        replicated = dict.fromkeys(PARTS, 0)
        split = dict.fromkeys(PARTS, 0)
        for t in self.tensors:
            nbytes, is_split = held[t.name]
            (split if is_split else replicated)[t.part] += nbytes
        parts = tuple(
            PartBytes(p, replicated[p], split[p]) for p in PARTS if replicated[p] or split[p]
        )
        return RankWeights(cfg.name, cfg.world_size, parts)

    def on_rank(self, cfg: ParallelConfig, rank: int) -> dict[str, tuple[int, bool]]:
        """Each tensor rank ``rank`` of ``cfg`` holds: (its bytes, whether it is a slice)."""
        layout = RankLayout(cfg, rank, self.family)
        elem = SERVING_DTYPE_BYTES[self.dtype]
        out = {}
        for t in self.tensors:
            cut = layout.cut(t.name)
            shape = t.shape if cut is None else cut.shape(t.shape)
            out[t.name] = (t.nbytes(shape, elem), cut is not None)
        return out


def model_weights(
    cfg: MLAConfig,
    quantization: dict | None,
    *,
    weight_dtype: str = "auto",
    dtype: str | None = None,
    mtp: bool = False,
) -> ModelWeights:
    """The weights of ``cfg`` as a worker loads a checkpoint whose config.json has this
    ``quantization_config``, with ``--weight-dtype weight_dtype`` and ``--dtype dtype``
    (default: the config's); ``mtp``: with its MTP layer (``--drafter mtp``)."""
    dtype = dtype or cfg.dtype
    if dtype not in SERVING_DTYPE_BYTES:
        raise ValueError(
            f"serving dtype {dtype!r} is not one of {sorted(SERVING_DTYPE_BYTES)}: pass --dtype"
        )
    fp8 = serves_fp8(weight_dtype, fp8_as_stored(quantization))
    # the worker holds what an FP8 checkpoint stores unquantized as stored, under auto only
    dense = modules_not_converted(quantization) if fp8 and weight_dtype == "auto" else ()
    tensors = held_tensors(cfg, fp8=fp8, mtp=mtp, not_converted=dense)
    return ModelWeights(cfg, fp8, dtype, mtp, tensors)


def model_weights_of(
    source: str | Path,
    *,
    weight_dtype: str = "auto",
    dtype: str | None = None,
    mtp: bool = False,
) -> ModelWeights | None:
    """The weights of a Hugging Face model directory or a family preset (``tiny-glm``); None
    for a model of the home-made family, which runs on one GPU and whose weights are not
    sized here."""
    if str(source) in PRESETS:
        d = preset(str(source))
        if not isinstance(d, FamilyPreset):
            return None
        raw = d.config
    elif is_hf_model_dir(source):
        raw = read_config(source)
    else:
        return None
    return model_weights(
        parse_config(raw),
        raw.get("quantization_config"),
        weight_dtype=weight_dtype,
        dtype=dtype,
        mtp=mtp,
    )
