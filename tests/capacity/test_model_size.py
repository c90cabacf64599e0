"""``dhisparse plan --model DIR`` on the released configs of DeepSeek-V3.2, GLM-5.1 and GLM-5.2
(tests/fixtures/configs): parameters and KV bytes per token as /work/shared/notes/real-models.md
gives them, and the capacity plan of their topology."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dhisparse.capacity import model_size_from_dir, profile_from_model_dir
from dhisparse.cli import main
from dhisparse.family.hf_config import parse_config, topology
from dhisparse.family.hf_dir import read_config
from dhisparse.family.hf_size import param_count
from dhisparse.family.presets import home_made
from tests.fixtures import CONFIGS, RELEASED

ROOT = Path(__file__).resolve().parents[2]
# fp8: 576 one-byte elements per layer and a 132 B key (128 + one fp32 scale) per producer
FP8 = {"deepseek-v3.2": 61 * 576 + 61 * 132, "glm-5.1": 78 * 708, "glm-5.2": 78 * 576 + 21 * 132}


def plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_note_figures(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    params, experts_b, bf16, producers = RELEASED[name]
    out = plan(["--model", str(CONFIGS / name), "--context", "131072", "--json"], capsys)
    model = json.loads(out)["model"]
    assert model["parameters"]["total"] == params
    assert round(model["parameters"]["routed_experts"] / 1e9, 2) == experts_b
    assert model["kv_per_token"]["bf16"]["total"] == bf16
    assert model["kv_per_token"]["fp8"]["total"] == FP8[name]
    assert model["index_producers"] == producers

    table = plan(["--model", str(CONFIGS / name), "--context", "131072"], capsys)
    assert f"parameters   {params / 1e9:.2f} B ({params:,};" in table
    assert f"KV/token bf16 {bf16:>8,} B" in table


def test_v32_rounds_to_the_note() -> None:
    size = model_size_from_dir(CONFIGS / "deepseek-v3.2")
    assert size is not None
    assert f"{size.parameters.total / 1e9:.2f}" == "671.88"
    assert size.parameters.router_bias == 58 * 256  # one per routed expert of each MoE layer


def test_plan_of_the_topology(capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-5.2's IndexShare reaches the capacity model: 78 sources of 1152 B rows, 21 producers
    of 256 B keys, each serving its group of at most 4 sources."""
    profile = profile_from_model_dir(CONFIGS / "glm-5.2")
    assert [(s.count, s.row_bytes) for s in profile.sources] == [(78, 1152)]
    assert [(g.count, g.key_bytes) for g in profile.indexers] == [(21, 256)]
    assert profile.chi == 4 and profile.top_k == 2048
    out = plan(
        ["--model", str(CONFIGS / "glm-5.2"), "--context", "131072", "--pool-gib", "60"], capsys
    )
    assert "index keys   21 producers × 256 B/row" in out
    assert "sessions (pool 60.000 GiB/GPU" in out
    fp8 = plan(
        ["--model", str(CONFIGS / "glm-5.2"), "--context", "1000", "--kv-dtype-bytes", "1"],
        capsys,
    )
    assert "78 × sparse 576 B/row" in fp8


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_mtp_drafter_adds_its_layer(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--drafter mtp`` serves the MTP layer (num_nextn_predict_layers 1 in every released
    config) as one more source and producer: 1,152 B of row and 256 B of key per token in
    bf16, 576 + 132 in fp8; no draft ring, and staging for its verified blocks. Without it the
    figures are the target's alone (``test_the_note_figures``)."""
    _, _, bf16, producers = RELEASED[name]
    args = ["--model", str(CONFIGS / name), "--context", "131072", "--json"]
    alone = json.loads(plan(args, capsys))
    got = json.loads(plan([*args, "--drafter", "mtp"], capsys))
    model = got["model"]
    assert model["mtp"] and not alone["model"]["mtp"]
    assert model["kv_per_token"]["bf16"]["total"] == bf16 + 1152 + 256
    assert model["kv_per_token"]["fp8"]["total"] == FP8[name] + 576 + 132
    assert model["index_producers"] == producers + 1
    assert model["parameters"] == alone["model"]["parameters"]  # MTP weights not counted
    assert got["drafter"]["name"] == "mtp" and got["drafter"]["row_bytes"] == 0
    table = plan([*args[:-1], "--drafter", "mtp"], capsys)
    assert "(with the MTP layer's)" in table and "draft ring (none: a source)" in table


def test_the_mtp_drafter_needs_a_model_with_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", "tiny-glm", "--context", "100", "--drafter", "mtp"]) == 2
    assert "no drafter 'mtp'" in capsys.readouterr().err


def test_glm52_index_share_from_freq_and_offset() -> None:
    """Without its explicit list, GLM-5.2's indexer types come from index_topk_freq 4 and
    index_skip_topk_offset 3: the same topology."""
    raw = read_config(CONFIGS / "glm-5.2")
    explicit = topology(parse_config(raw), "glm-5.2")
    derived_raw = {k: v for k, v in raw.items() if k != "indexer_types"}
    derived = topology(parse_config(derived_raw), "glm-5.2")
    assert derived == explicit
    full = [i for i, s in enumerate(explicit.layers) if s.index == "producer"]
    assert full == [0, 1, 2, *range(6, 78, 4)]


def test_the_engine_format_has_no_model_size(tmp_path: Path) -> None:
    home_made("tiny-indexshare").save(tmp_path / "config.json")
    assert model_size_from_dir(tmp_path) is None


def test_an_unsupported_config_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = read_config(CONFIGS / "glm-5.1") | {"some_new_field": 1}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--context", "1000"]) == 2
    assert "some_new_field" in capsys.readouterr().err


def test_tied_embeddings_count_one_matrix() -> None:
    cfg = parse_config(read_config(CONFIGS / "glm-5.1"))
    tied = param_count(replace(cfg, tie_word_embeddings=True))
    assert tied.lm_head == 0
    assert param_count(cfg).total - tied.total == cfg.vocab_size * cfg.hidden_size


def test_plan_of_a_model_dir_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from dhisparse.cli import main\n"
        f"assert main(['plan', '--model', {str(CONFIGS / 'glm-5.2')!r}, '--context', '100']) == 0\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plan_in_the_workers_fp8_formats(capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-cache-dtype fp8`` sizes what an fp8 worker stores: 656 B rows (512 e4m3, 4 fp32
    scales, 64 bf16 rope) and 132 B keys; host backups shrink with the rows (656 / 1152)."""
    from dhisparse.capacity import host_bytes

    args = ["--model", str(CONFIGS / "glm-5.2"), "--context", "131072", "--json"]
    bf16 = json.loads(plan(args, capsys))
    fp8 = json.loads(plan([*args, "--kv-cache-dtype", "fp8"], capsys))
    assert bf16 != fp8
    table = plan([*args[:-1], "--kv-cache-dtype", "fp8"], capsys)
    assert "78 × sparse 656 B/row" in table and "21 producers × 132 B/row" in table
    a = profile_from_model_dir(CONFIGS / "glm-5.2")
    b = profile_from_model_dir(CONFIGS / "glm-5.2", kv_cache_dtype="fp8")
    assert [(s.count, s.row_bytes) for s in b.sources] == [(78, 656)]
    assert [(g.count, g.key_bytes) for g in b.indexers] == [(21, 132)]
    ha, hb = host_bytes(a, 131072), host_bytes(b, 131072)
    assert abs(hb / ha - 656 / 1152) < 1e-3
    tiny = plan(["--profile", "tiny-glm", "--context", "1000", "--kv-cache-dtype", "fp8"], capsys)
    assert "× sparse 100 B/row" in tiny  # 64 e4m3 + one fp32 scale + 16 bf16
    # the paper's profile gives its row bytes itself
    assert (
        main(["plan", "--profile", "glm-5.3", "--context", "1000", "--kv-cache-dtype", "fp8"]) == 2
    )
