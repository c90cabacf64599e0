"""Data for drafter training: a token stream, the frozen target's features and greedy labels
over whole sequences, and the random blocks a training step drafts.

A block anchored at position a of a sequence is ``[x_a, MASK × (K-1)]`` at positions a..a+K-1;
it sees the target features of positions a-W .. a-1 only (strictly before its anchor) and is
bidirectional inside. Its label at slot k is the target's greedy next token after x_{a+k-1},
``argmax target_logits[a+k-1]``, so slot 1 learns exactly what verification will check."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import NamedTuple

import torch

from dhisparse.tokenizer import ByteTokenizer
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.decoder import SparseDecoder
from services.worker.serving.cache import KVCache
from training.corpus.tokens import META, load_tokens
from training.target.corpus import meta_path
from training.target.data import load_corpus, to_tokens


def corpus_tokens(path: str | None = None, max_bytes: int = 4 << 20) -> torch.Tensor:
    """[T] int64 byte tokens of a text file or of a directory's ``*.py``/``*.txt``/``*.md``
    files in sorted order, or the training part of a packed corpus (``training.target.
    corpus``), or the BPE tokens of a token directory's training part (``training.corpus``;
    then ``max_bytes`` counts tokens); default: the Python standard library's own sources
    (always there, offline). At most ``max_bytes`` bytes."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file() and meta_path(root).exists():  # a packed corpus: its training part
        return to_tokens(load_corpus(root).train[:max_bytes])
    if (root / META).is_file():  # a token directory (BPE): its training part
        return load_tokens(root).train[:max_bytes].long()
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for ext in ("*.py", "*.txt", "*.md") for p in root.glob(ext))
    tok = ByteTokenizer()
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(f.read_text(encoding="utf-8", errors="replace")))
        if len(ids) >= max_bytes:
            break
    if not ids:
        raise ValueError(f"no text found at {root}")
    return torch.tensor(ids[:max_bytes], dtype=torch.int64)


def sample_windows(
    stream: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch, length] random crops of ``stream``."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


class TargetPass(NamedTuple):
    features: dict[int, torch.Tensor]  # {layer: [B, L, d]}
    logits: torch.Tensor  # [B, L, V] fp32


def _cache(target: SparseDecoder, slots: int, length: int) -> KVCache:
    p = next(target.parameters())
    cfg = KVCacheConfig(
        kv_pool_bytes=max(64 << 20, 4 * slots * length * 4096),
        max_slots=slots,
        max_model_len=length,
        dtype=p.dtype,
        device=str(p.device),
    )
    return KVCache(target.cfg, cfg)


@torch.no_grad()
def run_target(target: SparseDecoder, tokens: torch.Tensor, layers: tuple[int, ...]) -> TargetPass:
    """One prefill of every sequence of ``tokens`` [B, L] (each its own request) -> the
    outputs of ``layers`` and the logits at every position."""
    b, length = tokens.shape
    kv = _cache(target, b, length)
    for slot in range(b):
        assert kv.admit(slot, f"train-{slot}", length, length)
    dev = next(target.parameters()).device
    batch = ForwardBatch.build(list(range(b)), [0] * b, [length] * b, dev)
    feats: dict[int, torch.Tensor] = dict.fromkeys(layers)  # type: ignore[arg-type]
    hidden = target(tokens.reshape(-1).to(dev), batch, kv, features=feats)
    kv.close()
    return TargetPass(
        {i: f.view(b, length, -1) for i, f in feats.items()},
        target.logits(hidden).view(b, length, -1),
    )


@torch.no_grad()
def target_continuations(target: SparseDecoder, prompts: torch.Tensor, length: int) -> torch.Tensor:
    """[B, P] prompts -> [B, length] the prompts continued by the target's greedy decoding
    (self-generated data: what the drafter will be asked to predict when serving)."""
    b, p = prompts.shape
    kv = _cache(target, b, length)
    for slot in range(b):
        assert kv.admit(slot, f"gen-{slot}", length, length)
    dev = next(target.parameters()).device
    out = prompts.to(dev)
    batch = ForwardBatch.build(list(range(b)), [0] * b, [p] * b, dev)
    hidden = target(out.reshape(-1), batch, kv)
    for n in range(p, length):
        kv.commit(batch, [n] * b)
        nxt = target.logits(hidden[batch.last_token_index]).argmax(-1)  # [B]
        out = torch.cat([out, nxt.unsqueeze(1)], dim=1)
        if n + 1 == length:
            break
        batch = ForwardBatch.build(list(range(b)), [n] * b, [1] * b, dev)
        hidden = target(nxt, batch, kv)
    kv.close()
    return out.cpu()


class Blocks(NamedTuple):
    """B blocks of one step; block i is anchored at ``anchors[i]`` of sequence ``seq[i]``."""

    seq: torch.Tensor  # [NB] int64
    anchors: torch.Tensor  # [NB] int64 positions
    tokens: torch.Tensor  # [NB] anchor tokens
    labels: torch.Tensor  # [NB, K-1] greedy target tokens of slots 1..K-1
    target_logits: torch.Tensor  # [NB, K-1, V]


def sample_blocks(
    tokens: torch.Tensor, logits: torch.Tensor, per_seq: int, block: int, gen: torch.Generator
) -> Blocks:
    """Random anchors (``per_seq`` per sequence) whose K-1 label positions lie inside the
    sequence. tokens: [B, L]; logits: [B, L, V]."""
    b, length = tokens.shape
    dev = logits.device
    anchors = torch.randint(0, length - block + 2, (b, per_seq), generator=gen).to(dev)
    seq = torch.arange(b, device=dev).repeat_interleave(per_seq)
    anchors = anchors.reshape(-1)
    rows = anchors.unsqueeze(1) + torch.arange(block - 1, device=dev)  # a .. a+K-2
    lg = logits[seq.unsqueeze(1), rows]  # [NB, K-1, V]
    return Blocks(seq, anchors, tokens.to(dev)[seq, anchors], lg.argmax(-1), lg)


def context_index(blocks: Blocks, length: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flattened [B·L] context each block reads: positions a-W .. a-1 of its
    sequence -> index [NB, W] (clamped) and valid [NB, W] (position >= 0)."""
    offs = torch.arange(-window, 0, device=blocks.anchors.device)
    pos = blocks.anchors.unsqueeze(1) + offs  # [NB, W]
    idx = blocks.seq.unsqueeze(1) * length + pos.clamp(min=0)
    return idx, pos >= 0
