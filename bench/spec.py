"""Speculative decoding over the hierarchy (issue 6): acceptance length and decode tokens/s per
drafter and width policy vs concurrency, against no speculation.

    python -m bench spec --out docs/results/spec.json --plot docs/results/spec.png

Target: ``--model`` (default the shipped ``models/glm-dsa-mini``) in ``adaptive`` mode with the
drafters in ``--drafters`` (default MODEL/drafters; ``mtp+block``: the MTP layer with a round's
greedy draft steps as one CUDA graph); prompts are windows of the corpus's
held-out files. With ``--model tiny-indexshare --drafter-dir bench/drafters/tiny-indexshare``
it runs the random target with drafters trained on its own greedy text, prompts being its
greedy continuations.
For each concurrency C, C clients each keep one request of ``--decode-tokens`` greedy tokens
in flight, replacing it when it finishes (closed loop, ``--requests-per-client`` each); every
configuration first runs one request per client on the same engine (warm kernels, and the
online policy has measured its widths). Every configuration's engine exists at once and, at
each C, they all run in lockstep (``bench/core/lockstep.py``): the host's slow phases fall on all
of them alike.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path

import torch

from bench.acceptance import drafter_arg
from bench.core import UsageError
from bench.core.clock import OwnClock
from bench.core.lockstep import lockstep
from bench.core.output import write_result
from bench.core.plots import pyplot, save
from bench.core.progress import progress
from bench.round_split import RoundSplit
from bench.serving.config import Load
from bench.serving.loop import ClosedLoop
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig

DRAFTERS = ("mtp", "dflash2")  # the shipped model's; mtp: its own MTP layer
# the MTP layer with a round's greedy draft steps as one CUDA graph (``GraphConfig.mtp_block``)
MTP_BLOCK = "mtp+block"
_IDS = itertools.count()


def config(args, drafter: str | None, policy: str, width: int) -> EngineConfig:
    block = drafter == MTP_BLOCK
    drafter = "mtp" if block else drafter
    return EngineConfig(
        model=args.model, device=args.device, mode=args.mode, kv_pool_mib=args.pool_mib,
        host_arena_mib=args.host_mib, max_num_seqs=max(args.concurrency), max_model_len=1024,
        max_prefill_tokens=8192, page_size=16, graphs=GraphConfig(mtp_block=block),
        speculation=SpeculationConfig(
            drafter_arg(args.drafter_dir, drafter), width, policy
        ),
    )  # fmt: skip


def make_prompts(args, n: int) -> list[list[int]]:
    """Text windows of the drafters' corpus (other offsets than training drew), continued by
    the target's greedy decoding: the distribution the drafters were trained to predict."""
    from training.drafter.data import corpus_tokens

    if Path(args.model).is_dir():  # a trained target: held-out text is in distribution
        from bench.heldout import heldout_prompts

        return heldout_prompts(args.model, n, args.prompt_len, 12345)
    eng = Engine(config(args, None, "fixed", 1))
    stream = corpus_tokens(None)
    g = torch.Generator().manual_seed(12345)
    offsets = torch.randint(0, len(stream) - 32, (n,), generator=g).tolist()
    seeds = [stream[o : o + 32].tolist() for o in offsets]
    params = SamplingParams(temperature=0.0, max_tokens=args.prompt_len - 32, ignore_eos=True)
    out = [s + r.output_ids for s, r in zip(seeds, eng.generate(seeds, params), strict=True)]
    eng.close()
    return out


def closed_loop(eng: Engine, prompts: list[list[int]], args, per_client: int) -> ClosedLoop:
    """The serving benchmark's closed loop on one engine: each of C = len(prompts) clients
    keeps one request of ``--decode-tokens`` tokens in flight and replaces it the moment it
    finishes, until it has sent ``per_client``. Stepped by ``lockstep`` beside the other
    configurations, on its own clock."""
    load = Load(output_len=args.decode_tokens, requests_per_client=per_client, duration_s=None)
    return ClosedLoop(eng, prompts, len(prompts), load, f"spec-{next(_IDS)}", OwnClock())


def measured(loop: ClosedLoop) -> dict:
    """The decode rate over the steps while some client still had a request to send: the
    batch stays full, as in serving. (Measured open loop, speculation looked worse than it
    is: requests that drew short acceptances finish rounds after the others, and those last
    rounds ran in a small batch.) And the acceptance length over the whole run."""
    res = loop.result()
    window = [s for s in res.steps if s.sending]
    seconds = sum(s.decode_s for s in window)
    row = {
        "decode_tokens_per_s": sum(s.decode_tokens for s in window) / max(seconds, 1e-9),
        "acceptance_length": 1.0,
    }
    if res.start.spec is not None and res.end.spec is not None:
        drafts = res.end.spec[0] - res.start.spec[0]
        accepted = res.end.spec[2] - res.start.spec[2]
        row["acceptance_length"] = 1.0 + accepted / max(drafts, 1)
        row["width_in_use"] = loop.eng.speculator.counters.width
        row["widths"] = loop.eng.speculator.widths.estimates()
    return row


