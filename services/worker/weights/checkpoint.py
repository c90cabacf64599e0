"""Reading a Hugging Face model directory's safetensors weights, one tensor at a time.

The directory holds one ``model.safetensors`` or the shards that ``model.safetensors.index.json``
lists. Everything that can be checked from the files' headers is checked when a ``Checkpoint`` is
made, so a broken or unsupported checkpoint fails at start-up with the file, tensor or field
named; reading a tensor memory-maps only the shard that holds it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dhisparse.family.parallel_layout import Cut
from dhisparse.family.quantization_config import SCALE_SUFFIX, CheckpointError, block_size
from services.worker.ops.fp8_blockwise import dequantize_blockwise, scale_grid, scale_to_float

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
INT_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
FP8_WEIGHT_DTYPE = "F8_E4M3"
SCALE_STORED_DTYPES = {"F32", "BF16", "F8_E8M0"}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard's header describes it."""

    file: Path
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...
    shape: tuple[int, ...]
    offset: int  # of its first byte within the shard's data section


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header alone (the data is not read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: not a safetensors file (header size {n}, file {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header: {e}") from e
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            start, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for {name}: {entry!r}") from e
        if not 0 <= start <= end <= data_bytes:
            raise CheckpointError(
                f"{path}: tensor {name} lies at bytes [{start}, {end}) past the file's "
                f"{data_bytes} data bytes (truncated?)"
            )
        out[name] = StoredTensor(path, dtype, shape, start)
    return out


class Checkpoint:
    """A model directory's safetensors weights: one model.safetensors, or shards listed by
    model.safetensors.index.json. Tensors are memory-mapped (safetensors safe_open) and read one
    at a time: the model is never in host memory twice.

    Names are the checkpoint's logical weight names: an FP8 ``X.weight`` stands for itself and
    its ``X.weight_scale_inv``, which ``names()`` leaves out. Construction reads the headers only
    and raises CheckpointError for a missing or unreadable shard, an index whose weight_map
    disagrees with the shards, an unsupported ``quantization`` (config.json's
    ``quantization_config``), or an FP8 weight without a scale grid of the right shape. One
    shard is open at a time; reading in ``names()`` order reads the shards one after another."""

    def __init__(self, model_dir: str | Path, quantization: dict | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.block = block_size(quantization)
        self._tensors = self._scan()
        self._scales: dict[str, StoredTensor] = {}  # by the name of the weight they scale
        for name, t in self._tensors.items():
            if name.endswith(SCALE_SUFFIX):
                self._scales[name.removesuffix(SCALE_SUFFIX)] = t
        for name, t in self._tensors.items():
            if t.dtype == FP8_WEIGHT_DTYPE:
                self._check_fp8(name, t)
        for weight in self._scales:
            if weight not in self._tensors or self._tensors[weight].dtype != FP8_WEIGHT_DTYPE:
                raise CheckpointError(
                    f"{self._scales[weight].file}: {weight}{SCALE_SUFFIX} scales no "
                    f"{FP8_WEIGHT_DTYPE} weight {weight}"
                )
        order = sorted(self._tensors.items(), key=lambda kv: (kv[1].file.name, kv[1].offset))
        self._names = [name for name, _ in order if not name.endswith(SCALE_SUFFIX)]
        self._open: tuple[Path, Any] | None = None  # the one shard memory-mapped now

    def _scan(self) -> dict[str, StoredTensor]:
        if not self.model_dir.is_dir():
            raise CheckpointError(f"{self.model_dir}: no such model directory")
        index_path = self.model_dir / INDEX_FILE
        if not index_path.exists():
            single = self.model_dir / WEIGHTS_FILE
            if not single.exists():
                raise CheckpointError(f"{self.model_dir}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")
            return read_header(single)
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: no readable weight_map ({e!r})") from e
        tensors: dict[str, StoredTensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = self.model_dir / shard
            if not path.is_file():
                raise CheckpointError(f"{index_path} names shard {shard}, which does not exist")
            for name, t in read_header(path).items():
                if weight_map.get(name) != shard:
                    raise CheckpointError(
                        f"{path} holds {name}, which {INDEX_FILE} maps to "
                        f"{weight_map.get(name) or 'no shard'}"
                    )
                tensors[name] = t
        for name, shard in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{INDEX_FILE} maps {name} to {shard}, which lacks it")
        return tensors

    def _check_fp8(self, name: str, t: StoredTensor) -> None:
        where = f"{t.file}: {name} {list(t.shape)} {t.dtype}"
        if self.block is None:
            raise CheckpointError(f"{where} is FP8 but config.json has no quantization_config")
        if len(t.shape) != 2 or not name.endswith(".weight"):
            raise CheckpointError(f"{where}: FP8 is supported for 2-D .weight tensors only")
        scale = self._scales.get(name)
        if scale is None:
            raise CheckpointError(f"{where} has no {name}{SCALE_SUFFIX}")
        expected = scale_grid(t.shape, self.block)
        if scale.shape != expected:
            raise CheckpointError(
                f"{scale.file}: {name}{SCALE_SUFFIX} has shape {list(scale.shape)}; weight "
                f"{list(t.shape)} with block {list(self.block)} needs {list(expected)}"
            )
        if scale.dtype not in SCALE_STORED_DTYPES:
            raise CheckpointError(
                f"{scale.file}: {name}{SCALE_SUFFIX} is stored as {scale.dtype} "
                f"(supported: {', '.join(sorted(SCALE_STORED_DTYPES))})"
            )

    def names(self) -> list[str]:
        """Logical weight names in storage order (shard by shard, by offset within a shard)."""
        return list(self._names)

    def _stored(self, name: str) -> StoredTensor:
        if name not in self._tensors or name.endswith(SCALE_SUFFIX):
            raise CheckpointError(f"{self.model_dir}: no weight named {name}")
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored(name).shape

    def dtype(self, name: str) -> str:
        """The stored dtype, as safetensors names it: "BF16", "F32", "F8_E4M3", ..."""
        return self._stored(name).dtype

    def is_fp8(self, name: str) -> bool:
        return self._stored(name).dtype == FP8_WEIGHT_DTYPE

    def _read(self, name: str, cut: Cut | None = None) -> torch.Tensor:
        """One stored tensor as it is stored, in host memory, or only its ``cut`` (the other
        bytes of the mapping are never read); maps its shard if it is not the one mapped now."""
        file = self._tensors[name].file
        if self._open is None or self._open[0] != file:
            self._open = None  # unmap the previous shard before mapping the next
            self._open = (file, safe_open(str(file), framework="pt", device="cpu"))
        if cut is None:
            return self._open[1].get_tensor(name)
        sl = self._open[1].get_slice(name)
        lead = (slice(None),) * (cut.dim % len(sl.get_shape()))
        parts = [sl[(*lead, slice(a, b))] for a, b in cut.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, len(lead))

    def get(
        self,
        name: str,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        cut: Cut | None = None,
    ) -> torch.Tensor:
        """The weight as ``dtype`` on ``device``. BF16/F16/F32/F64 tensors are cast; an FP8
        weight is dequantized with its scale grid (on ``device``, in float32, then cast); an
        integer tensor is returned only as its own dtype. Anything else raises CheckpointError
        naming the tensor and its stored dtype. ``cut``: only that slice of it (a rank's
        shard; on block boundaries for FP8)."""
        t = self._stored(name)
        if t.dtype == FP8_WEIGHT_DTYPE:
            if not dtype.is_floating_point:
                raise CheckpointError(f"{name}: an FP8 weight cannot be read as {dtype}")
            w_fp8, scale = self.get_fp8(name, cut)
            w = dequantize_blockwise(w_fp8.to(device), scale.to(device), self.block)
            return w.to(dtype)
        if t.dtype in FLOAT_DTYPES and dtype.is_floating_point:
            return self._read(name, cut).to(device=device, dtype=dtype)
        if INT_DTYPES.get(t.dtype) == dtype:
            return self._read(name, cut).to(device=device)
        raise CheckpointError(
            f"{t.file}: {name} is stored as {t.dtype}, which cannot be read as {dtype}"
        )

    def get_fp8(self, name: str, cut: Cut | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight as stored, for an FP8 compute path: ``(w [R, C] float8_e4m3fn,
        scale [ceil(R/bm), ceil(C/bn)] float32)`` on the host; the block is ``self.block``.
        ``cut``: only that slice of the weight and the matching rows or columns of its grid;
        a cut inside a block raises CheckpointError."""
        t = self._stored(name)
        if t.dtype != FP8_WEIGHT_DTYPE:
            raise CheckpointError(f"{t.file}: {name} is stored as {t.dtype}, not FP8")
        scale_cut = None
        if cut is not None:
            assert self.block is not None  # an FP8 weight has one (checked at construction)
            block = self.block[cut.dim % 2]
            if not cut.aligned(block):
                raise CheckpointError(
                    f"{t.file}: {name} {list(t.shape)}: the rank's slice {cut.parts} on dim "
                    f"{cut.dim} splits blocks of {block}"
                )
            scale_cut = cut.blocks(block)
        w_fp8 = self._read(name, cut)
        return w_fp8, scale_to_float(self._read(name + SCALE_SUFFIX, scale_cut))

    def close(self) -> None:
        """Unmaps the shard mapped now; reading again maps it anew."""
        self._open = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
