"""What one training run is: model, data, optimisation, schedule and bookkeeping."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Fields a resumed run may change: they do not alter the trajectory of the parameters.
RUN_ONLY = frozenset(
    {
        "out",
        "corpus",  # the corpus is checked by its sha256 instead
        "resume",
        "stop_at",
        "time_budget_s",
        "progress",
        "compile",
        "ckpt_every",
        "eval_every",
        "eval_tokens",
        "log_every",
        "max_shard_mb",
        "init_from",  # checked by the checkpoint's weights instead
    }
)


@dataclass(frozen=True)
class TrainConfig:
    out: str
    preset: str = "glm-10m"  # a preset name, a model config JSON, or a Hugging Face config.json
    # a byte corpus file (corpus.py; default: build OUT/corpus.u8 here) or a token directory
    # (``python -m training.corpus``)
    corpus: str | None = None
    steps: int = 2000  # planned optimizer steps; 0: plan them from the budget
    time_budget_s: float = 0.0  # stop when this invocation ran this long (see run_budget_s)
    # the whole run's training time, over several invocations of time_budget_s each: steps are
    # planned from it, and an invocation that runs out of its own budget checkpoints and
    # returns (resume it) instead of ending the run; 0: the run is this one invocation
    run_budget_s: float = 0.0
    batch_size: int = 32  # sequences per step
    seq_len: int = 1024  # tokens per sequence (each predicts the next)
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 100  # steps; with fixed steps at most steps // 5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    dense_frac: float = 0.8  # share of planned steps with dense attention, then sparse
    index_loss_weight: float = 1.0  # λ of the indexer KL
    kl_queries: int = 0  # queries per sequence the indexer KL is estimated on (0: all)
    mtp_weight: float = 0.3  # the MTP layer's loss, trained jointly (real families)
    balance_rate: float = 1e-3  # the routers' bias step (auxiliary-loss-free balancing)
    init_from: str | None = None  # start from this training run's weights (a later phase)
    eval_every: int = 250  # held-out evaluation (sparse attention); 0: only at the end
    eval_tokens: int = 1 << 20  # held-out predictions per evaluation (at most)
    ckpt_every: int = 500  # 0: only at the end
    log_every: int = 10  # history.jsonl / progress cadence (a device sync each)
    seed: int = 0
    device: str = "cpu"
    compile: bool = False  # torch.compile the training forward
    resume: bool = False
    stop_at: int = 0  # stop after this step and checkpoint, without finishing (0: never)
    progress: bool = True
    max_shard_mb: float = 15.0  # largest exported weight file, in 10^6 bytes

    def validate(self) -> None:
        if self.steps < 0 or (self.steps == 0 and self.time_budget_s <= 0):
            raise ValueError("steps=0 (planned from the budget) needs a time budget")
        if self.run_budget_s and not self.time_budget_s:
            raise ValueError("run_budget_s (a run of several invocations) needs time_budget_s")
        if not 0.0 <= self.dense_frac <= 1.0:
            raise ValueError("dense_frac must lie in [0, 1]")
        if self.warmup < 1:
            raise ValueError("warmup must be >= 1 step")

    def trajectory(self) -> dict:
        """The fields that determine the parameters' trajectory (must match on resume)."""
        return {k: v for k, v in asdict(self).items() if k not in RUN_ONLY}
