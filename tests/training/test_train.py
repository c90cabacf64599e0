"""Drafter training: a few CPU steps against tiny-glm with random weights lower the loss on
held-out sequences for every drafter; runs are deterministic; the CLI writes a loadable
checkpoint."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from services.worker.speculative import load_drafter
from tests.worker.speculative.helpers import KINDS, target
from training.drafter.data import corpus_tokens, sample_windows
from training.drafter.train import TrainConfig, evaluate, main, make_drafter, train

SMALL = TrainConfig(
    steps=15,
    batch_size=2,
    seq_len=64,
    blocks_per_seq=8,
    window=32,
    lr=3e-3,
    progress=False,
)


@pytest.mark.parametrize("kind", KINDS)
def test_a_few_steps_reduce_the_loss(kind: str) -> None:
    cfg = replace(SMALL, drafter=kind)
    t = target("tiny-glm")
    held_out = sample_windows(
        corpus_tokens(max_bytes=1 << 20), 4, 64, torch.Generator().manual_seed(99)
    )
    before = evaluate(make_drafter(cfg, t), t, held_out)
    drafter, history = train(cfg, target=t)
    after = evaluate(drafter, t, held_out)
    assert len(history) == cfg.steps
    assert after["loss"] < before["loss"] - 0.3, (before, after)
    assert not any(p.requires_grad for p in t.parameters())  # the target stayed frozen


def test_training_is_deterministic() -> None:
    cfg = replace(SMALL, drafter="dspark", steps=3)
    _, a = train(cfg, target=target("tiny-glm"))
    _, b = train(cfg, target=target("tiny-glm"))
    assert a == b


def test_cli_writes_a_loadable_checkpoint(tmp_path, capsys) -> None:
    out = tmp_path / "dflash2"
    args = ["--target", "tiny-glm", "--drafter", "dflash2", "--steps", "2", "--out", str(out)]
    args += ["--batch-size", "2", "--seq-len", "48", "--window", "16", "--device", "cpu"]
    args += ["--data", "target", "--num-sequences", "2", "--save-every", "1", "--no-progress"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 2
    for d in (out, out / "checkpoint-1"):
        assert (d / "drafter.json").exists() and (d / "drafter.safetensors").exists()
    drafter = load_drafter(out, target("tiny-glm"))
    assert drafter.kind == "dflash2" and drafter.cfg.window == 16


def test_training_goes_on_from_a_saved_drafter(tmp_path) -> None:
    """--init: the saved weights are the start, the history continues its step count, and a
    drafter of another kind or block is refused."""
    t = target("tiny-glm")
    first = replace(SMALL, drafter="dflash2", steps=2, out=str(tmp_path / "a"))
    drafter, _ = train(first, target=t)
    more = replace(first, steps=0, init=first.out, out=str(tmp_path / "b"))
    resumed, history = train(more, target=t)
    assert [h["step"] for h in history] == [1, 2]
    for (name, p), q in zip(
        drafter.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    _, history = train(replace(more, steps=1), target=t)
    assert [h["step"] for h in history] == [1, 2, 3]
    with pytest.raises(ValueError, match="block"):
        make_drafter(replace(more, block_size=4), t)
