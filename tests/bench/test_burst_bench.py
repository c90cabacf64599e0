"""``python -m bench burst`` on this machine's defaults: a burst larger than the stack serves in
its queue deadline is served or refused at once (429 with Retry-After), nothing else; the
result counts both and the rate served. The prompt is README's completion example."""

from __future__ import annotations

import json

from bench import burst
from bench.stale import check
from tests.bench.helpers import ROOT, bench
from tests.bench.readme import readme_curl_bodies


def test_the_prompt_is_readmes_completion_example() -> None:
    sent, *_ = readme_curl_bodies("/v1/completions")
    assert sent["prompt"] == burst.PROMPT and sent["model"] == burst.MODEL


def test_a_burst_is_served_or_refused_at_once(tmp_path) -> None:
    out = tmp_path / "burst.json"
    proc = bench("burst", "--requests", "40", "--max-tokens", "16", "--out", str(out),
                 timeout=600)  # fmt: skip
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], doc["summary"])
    s = doc["summary"]
    assert s["other"] == 0 and s["served"] + s["refused_429"] == 40
    assert s["served"] >= 1 and s["served_per_s"] > 0
    for r in doc["results"]:
        if r["status"] == 200:
            assert r["completion_tokens"] == 16
        else:
            assert r["retry_after_s"] is not None and r["retry_after_s"] >= 1
    assert check(out, ROOT) is None  # the result names the code it measured
