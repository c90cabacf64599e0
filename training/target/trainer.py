"""The training state and what happens to it: one optimizer step, evaluation, checkpoint,
resume, and the final export.

Precision: fp32 master weights; on CUDA the forward runs under bf16 autocast (fused SDPA,
TF32 for what stays fp32). On the CPU everything is fp32 and a run is bit-for-bit
deterministic given its seed, resumed or not."""

from __future__ import annotations

import json
import platform
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from training.target.checkpoint import (
    CKPT_FILE,
    HISTORY_FILE,
    MODEL_DIR,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from training.target.config import TrainConfig
from training.target.corpus import build_corpus
from training.target.data import heldout_windows, load_token_data, sample_crops
from training.target.evaluate import heldout_metrics
from training.target.family import Family, StepLosses, family_of
from training.target.forward import Mode
from training.target.schedule import Schedule
from training.target.weights import param_groups

_SHARD_HEADER_MARGIN = 1 << 16  # bytes kept free in each shard for its JSON header


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.seed)
        corpus_path = Path(cfg.corpus) if cfg.corpus else self.out / "corpus.u8"
        if not cfg.corpus and not corpus_path.exists():
            build_corpus(corpus_path)
        data = load_token_data(corpus_path)
        self.corpus_sha256 = data.sha256
        self.stream = data.train.to(self.device)
        self.byte_lengths = data.byte_lengths
        self.windows = heldout_windows(
            data.heldout.to(self.device), cfg.seq_len + 1, cfg.eval_tokens
        )
        self.family: Family = family_of(cfg)
        self.model = self.family.build(cfg.seed)
        if cfg.init_from:
            self.model.load_state_dict(load_checkpoint(Path(cfg.init_from) / CKPT_FILE)["model"])
        self.model.to(device=self.device, dtype=torch.float32).train()
        named = list(self.model.named_parameters())
        self.indexer_params = [p for n, p in named if ".indexer." in n]
        self.main_params = [p for n, p in named if ".indexer." not in n]
        self.opt = torch.optim.AdamW(
            param_groups(self.model, cfg.weight_decay),
            lr=cfg.lr,
            betas=cfg.betas,
            fused=self.device.type == "cuda",
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)
        losses = self.family.losses
        self._losses = torch.compile(losses) if cfg.compile else losses
        self.step = 0
        self.total: int | None = cfg.steps or None  # planned steps (None: not yet planned)
        self.history: list[dict] = []
        self.elapsed_before = 0.0  # training wall time of earlier invocations
        self.eval_s = 0.0  # how long the last evaluation took (what a budget keeps for one)
        if cfg.resume:
            self.restore()
        else:
            (self.out / HISTORY_FILE).write_text("")  # a fresh run: no earlier run's records

    # ---- schedule ---------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        """Before a budgeted run is planned only warm-up steps run: they do not need the total.
        A run of fixed steps warms up for at most a fifth of them."""
        c = self.cfg
        total = self.total if self.total is not None else 1 << 62
        warmup = min(c.warmup, max(1, c.steps // 5)) if c.steps else c.warmup
        return Schedule(c.lr, warmup, total, c.dense_frac, c.min_lr_frac)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def autocast(self) -> AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # ---- one step ---------------------------------------------------------------------------
    def losses(
        self, crop: torch.Tensor, mode: Mode, gen: torch.Generator | None = None
    ) -> StepLosses:
        """Forward and backward of one batch ``crop`` [B, T+1]; gradients accumulate. ``gen``
        draws what the losses sample (the KL's queries); default: the run's generator."""
        with self.autocast():
            out = self._losses(self.model, crop, mode, gen or self.gen)
        out.loss.backward()
        return StepLosses(out.loss.detach(), out.parts, out.aux)

    def train_step(self) -> tuple[StepLosses, dict[str, float], float, Mode]:
        """Runs step ``self.step + 1``; returns its losses, what the family logged after the
        optimizer step, the learning rate and the attention mode. The indexer (trained only
        by its KL) and the rest are clipped separately, so that a burst in one loss does not
        shrink the other's update."""
        step = self.step + 1
        sched = self.schedule
        lr = sched.lr_at(step)
        mode: Mode = "dense" if sched.mode_at(step) == "dense" else "sparse"
        for group in self.opt.param_groups:
            group["lr"] = lr
        crop = sample_crops(self.stream, self.cfg.batch_size, self.cfg.seq_len + 1, self.gen)
        self.opt.zero_grad(set_to_none=True)
        losses = self.losses(crop, mode)
        for params in (self.main_params, self.indexer_params):
            if params:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.opt.step()
        after = self.family.after_step(self.model, losses.aux)
        self.step = step
        return losses, after, lr, mode

    def evaluate(self) -> dict:
        was_training = self.model.training
        self.model.eval()
        try:
            return heldout_metrics(
                lambda tokens: self.family.logits(self.model, tokens),
                self.windows,
                self.byte_lengths,
                self.cfg.batch_size,
                self.autocast(),
            )
        finally:
            self.model.train(was_training)

    # ---- bookkeeping --------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        self.history.append(record)
        with (self.out / HISTORY_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def checkpoint(self, elapsed: float) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": {"total": self.total, "eval_s": self.eval_s},
            "step": self.step,
            "rng": rng_state(self.gen),
            "history": self.history,
            "elapsed": elapsed,
            "config": self.cfg.trajectory(),
            "corpus_sha256": self.corpus_sha256,
        }
        save_checkpoint(self.out / CKPT_FILE, state)

    def restore(self) -> None:
        """Continues from ``OUT/ckpt.pt``: the same trajectory as an uninterrupted run."""
        state = load_checkpoint(self.out / CKPT_FILE)
        theirs, ours = state["config"], self.cfg.trajectory()
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if diff:
            raise ValueError(f"--resume with a different run: {diff} differ from the checkpoint")
        if state["corpus_sha256"] != self.corpus_sha256:
            raise ValueError("--resume with a different corpus (sha256 differs)")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.total = state["schedule"]["total"]
        self.eval_s = state["schedule"]["eval_s"]
        self.step = state["step"]
        restore_rng(state["rng"], self.gen)
        self.history = state["history"]
        self.elapsed_before = state["elapsed"]
        # Drop what an interrupted run logged after its last checkpoint.
        (self.out / HISTORY_FILE).write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def export(self, metrics: dict[str, float], elapsed: float, stopped_by: str) -> Path:
        """bf16 weights in shards of at most ``max_shard_mb``, plus ``training.json``."""
        model_dir = self.out / MODEL_DIR
        limit = int(self.cfg.max_shard_mb * 1e6) - _SHARD_HEADER_MARGIN
        self.family.export(self.model, model_dir, limit)
        summary = {
            "model": self.family.describe(self.model),
            "train": self.cfg.trajectory(),
            "params": sum(p.numel() for p in self.model.parameters()),
            "steps": self.step,
            "planned_steps": self.total,
            "stopped_by": stopped_by,
            "tokens": self.step * self.tokens_per_step,
            "heldout_bits_per_byte": metrics["eval_bpb"],
            "heldout_perplexity": metrics["eval_ppl"],
            "heldout_nats_per_token": metrics["eval_loss"],
            "heldout_bits_per_byte_by_position": metrics["eval_bpb_by_position"],
            "wall_time_s": elapsed,
            "device": device_name(self.device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "corpus_sha256": self.corpus_sha256,
            "weights": str(model_dir),
        }
        (self.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        return model_dir


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"
