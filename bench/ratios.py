"""``python -m bench ratios``: README's table of measured results, every row computed from a
result JSON under ``docs/results/`` (never from ``docs/results/archive/``).

    python -m bench ratios                  # prints the table
    python -m bench ratios --write-readme   # rewrites it in README.md, between the markers

Each row (``ROWS``, at most 12) says what it compares, its value, where it was measured (the
commit, "dirty" when the measured code differed from it, and the GPU or the CPU) and the command
that reproduces it: the result's own, from its provenance, without the options that only name
output files (``OUTPUT_OPTIONS``). A row whose JSON is not in ``docs/results/`` reads "not
measured at HEAD" with the command that measures it. README holds the table between the lines
``MARKERS``; a test fails when it differs from this command's output."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.provenance import ROOT

RESULTS = "docs/results"
README = "README.md"
MARKERS = ("<!-- bench ratios -->", "<!-- /bench ratios -->")
OUTPUT_OPTIONS = ("--out", "--plot", "--table", "--trace", "--log-dir")
NOT_MEASURED = "not measured at HEAD"
HEADER = ["| result | value | measured at | command |", "|---|---|---|---|"]


@dataclass(frozen=True)
class Row:
    what: str  # what the value compares, and the goal where there is one
    # the result JSON under docs/results/, or several (runs of one command, e.g. one per
    # concurrency): ``value`` then reads the list of their documents, in this order
    file: str | tuple[str, ...]
    value: Callable[[Any], str]
    measure: str  # the command that measures it, for when the JSON is not there

    @property
    def files(self) -> tuple[str, ...]:
        return self.file if isinstance(self.file, tuple) else (self.file,)


def _x(v: float) -> str:
    return f"{v:.2f}×"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _span(vs: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = fmt.format(min(vs)), fmt.format(max(vs))
    return lo if lo == hi else f"{lo}–{hi}"


def resolver_all_hit(doc: dict) -> str:
    hit = sorted((r for r in doc["results"] if r["miss_rate"] == 0), key=lambda r: r["batch"])
    ratios = [r["total_over_gather"] for r in hit]
    return (f"{' / '.join(_x(v) for v in ratios)} at batch "
            f"{' / '.join(str(r['batch']) for r in hit)} ({_met(max(ratios) <= 1.3)})")  # fmt: skip


def resolver_recovery(doc: dict) -> str:
    many = [r["recovery_over_bulk"] for r in doc["results"] if r["misses_per_step"] >= 4096]
    if not many:
        return "no case missed 4,096 rows in a step"
    return f"{_span(many, '{:.0%}')} ({_met(min(many) >= 0.8)})"


def resolver(doc: dict) -> str:
    return f"all hit {resolver_all_hit(doc)}; host recovery {resolver_recovery(doc)}"


def burst(doc: dict) -> str:
    s = doc["summary"]
    refused = s["refusal_s"]
    when = (f" and Retry-After, after {refused['median']:.2f} s (median) to "
            f"{refused['max']:.1f} s" if s["refused_429"] else "")  # fmt: skip
    return (f"{s['served']} served, {s['served_per_s']:.2f} requests/s "
            f"({s['tokens_per_s']:.1f} tok/s); {s['refused_429']} refused with 429{when}; "
            f"{s['other']} other statuses")  # fmt: skip


# issue 41's goals for speculation ÷ plain decoding at real dimensions, by concurrency
SPEC_GOALS = {1: 1.3, 16: 1.6, 64: 1.4}


def spec_scaled(docs: list[dict]) -> str:
    """The first fixed width of ``bench scaled --spec`` over plain decoding (``off``), per C
    (over the runs ``docs``, each at some C): over the whole timed window, and in steady state
    where it differs."""
    fams = [d["families"][0] for d in docs]
    (fixed,) = [s for s in docs[0]["spec"] if s.startswith("fixed:") and "+" not in s][:1]
    rows = {(r["mode"].split("/")[-1], r["concurrency"]): r for f in fams for r in f["rows"]}
    fam = fams[0]
    cells = []
    for c in sorted({c for s, c in rows if s == fixed}):
        spec, plain = rows[(fixed, c)], rows[("off", c)]
        whole = spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        steady = spec["steady_tokens_per_s"] / plain["steady_tokens_per_s"]
        notes = [f"{_x(steady)} steady"] if f"{steady:.2f}" != f"{whole:.2f}" else []
        if c in SPEC_GOALS:
            notes.append(f"goal ≥ {SPEC_GOALS[c]}: {_met(whole >= SPEC_GOALS[c])}")
        cells.append(f"{_x(whole)} at C = {c}" + (f" ({'; '.join(notes)})" if notes else ""))
    return (
        f"MTP width {fixed.split(':')[1]}: {', '.join(cells)}; "
        f"{fam['parameters'] / 1e9:.1f} B parameters, {fam['weights']} weights"
    )


def heldout(doc: dict) -> str:
    return f"{doc['eval_bpb']:.3f} ({_met(doc['eval_bpb'] <= 1.10)})"


def acceptance(doc: dict) -> str:
    mtp = sorted((r for r in doc["results"] if r["drafter"] == "mtp" and r["temperature"] == 0),
                 key=lambda r: r["width"])  # fmt: skip
    greedy = all(
        r.get("equals_plain_greedy")
        for r in doc["results"]
        if r["temperature"] == 0 and r["drafter"] != "none"
    )
    first = mtp[0]
    lengths = " / ".join(f"{r['acceptance_length']:.2f}" for r in mtp)
    return (f"{lengths} at K = {' / '.join(str(r['width']) for r in mtp)} "
            f"({_met(first['width'] == 2 and first['acceptance_length'] >= 1.6)}); every "
            f"drafter's greedy tokens equal plain decoding's: {'yes' if greedy else 'no'}"
            )  # fmt: skip


def cpu_stream(doc: dict) -> str:
    s = doc["summary"]
    spec, plain = s["make run"]["median_tokens_per_s"], s["plain decoding"]["median_tokens_per_s"]
    return (f"{_x(spec / plain)} ({spec:.1f} / {plain:.1f} tok/s, drafter {doc['drafter']}; "
            f"≥ 20 tok/s {_met(spec >= doc['goal_tokens_per_s'])})")  # fmt: skip


def gateway(doc: dict) -> str:
    v = doc["variants"]
    p50 = v["non_stream"]["pooled"]["overhead_ms"]["p50"]
    stream = v["stream"]["pooled"]["overhead_ms"]["p50"]
    return (f"{p50:.2f} ms ({_met(p50 <= 2.0)}), streaming {stream:.2f} ms "
            f"({_met(stream <= 2.0)}); {doc['config']['model']}")  # fmt: skip


def prefix_turns(doc: dict) -> str:
    (cached,) = [v for v in doc["summary"] if v != "no prefix cache"]
    s = doc["summary"][cached]
    share = s["max_later_computed_share"]
    ttft = doc["ttft_with_over_without"]
    return (f"{share:.1%} computed ({_met(share <= doc['goal_computed_share'])}); time to first "
            f"token {_span(ttft)} of the uncached; text equal: "
            f"{'yes' if all(doc['same_text']) else 'no'}")  # fmt: skip


def census(doc: dict) -> str:
    rows = {(r["weights"], r["context"]): r for r in doc["rows"]}
    cells = []
    for ctx in sorted({c for _, c in rows}):
        t, r = rows[("trained", ctx)], rows.get(("random", ctx))
        recall = f"{t['dense_mass_recall']:.2f}" + (f" / {r['dense_mass_recall']:.2f}" if r else "")
        cells.append(f"{ctx // 1024}K: {recall}, {t['hisparse']['host']:.0%} from host")
    return f"k = {doc['rows'][0]['k']}; " + "; ".join(cells)


def slices(doc: dict) -> str:
    ss = list(doc["slices"].values())
    errors = ", ".join(f"{s['family']} {s['injected_logit_error']:.2%}" for s in ss)
    recall = [
        v for s in ss if s["selection_recall_sparse"] for v in s["selection_recall_sparse"].values()
    ]
    overlap = [v for s in ss if s["routing_overlap"] for v in s["routing_overlap"].values()]
    t = doc["totals"]
    return (f"{errors}; uninjected: selection recall {_span(recall, '{:.3f}')}, routing overlap "
            f"{_span(overlap, '{:.3f}')}; tests {t['passed']} passed, {t['failed']} failed"
            )  # fmt: skip


def gpu_tests(doc: dict) -> str:
    t = doc["totals"]
    out = f"{t['passed']} passed, {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped"
    return out + (
        f", {t['collection_errors']} files not collected" if t["collection_errors"] else ""
    )


def defaults(doc: dict) -> str:
    stalls = " / ".join(f"{s:.1f}" if s is not None else "–" for s in doc["stalls_s"])
    pool = doc["kv_pool"]["bytes"]
    return (f"{doc['device']}, {doc['mode']}, CUDA graphs {doc['cuda_graphs']}, drafter "
            f"{doc['drafter']}, KV pool {pool / 2**20:.0f} MiB; text identical after each of "
            f"{doc['kills']} kills: {'yes' if doc['text_identical'] else 'no'}, stalls {stalls} s; "
            f"{doc['tokens_per_s']:.1f} tok/s unkilled")  # fmt: skip


GPU = "on a GPU: `python -m bench device-run {}`"
ROWS: tuple[Row, ...] = (
    Row("resolver: resolve + copy launch / plain gather of the same rows when all hit, CUDA "
        "graphs alternated in lockstep (goal ≤ 1.3×); host recovery / bulk host-to-device copy "
        "in steps of ≥ 4,096 missed rows (goal ≥ 80%)", "resolver.json", resolver,
        f"`python -m bench resolver` ({GPU.format('main')})"),
    Row("MTP speculation ÷ plain decoding in lockstep, DeepSeek-V3.2 at real dimensions, adaptive, "
        "8K context, the shipped model's acceptance forced",
        ("spec_scaled_v32_8k_c1.json", "spec_scaled_v32_8k_c16.json"), spec_scaled,
        "`python -m bench scaled --family v32-scaled --contexts 8192 --concurrency 1` and "
        "`--concurrency 16`, each `--decode-tokens 96 --modes adaptive --spec off,fixed:4 "
        f"--selections replay` ({GPU.format('spec-scaled')})"),
    Row("the shipped model: held-out bits/byte, FP8 weights as shipped (goal ≤ 1.10)",
        "heldout_bpb.json", heldout, "`python -m bench heldout-bpb`"),
    Row("the shipped model: MTP acceptance length, T = 0 (goal ≥ 1.6 at K = 2)",
        "acceptance.json", acceptance,
        "`python -m bench acceptance --prompts 8 --prompt-len 256 --decode-tokens 64`"),
    Row("the shipped model, one CPU stream through `make run`'s stack, 512-token prompt, 128 "
        "new tokens: speculative / plain decoding, end to end (goal ≥ 20 tok/s)",
        "cpu_stream.json", cpu_stream, "`python -m bench cpu-stream`"),
    Row("`make run`'s defaults on the CPU: 120 completions of 32 tokens at once; each served, or "
        "refused with 429 as soon as its expected wait passes its queue deadline (30 s)",
        "burst.json", burst, "`python -m bench burst`"),
    Row("prefix reuse: a conversation's later turns through `make run`'s stack (2K history, 4 "
        "turns), prompt tokens computed (goal ≤ 10%), time to first token with / without",
        "prefix_turns.json", prefix_turns, "`python -m bench prefix-turns`"),
    Row("gateway: overhead per request over a direct gRPC call, p50 (goal ≤ 2 ms)",
        "gateway.json", gateway, "`python -m bench gateway`"),
    Row("the shipped model's selection census, one request: dense attention mass in the top-k, "
        "trained / random weights; rows hisparse reads from host (trained)", "census.json", census,
        "`python -m bench census --contexts 4096,16384`"),
    Row("bf16 engine vs bf16 transformers, 4-layer real-dimension slices, transformers' "
        "choices injected: relative logit error", "slices.json", slices,
        f"`python -m bench slices` ({GPU.format('tests')})"),
    Row("the GPU test suite (every test marked gpu but the slices)", "gpu_tests.json",
        gpu_tests, f"`python -m bench gpu-tests` ({GPU.format('tests')})"),
    Row("`make run`'s defaults (`dhisparse up`, no flags), README's chat example, worker 0 "
        "SIGKILLed mid-stream", "defaults.json", defaults,
        f"`python -m bench defaults` ({GPU.format('main')})"),
)  # fmt: skip


def _measured_at(prov: dict) -> str:
    commit = (prov.get("commit") or "?")[:7] + (" (dirty)" if prov.get("dirty") else "")
    gpu = (prov.get("gpu") or {}).get("name")
    return f"{commit}, {gpu.removeprefix('NVIDIA ') if gpu else 'CPU'}"


def _command(prov: dict) -> str:
    """The result's command without the options that only name output files."""
    argv = shlex.split(prov.get("command") or "")
    if not argv:
        return "–"
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in OUTPUT_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in OUTPUT_OPTIONS)):
            kept.append(a)
    return f"`{shlex.join(kept)}`"


