"""No dead definitions: ``vulture`` over the packages, with the tests read as users (a helper the
tests alone call is used). What a framework calls by name, and fields that exist to be recorded
or serialised, are named below with the reason; anything else vulture reports is dead code to
delete, not to list."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("dhisparse", "services", "bench", "training")
READ_AS_USERS = ("tests", "scripts", "docker")

# Called by a framework, by name or through a decorator.
FRAMEWORK_DECORATORS = (
    "@app.*", "@router.*", "@field_validator", "@model_validator", "@model_serializer",
    "@field_serializer",
)  # fmt: skip
FRAMEWORK_NAMES = (
    "model_config",  # pydantic's settings of a model
    "do_GET", "log_message", "daemon_threads",  # http.server's handler and server hooks
    "extra_repr",  # torch.nn.Module's repr hook
    "Abort",  # a gRPC servicer method (grpc calls it by the rpc's name)
    "pytest_collectreport", "pytest_configure", "pytest_runtest_logreport",  # pytest hooks
    "formatter_class", "allow_tf32", "pre_tokenizer", "decoder", "encode_special_tokens",
    "__getattr__",  # a package's lazy exports (PEP 562)
    "tags",  # a jinja2 extension's tags
    "signum", "frame",  # a signal handler's arguments
    "category",  # warnings.showwarning's arguments
)  # fmt: skip
# Fields of records that are written out whole (JSON results, API bodies, config files).
RECORD_FIELDS = (
    "pad_token_id", "end_token_id",  # the tokenizer's special ids, as tokenizer_config.json says
    "max_length",  # generation_config.json
    "total_tokens", "prompt_tokens_details",  # OpenAI usage
    "decoded_token",  # vLLM's prompt_logprobs entries
    "pcie_s", "resident_bytes_per_token", "hierarchy_session_bytes",  # benchmark records
)  # fmt: skip


def vulture() -> list[str]:
    exe = shutil.which("vulture", path=str(Path(sys.executable).parent)) or shutil.which("vulture")
    if exe is None:
        pytest.fail("vulture is not installed (it is a dev dependency: `make install`)")
    out = subprocess.run(
        [exe, *CHECKED, *READ_AS_USERS, "--min-confidence", "60", "--exclude", "*_pb2*.py",
         "--ignore-decorators", ",".join(FRAMEWORK_DECORATORS),
         "--ignore-names", ",".join(FRAMEWORK_NAMES + RECORD_FIELDS)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode in (0, 3), out.stderr  # 3: dead code found
    return [line for line in out.stdout.splitlines() if line.startswith(CHECKED)]


def test_no_dead_definitions() -> None:
    found = vulture()
    assert not found, "dead code (delete it):\n" + "\n".join(found)
