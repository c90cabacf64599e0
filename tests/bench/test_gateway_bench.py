"""bench/gateway.py at a tiny N: real worker and gateway processes, both variants; the result
has its documented structure, positive latencies, ordered percentiles, one paired overhead per
request, and both paths gave the same greedy output."""

from __future__ import annotations

import argparse
import json

from bench import gateway as bench


def test_gateway_overhead_smoke() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--requests", "10", "--warmup", "2", "--repeats", "2"])
    result = bench.run(args)
    json.dumps(result)  # JSON-able as returned
    assert result["benchmark"] == "gateway_overhead"
    assert result["config"]["requests"] == 10 and result["config"]["prompt_tokens"] > 0
    assert set(result["variants"]) == {"non_stream", "stream"}
    for variant in result["variants"].values():
        assert variant["same_output"]
        assert len(variant["repeats"]) == 2
        for part in [*variant["repeats"], variant["pooled"]]:
            assert set(part) == {"gateway_ms", "direct_ms", "overhead_ms"}
            for path in ("gateway_ms", "direct_ms"):
                s = part[path]
                assert 0 < s["p50"] <= s["p90"] <= s["p99"], s
            o = part["overhead_ms"]
            assert o["p50"] <= o["p90"] <= o["p99"], o
        assert variant["pooled"]["gateway_ms"]["n"] == 20
        # one overhead per request, paired with its own direct run; its sign is a measurement
        # (noise on a busy machine can make a tiny N negative), so the benchmark reports it
        assert variant["pooled"]["overhead_ms"]["n"] == 20
        spread = variant["overhead_p50_spread_ms"]
        assert spread["min"] <= spread["max"] and spread["range"] >= 0
    assert isinstance(result["meets_goal"], bool) and result["goal_p50_ms"] == 2.0
