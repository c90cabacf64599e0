"""What a serving benchmark is set up with: the target model, its drafters, the prepared
prompt prefixes, and the KV sizing that makes resident serving hold only a few sessions."""

from __future__ import annotations

import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.core.model import BENCH_GLM, bench_model_config
from dhisparse.capacity import profile_from_model_config, session_bytes
from dhisparse.family.presets import PRESETS
from dhisparse.tokenizer import Tokenizer, load_tokenizer
from services.worker.kv.config import bytes_per_token
from services.worker.model.preset_decoder import DSAModel
from services.worker.speculative.drafters.io import DRAFTERS
from services.worker.weights.model_io import build_model, load_model

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Target:
    spec: str  # what --model said: bench-glm, a preset name or a model directory
    model: DSAModel
    tokenizer: Tokenizer
    dtype: str

    @property
    def name(self) -> str:
        return self.model.cfg.name

    @property
    def elem_bytes(self) -> int:
        return next(self.model.parameters()).element_size()


def load_target(spec: str, device: str, dtype: str, layers: int = 8, k: int = 512) -> Target:
    """``bench-glm`` (the capacity benchmark's model, random weights, ``layers`` and ``k``), a
    preset (random weights) or a model directory (its weights and tokenizer)."""
    tdtype = getattr(torch, dtype)
    if spec == BENCH_GLM:
        model = build_model(bench_model_config(layers, k), seed=0, device=device, dtype=tdtype)
    elif spec in PRESETS or (Path(spec) / "config.json").exists():
        model = load_model(spec, device=device, dtype=tdtype)
    else:
        raise FileNotFoundError(
            f"--model {spec!r} is neither {BENCH_GLM}, a preset ({', '.join(PRESETS)}) nor a "
            "model directory with config.json"
        )
    tok = load_tokenizer(None if spec == BENCH_GLM or spec in PRESETS else spec)
    return Target(spec, model, tok, dtype)


def default_drafter_dir(model: str) -> str:
    """A model directory's ``drafters/``; a preset's trained drafters under bench/drafters/ if
    there are any; otherwise ``random`` (seeded random weights per drafter kind)."""
    if model not in PRESETS and model != BENCH_GLM:
        return str(Path(model) / "drafters")
    trained = ROOT / "bench" / "drafters" / model
    return str(trained) if trained.is_dir() else "random"


def drafter_source(kind: str, drafter_dir: str) -> str:
    """What EngineConfig.drafter gets: the kind itself (random weights) for ``random``, else
    the checkpoint directory ``drafter_dir/kind`` (which must exist)."""
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; choose from {sorted(DRAFTERS)}")
    if drafter_dir == "random":
        return kind
    path = Path(drafter_dir) / kind
    if not (path / "drafter.json").exists():
        raise FileNotFoundError(
            f"no {kind} checkpoint at {path} (--drafter-dir holds dflash/ dspark/ dflash2/; "
            "'--drafter-dir random' uses random weights)"
        )
    return str(path)


def prepare_prefixes(
    target: Target, lengths: list[int], count: int, source: str = "text", seed: int = 0
) -> dict[int, list[list[int]]]:
    """``count`` prompt prefixes of exactly each length: windows at seeded offsets of a text
    corpus tokenized by the target's tokenizer (``text``: the Python standard library's
    sources, always there offline; or a file/directory path), or uniform random ids
    (``random``, within the byte range when the vocabulary has it)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.model.cfg.vocab_size
    if source == "random":
        hi = min(vocab, 256)
        return {
            n: [torch.randint(0, hi, (n,), generator=g).tolist() for _ in range(count)]
            for n in lengths
        }
    stream = _corpus(target.tokenizer, source, need=4 * max(lengths), vocab=vocab)
    out = {}
    for n in lengths:
        starts = torch.randint(0, len(stream) - n, (count,), generator=g).tolist()
        out[n] = [stream[s : s + n] for s in starts]
    return out


def _corpus(tok: Tokenizer, source: str, need: int, vocab: int) -> list[int]:
    root = Path(sysconfig.get_paths()["stdlib"]) if source == "text" else Path(source)
    files = [root] if root.is_file() else sorted(root.glob("*.py")) + sorted(root.glob("*.md"))
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(f.read_text(encoding="utf-8", errors="replace")))
        if len(ids) >= max(need, 1 << 20):
            break
    if len(ids) <= need // 4:
        raise ValueError(f"the corpus at {root} has {len(ids)} tokens; need more than {need // 4}")
    if max(ids) >= vocab:
        raise ValueError(f"the tokenizer gives ids beyond the model's vocabulary ({vocab})")
    return ids


@dataclass(frozen=True)
class Sizing:
    """The KV sizes every run shares. ``budget_bytes`` holds ``resident_sessions`` sessions of
    the longest input in resident serving; each hierarchy engine gets that budget plus its own
    fixed allocations (prefill scratch, hot-cache metadata, staging), reported per engine."""

    resident_sessions: int
    session_tokens: int  # the longest input + output + a verification block + margin
    max_model_len: int
    max_prefill_tokens: int
    page_size: int
    hot_cache_rows: int | None  # None: the engine's default, 2k
    resident_bytes_per_token: float
    budget_bytes: int
    hierarchy_session_bytes: int  # capacity model: hot cache, tail, index keys, metadata
    slots: int  # max_num_seqs, the same for every mode
    host_arena_bytes: int  # the host store's arena, shared by the benchmark's engines

    def as_dict(self) -> dict:
        return asdict(self)


def size_kv(
    target: Target,
    input_lens: list[int],
    output_len: int,
    spec_width: int,
    resident_sessions: int,
    page_size: int,
    hot_cache_rows: int | None,
    max_concurrency: int,
    slots: int | None = None,
) -> Sizing:
    """As the capacity benchmark sizes its budget. Slots default to the sessions the hierarchy can
    hold in the budget (the engine reserves index keys for every slot at full length, so more
    slots would shrink the pages), at most the largest C."""
    cfg = target.model.cfg
    per_token = bytes_per_token(cfg, target.elem_bytes, payload=True)
    session_tokens = max(input_lens) + output_len + spec_width + 16
    budget = int(resident_sessions * session_tokens * per_token * 1.02)
    ring = -(-(page_size + max(8, spec_width)) // page_size)  # tail pages (engine: one + block)
    profile = profile_from_model_config(
        cfg, kv_dtype_bytes=target.elem_bytes, hot_cache_rows=hot_cache_rows,
        page_size=page_size, tail_pages=ring,
    )  # fmt: skip
    hier = session_bytes(profile, session_tokens, "hierarchy").total
    if slots is None:
        slots = max(1, min(max_concurrency, budget // hier))
    # Backups of every admitted session: its rows, and (durable sessions) its index keys.
    host = int(slots * session_tokens * per_token * 1.15) + (64 << 20)
    return Sizing(
        resident_sessions=resident_sessions, session_tokens=session_tokens,
        max_model_len=session_tokens, max_prefill_tokens=max(input_lens), page_size=page_size,
        hot_cache_rows=hot_cache_rows, resident_bytes_per_token=per_token, budget_bytes=budget,
        hierarchy_session_bytes=hier, slots=slots, host_arena_bytes=-(-host // 4096) * 4096,
    )  # fmt: skip
