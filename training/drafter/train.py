"""Trains a drafter (DFlash, DSpark or DFlash2) against a frozen target on a token stream.

Each step: crop B sequences from the stream, run the target once over each (its features and
logits at every position), draw random anchors, draft every block in one batched pass over
context K/V gathered from the sequence (positions a-W .. a-1, as the draft ring would serve
them), and minimise the drafter's loss: the cross-entropy against the target's greedy next
tokens with positional decay ``exp(-(k-1)/γ)`` on slot k, plus DSpark's confidence BCE or
DFlash2's selector CE. AdamW, gradient clipping, seeded and deterministic.

    python -m training.drafter.train --target tiny-glm --drafter dflash --steps 200 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from services.worker.model.decoder import SparseDecoder
from services.worker.speculative.drafters import (
    KINDS,
    Drafter,
    DrafterConfig,
    build_drafter,
    load_drafter,
    save_drafter,
)
from services.worker.weights.model_io import load_model
from training.drafter.data import (
    Blocks,
    TargetPass,
    context_index,
    corpus_tokens,
    run_target,
    sample_blocks,
    sample_windows,
    target_continuations,
)


@dataclass(frozen=True)
class TrainConfig:
    target: str = "tiny-glm"  # preset (seeded random weights) or model directory
    drafter: str = "dflash"
    steps: int = 100
    time_budget_s: float = 0.0  # > 0: stop early (and save) once this much wall time is spent
    batch_size: int = 4  # sequences per step
    seq_len: int = 256
    blocks_per_seq: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    decay_gamma: float = 4.0  # γ of the positional loss decay
    distill: float = 0.0  # weight of KL(p_target ‖ q) against greedy-label CE (sampling)
    grad_clip: float = 1.0
    seed: int = 0
    target_seed: int = 0
    device: str = "cpu"
    corpus: str | None = None  # text file or directory; default: the stdlib sources
    data: str = "corpus"  # corpus | target (sequences continued by the target, greedily)
    prompt_len: int = 32  # data=target: corpus tokens before the target continues
    num_sequences: int = 64  # data=target: sequences generated once up front
    out: str | None = None
    save_every: int = 0  # 0: only at the end
    progress: bool = True
    # drafter architecture (defaults: DrafterConfig.for_target)
    layers: int = 2
    block_size: int = 8
    window: int = 256
    target_layers: tuple[int, ...] | None = None
    init: str | None = None  # a saved drafter to go on training (its architecture wins)


def decay_weights(block: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[K-1] weights exp(-(k-1)/γ) of slots k = 1..K-1: early slots decide acceptance."""
    k = torch.arange(block - 1, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def block_loss(
    drafter: Drafter,
    tokens: torch.Tensor,
    tp: TargetPass,
    blocks: Blocks,
    weights: torch.Tensor,
    distill: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The drafter's loss on ``blocks`` of sequences ``tokens`` [B, L] with target pass ``tp``."""
    b, length = tokens.shape
    dev = blocks.anchors.device
    positions = torch.arange(length, device=dev).repeat(b)  # [B·L]
    fused = drafter.fuse({i: f.reshape(b * length, -1) for i, f in tp.features.items()})
    k, v = drafter.context_kv(fused, positions)  # [Ld, B·L, H·D]
    idx, valid = context_index(blocks, length, drafter.cfg.window)
    hidden = drafter.block_hidden(
        blocks.tokens, blocks.anchors, lambda i: (k[i][idx], v[i][idx]), valid
    )
    return drafter.loss(
        hidden, blocks.tokens, blocks.labels, blocks.target_logits, weights, distill
    )


@torch.no_grad()
def evaluate(
    drafter: Drafter,
    target: SparseDecoder,
    tokens: torch.Tensor,
    blocks_per_seq: int = 16,
    gamma: float = 4.0,
    seed: int = 0,
) -> dict[str, float]:
    """The drafter's loss and metrics on sequences ``tokens`` [B, L] with seeded anchors (a
    held-out check; ``accept_len`` is the greedy acceptance length of the sampled blocks)."""
    was_training = drafter.training
    drafter.eval()
    dev = next(target.parameters()).device
    tp = run_target(target, tokens, drafter.cfg.target_layers)
    gen = torch.Generator().manual_seed(seed)
    blocks = sample_blocks(tokens, tp.logits, blocks_per_seq, drafter.block_size, gen)
    weights = decay_weights(drafter.block_size, gamma, dev)
    loss, metrics = block_loss(drafter, tokens, tp, blocks, weights)
    drafter.train(was_training)
    return {"loss": float(loss), **metrics}


def make_drafter(cfg: TrainConfig, target: SparseDecoder) -> Drafter:
    if cfg.init:
        drafter = load_drafter(cfg.init, target)
        if drafter.cfg.kind != cfg.drafter or drafter.block_size != cfg.block_size:
            raise ValueError(
                f"--init {cfg.init} is a {drafter.cfg.kind} drafter of block "
                f"{drafter.block_size}, not {cfg.drafter} of block {cfg.block_size}"
            )
        return drafter
    overrides: dict = {"n_layers": cfg.layers, "block_size": cfg.block_size, "window": cfg.window}
    if cfg.target_layers is not None:
        overrides["target_layers"] = tuple(cfg.target_layers)
    dcfg = DrafterConfig.for_target(target.cfg, cfg.drafter, **overrides)
    return build_drafter(dcfg, target, seed=cfg.seed)


def _sequences(cfg: TrainConfig, target: SparseDecoder, gen: torch.Generator) -> torch.Tensor:
    stream = corpus_tokens(cfg.corpus)
    if cfg.data == "corpus":
        return stream
    if cfg.data != "target":
        raise ValueError(f"unknown data {cfg.data!r}; choose corpus or target")
    prompts = sample_windows(stream, cfg.num_sequences, cfg.prompt_len, gen)
    return target_continuations(target, prompts, cfg.seq_len)


def train(cfg: TrainConfig, target: SparseDecoder | None = None) -> tuple[Drafter, list[dict]]:
    """Runs ``cfg.steps`` steps; returns the drafter and per-step metrics. Saves to
    ``cfg.out`` (and ``cfg.out/checkpoint-N`` every ``save_every`` steps) when given."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if target is None:
        target = load_model(cfg.target, device=cfg.device, seed=cfg.target_seed)
    target.requires_grad_(False).eval()
    drafter = make_drafter(cfg, target)
    drafter.train()
    data = _sequences(cfg, target, gen)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    dev = next(target.parameters()).device
    weights = decay_weights(cfg.block_size, cfg.decay_gamma, dev)
    history = _earlier_history(cfg.init)
    first = len(history) + 1
    t0 = time.monotonic()
    bar = tqdm(
        range(first, first + cfg.steps), disable=not cfg.progress, desc=f"train {cfg.drafter}"
    )
    for step in bar:
        if data.dim() == 1:
            tokens = sample_windows(data, cfg.batch_size, cfg.seq_len, gen)
        else:
            tokens = data[torch.randint(0, len(data), (cfg.batch_size,), generator=gen)]
        tp = run_target(target, tokens, drafter.cfg.target_layers)
        blocks = sample_blocks(tokens, tp.logits, cfg.blocks_per_seq, cfg.block_size, gen)
        loss, metrics = block_loss(drafter, tokens, tp, blocks, weights, cfg.distill)
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"loss is {float(loss.detach())} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        history.append({"step": step, "loss": float(loss.detach()), **metrics})
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", tau=f"{metrics['accept_len']:.2f}")
        if cfg.out and cfg.save_every and step % cfg.save_every == 0:
            _save(drafter, opt, cfg, history, Path(cfg.out) / f"checkpoint-{step}")
        if cfg.time_budget_s and time.monotonic() - t0 >= cfg.time_budget_s:
            break
    drafter.eval()
    if cfg.out:
        _save(drafter, opt, cfg, history, Path(cfg.out))
    return drafter, history


def _earlier_history(init: str | None) -> list[dict]:
    """The history of the drafter training goes on from (none for a fresh drafter)."""
    path = Path(init) / "history.jsonl" if init else None
    if path is None or not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _save(
    drafter: Drafter,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    history: list[dict],
    path: Path,
) -> None:
    save_drafter(drafter, path)
    torch.save({"optimizer": opt.state_dict(), "step": len(history)}, path / "trainer.pt")
    (path / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    (path / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.drafter.train", description=__doc__)
    d = TrainConfig()
    ap.add_argument("--target", default=d.target)
    ap.add_argument("--drafter", choices=KINDS, default=d.drafter)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--time-budget-s", type=float, default=d.time_budget_s)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--decay-gamma", type=float, default=d.decay_gamma)
    ap.add_argument("--distill", type=float, default=d.distill)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--target-seed", type=int, default=d.target_seed)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--data", choices=("corpus", "target"), default=d.data)
    ap.add_argument("--num-sequences", type=int, default=d.num_sequences)
    ap.add_argument("--save-every", type=int, default=d.save_every)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--window", type=int, default=d.window)
    ap.add_argument("--target-layers", type=int, nargs="+", default=None)
    ap.add_argument("--init", default=None, help="a saved drafter to go on training")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    cfg = replace(
        d,
        target=a.target,
        drafter=a.drafter,
        steps=a.steps,
        time_budget_s=a.time_budget_s,
        out=a.out,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        blocks_per_seq=a.blocks_per_seq,
        lr=a.lr,
        decay_gamma=a.decay_gamma,
        distill=a.distill,
        seed=a.seed,
        target_seed=a.target_seed,
        device=a.device,
        corpus=a.corpus,
        data=a.data,
        num_sequences=a.num_sequences,
        save_every=a.save_every,
        layers=a.layers,
        block_size=a.block_size,
        window=a.window,
        target_layers=tuple(a.target_layers) if a.target_layers else None,
        progress=not a.no_progress,
        init=a.init,
    )
    _, history = train(cfg)
    last = history[-1] if history else {}
    print(json.dumps({"out": cfg.out, **last}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
