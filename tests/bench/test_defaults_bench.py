"""``python -m bench defaults`` on this machine's defaults (the CPU here): ``dhisparse up`` with no
serving flags, README's chat example streamed whole and with worker 0 SIGKILLed mid-stream; the
result names what the worker chose, the texts match and each kill's stall is recorded. The
request is README's chat example."""

from __future__ import annotations

import json

from bench import defaults
from bench.stale import check
from tests.bench.helpers import ROOT, bench
from tests.bench.readme import readme_curl_bodies


def test_the_request_is_readmes_chat_example() -> None:
    (body,) = readme_curl_bodies("/v1/chat/completions")
    assert body == defaults.REQUEST


def test_the_defaults_here_give_the_same_text_across_a_kill(tmp_path) -> None:
    out = tmp_path / "defaults.json"
    proc = bench("defaults", "--kills", "1", "--out", str(out), timeout=400)
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], doc.get("trials"))
    assert doc["device"] == "cpu" and doc["mode"] == "adaptive"
    assert doc["cuda_graphs"] == "off" and doc["durable_sessions"] == "on"
    assert doc["drafter"] == "mtp"  # the CPU default for the shipped model
    pool = doc["kv_pool"]  # the worker sizes it (no flag) and says so at start-up
    assert pool["bytes"] > 0 and pool["kv_pool_mib_flag"] is None
    # 256 MiB for sessions beside what does not grow with them
    assert any("MiB (auto: the CPU default, 256 MiB for sessions" in line
               for line in pool["startup_lines"]), pool  # fmt: skip
    assert doc["kills"] == 1 and doc["text_identical"] is True
    (trial,) = doc["trials"]
    assert trial["killed"] and trial["text_identical"] and trial["finish_reason"] == "length"
    assert trial["stall_s"] > 0 and doc["stalls_s"] == [trial["stall_s"]]
    assert trial["sessions_resumed"] == 1 and trial["prefill_tokens_computed"] == 0
    assert doc["whole"]["completion_tokens"] == defaults.REQUEST["max_tokens"]
    assert doc["tokens_per_s"] > 0
    prov = doc["provenance"]
    assert {"bench/defaults.py", "bench/core/up.py", "services/worker/server.py"} <= set(
        prov["files"]
    )  # the stack's code, which its processes ran
    assert check(out, ROOT) is None