def add_loop_arguments(ap: argparse.ArgumentParser, concurrency: str) -> None:
    """The target, drafters, prompts, pools and closed loop (this benchmark's and
    ``python -m bench graph-keys``'s)."""
    ap.add_argument("--model", default="models/glm-dsa-mini")
    ap.add_argument("--drafter-dir", default=None, help="default: MODEL/drafters")
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--requests-per-client", type=int, default=3, help="closed loop, measured")
    ap.add_argument(
        "--warmup-per-client", type=int, default=1,
        help="closed loop before the measured one, per client: with 2 or more, requests end "
        "at different rounds there too, so the batch sizes the measured loop meets have their "
        "CUDA graphs captured already, as in long serving",
    )  # fmt: skip
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--mode", default="adaptive")
    ap.add_argument("--pool-mib", type=float, default=512)
    ap.add_argument("--host-mib", type=float, default=512)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_loop_arguments(ap, "1,4,16,64")
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--out", default="docs/results/spec.json")
    ap.add_argument("--plot", default=None)


def run(args: argparse.Namespace) -> int:
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if args.requests_per_client < 2:  # the window is the steps while clients still send
        raise UsageError("--requests-per-client must be at least 2: the rate counts the steps "
                         "while every client still has a request to send, and with 1 there "
                         "are none")  # fmt: skip
    args.drafter_dir = args.drafter_dir or str(Path(args.model) / "drafters")
    widths = [int(x) for x in args.widths.split(",") if x]  # "": no fixed-width configs
    prompts = make_prompts(args, max(args.concurrency))
    configs = [("none", None, "fixed", 1)]
    for d in args.drafters.split(","):
        configs += [(f"{d}/K={w}", d, "fixed", w) for w in widths]
        configs += [(f"{d}/paper", d, "paper", 8), (f"{d}/online", d, "online", 8)]
    engines = {name: Engine(config(args, d, policy, w)) for name, d, policy, w in configs}
    splits = {n: RoundSplit(e) for n, e in engines.items() if e.speculator is not None}
    results = []
    for c in progress(args.concurrency, "concurrency"):
        # warm-up (kernels, and the online policy's measurements), then the measured loops
        warm = args.warmup_per_client
        lockstep([closed_loop(eng, prompts[:c], args, warm) for eng in engines.values()])
        loops = {name: closed_loop(eng, prompts[:c], args, args.requests_per_client)
                 for name, eng in engines.items()}  # fmt: skip
        before = {name: graph_counts(eng) for name, eng in engines.items()}
        for split in splits.values():
            split.reset()
        lockstep(list(loops.values()))
        for name, loop in loops.items():
            row = {"config": name, "concurrency": c, **measured(loop)}
            if name in splits:  # the measured loops' rounds: drafting apart from the rest
                row["round_split"] = splits[name].row()
            after = graph_counts(loop.eng)  # passes captured, replayed, run eagerly meanwhile
            row.update({k: v - before[name][k] for k, v in after.items()})
            results.append(row)
            print(json.dumps(row), flush=True)
    for eng in engines.values():
        eng.close()
    summary = summarize(results, args)
    out = {
        "benchmark": "spec",
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "target": args.model,
        "mode": args.mode,
        "decode_tokens": args.decode_tokens,
        "results": results,
        "summary": summary,
    }
    print(f"wrote {write_result(out, args.out)}")
    print(json.dumps(summary, indent=2))
    if args.plot:
        plot(out, args.plot)
    return 0


def graph_counts(eng: Engine) -> dict[str, int]:
    """CUDA graph counters of the engine's passes and its drafter's block passes (none off the
    GPU): a short run pays for every capture, which long serving spreads thin."""
    out = {}
    for kind, graphs in (
        ("pass", eng.passes.graphs),
        ("draft", getattr(eng.speculator, "graphs", None)),
    ):
        if graphs is not None:
            for what in ("captures", "replays", "eager"):
                out[f"{kind}_graph_{what}"] = getattr(graphs, what)
    return out


def summarize(results: list[dict], args) -> dict:
    """Online policy vs no speculation and vs the paper's schedule, per drafter and C."""
    tps = {(r["config"], r["concurrency"]): r["decode_tokens_per_s"] for r in results}
    out = {}
    for d in args.drafters.split(","):
        for c in args.concurrency:
            online = tps[(f"{d}/online", c)]
            none, paper = tps[("none", c)], tps[(f"{d}/paper", c)]
            out[f"{d}@C{c}"] = {
                "paper_over_none": paper / none,
                "online_over_none": online / none,
                "online_over_paper": online / paper,
                # the strict reading: within 3% of the better of the two
                "within_3pct_of_the_better": online >= 0.97 * max(none, paper),
                # the words: never below both by more than 3%
                "not_3pct_below_both": online >= 0.97 * min(none, paper),
            }
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    configs = sorted({r["config"] for r in out["results"]})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for cfg in configs:
        rs = [r for r in out["results"] if r["config"] == cfg]
        cs = [r["concurrency"] for r in rs]
        style = "k--" if cfg == "none" else "o-"
        a1.plot(cs, [r["decode_tokens_per_s"] for r in rs], style, label=cfg)
        if cfg != "none":
            a2.plot(cs, [r["acceptance_length"] for r in rs], "o-", label=cfg)
    a1.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="decode tokens/s",
           title=f"speculative decoding, {out['mode']} mode ({out['machine']})")  # fmt: skip
    a2.set(xscale="log", xlabel="concurrency", ylabel="acceptance length (1 + accepted/drafts)")
    a1.legend(fontsize=7, ncol=2)
    a2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save(fig, path)