def table(results: Path, rows: tuple[Row, ...] = ROWS, present_only: bool = False) -> str:
    """The markdown table of ``rows`` over the result JSONs in ``results`` (their files,
    nothing below); ``present_only``: only the rows whose JSON is there."""
    lines = list(HEADER)
    for row in rows:
        paths = [results / f for f in row.files]
        if not all(p.is_file() for p in paths):
            if not present_only:
                lines.append(f"| {row.what} | {NOT_MEASURED} | – | {row.measure} |")
            continue
        docs = [json.loads(p.read_text()) for p in paths]
        provs = [d.get("provenance") or {} for d in docs]
        value = row.value(docs) if isinstance(row.file, tuple) else row.value(docs[0])
        at = "; ".join(dict.fromkeys(_measured_at(p) for p in provs))
        command = "; ".join(dict.fromkeys(_command(p) for p in provs))
        lines.append(f"| {row.what} | {value} | {at} | {command} |")
    return "\n".join(lines) + "\n"


def readme_section(text: str) -> str | None:
    """README's text between the marker lines (None: no markers)."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == MARKERS[0])
        end = next(i for i, ln in enumerate(lines) if ln.strip() == MARKERS[1] and i > start)
    except StopIteration:
        return None
    return "".join(lines[start + 1 : end])


def with_table(text: str, new: str) -> str:
    """README's text with the section between the markers replaced by ``new``."""
    old = readme_section(text)
    if old is None:
        raise ValueError(f"no lines {MARKERS[0]!r} ... {MARKERS[1]!r} in {README}")
    head, _, rest = text.partition(MARKERS[0])
    return head + MARKERS[0] + "\n" + new + rest[rest.index(MARKERS[1]) :]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", default=RESULTS, help="where the result JSONs are")
    ap.add_argument("--write-readme", action="store_true", help=f"rewrite {README}'s table")
    ap.add_argument("--readme", default=README, help="the README to rewrite")


def run(args: argparse.Namespace) -> int:
    md = table(ROOT / args.results)
    if not args.write_readme:
        print(md, end="")
        return 0
    readme = ROOT / args.readme
    try:
        readme.write_text(with_table(readme.read_text(), md))
    except ValueError as e:
        print(f"python -m bench ratios: {e}", file=sys.stderr)
        return 2
    print(f"wrote the table ({md.count(chr(10)) - 2} rows) into {readme}")
    return 0
