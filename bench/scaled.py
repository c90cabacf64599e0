"""``python -m bench scaled``: the real families at real per-layer dimensions on one GPU —
resident, hisparse and adaptive serving side by side, decode replayed as CUDA graphs.

For each ``--family`` (``dhisparse/family/scaled.py``: DeepSeek-V3.2 with 16 layers and 64
experts, GLM-5.2 with 20 layers and 64 experts; ``v4flash-scaled``, DeepSeek-V4-Flash with its
43 layers and 32 experts) the model is built in place on the GPU with
random weights (``--weights``: FP8 as the released checkpoints, or bf16), then at each
``--contexts`` length and ``--concurrency`` C the three modes' engines run C requests of that
context in lockstep (``bench/core/lockstep.py``), each decoding ``--decode-tokens`` greedily.
Before the timed requests each engine serves the same C requests ``--warmup-runs`` times
(warm-up: kernels compiled; a graph key is captured at its second sighting, so two runs capture
the keys of the admissions' ramp), so the timed ones show the steady state.

Reported per family: weight bytes resident on the GPU (parameters and buffers, and the
allocator's count after the build), build time; per mode, context and C: decode tokens/s (the
aggregate and the median step rate), CUDA-graph replays, captures and eager passes during the
timed requests (steady state: replays > 0, eager = 0), sessions admitted.

DeepSeek-V4 (``V4_SCALED``) is built with FP8 projections and FP8 routed experts (``--weights
fp8``), FP4 routed experts (``--weights fp4``, the released form) or in bf16 (the tensors V4
holds in fp32 stay so) and served with the Triton resolver and sparse attention (the heads' sinks in the kernel), its decode passes replayed as CUDA graphs like the
other families' (a pass completing compressed rows is keyed by how many: a rare key, such as
an HCA row every 128 tokens, runs eagerly at its first sighting). Settings the engine does not
serve V4 with (``engine/v4_check``) are refused before the build, named; ``run_context`` on the
CPU, with the preset shrunk, is the test.

With ``--drafter mtp`` the model is built with its MTP layer and every engine speculates
(``--spec-width``, ``--width-policy``). A random MTP layer's proposals are almost never
accepted, so by default each verify round's acceptance is put under the bench's control
(``bench/spec_control.py``, ``--acceptance``, ``--control``): the MTP layer still runs and
proposes (its cost is real), and ``force`` (the default) makes each round accept a prefix of its
proposals drawn at the shipped model's measured per-position acceptance; ``reference`` instead
replaces the proposals by the target's own greedy continuation (a plain run of the same prompts
in the same mode first) corrupted at those rates, which a random model's flat logits defeat on
the GPU (a flipped last bit leaves the reference, and every later round misses). Rows report
the acceptance length the verifier measured and the control's counters.

``--spec off,fixed:4,paper:8,online:8`` runs plain decoding and MTP speculation side by side
instead (issue 41's table): one engine per mode and variant (``off``: no speculation;
``POLICY:K``: the MTP layer under that width policy up to K; ``POLICY:K+block``: with a
round's greedy draft steps as one CUDA graph, ``GraphConfig.mtp_block``; ``POLICY:K+vocabN``:
with draft steps that score a hot head of N ids, ``model.hot_vocab``, the ids 0 .. N-1 of the
random model, beside the full head's ``POLICY:K``), all in lockstep, each row named
``MODE/VARIANT`` with the width policy's estimates (``widths``). Plain decoding runs on a model
of the same family built without the MTP layer when the device holds both
(``plain_model: own``), else on the speculating engines' model, whose every pass then also
writes the MTP layer's rows (its input fusion and KV projections: ``plain_model: shared``).

A random model's indexer gives consecutive queries almost disjoint selections, so a verify
round of K queries per request reads K times the rows a decode step does, which a trained
model's do not. ``--selections replay`` serves every decode and verify query the shipped model's
recorded selections mapped onto the family (``bench/load/replay.py``): the indexer still runs,
and the hierarchy sees the trained model's step-to-step overlap and reuse."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.capacity.sweep import MODES, Sweep
from bench.core import UsageError
from bench.core.lockstep import lockstep
from bench.load.replay import TRACE, expansion, install, load_traces, replay_for
from bench.round_split import RoundSplit
from bench.spec_control import control, force, shipped_rates
from dhisparse.family.scaled import SCALED, V4_SCALED
from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.heap import GcPauses
from services.worker.engine.v4_check import v4_refusals
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.config import FollowerPrefetch, bytes_per_token
from services.worker.kv.row_codec import KV_CACHE_DTYPES, kv_codecs
from services.worker.kv.workspace import workspace_bytes
from services.worker.model.weight_format import WeightFormat
from services.worker.ops.fp8_linear import MODES as FP8_MODES
from services.worker.request.request import SamplingParams
from services.worker.serving.hierarchy_build import (
    hierarchy_fixed_bytes,
    session_floor_bytes,
    token_ring_bytes,
)
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.width_policy import WIDTH_POLICIES
from services.worker.weights.model_io import build_model

# a hierarchy mode's variant whose IndexShare followers resolve inline at their producer
# (``FollowerPrefetch``), e.g. ``hisparse:inline`` beside ``hisparse``
INLINE = ":inline"
FAMILIES = {**SCALED, **V4_SCALED}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--family", default=",".join(SCALED), help=f"of {', '.join(FAMILIES)}")
    ap.add_argument(
        "--weights", default="fp8", choices=("fp8", "fp4", "bf16"),
        help="fp4: FP8 projections and FP4 routed experts (DeepSeek-V4 only)",
    )  # fmt: skip
    ap.add_argument("--fp8-mode", default="w8a16", choices=FP8_MODES)
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="KV rows and index keys: the serving dtype, or packed fp8 (656 B rows, 132 B keys)",
    )  # fmt: skip
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--warmup-runs", type=int, default=2,
        help="untimed runs of each C's requests first (a graph key is captured at its second "
        "sighting: two runs capture the keys the timed one meets)",
    )  # fmt: skip
    ap.add_argument(
        "--modes", default=",".join(MODES),
        help=f"of {', '.join(MODES)}; a hierarchy mode + '{INLINE}': its followers inline",
    )  # fmt: skip
    ap.add_argument("--hot-cache-rows", type=int, default=4096, help="B (default 2k)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--host-gib", type=float, default=32.0)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs of decode passes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafter", default="none", choices=("none", "mtp"),
                    help="mtp: the family's MTP layer, built in place with the model")  # fmt: skip
    ap.add_argument("--spec-width", type=int, default=4, help="K_max with --drafter mtp")
    ap.add_argument("--width-policy", default="fixed", choices=WIDTH_POLICIES)
    ap.add_argument(
        "--acceptance", default="shipped",
        help="with --drafter mtp: 'shipped' (the shipped model's MTP acceptance by draft "
        "position, docs/results/acceptance.json), rates by position ('0.85,0.75,...'), or "
        "'model' (the random MTP layer's own proposals)",
    )  # fmt: skip
    ap.add_argument(
        "--control", default="force", choices=("force", "reference"),
        help="how --acceptance is imposed: force each verify round's accepted prefix, or "
        "propose a plain run's greedy continuation corrupted at the rates",
    )  # fmt: skip
    ap.add_argument(
        "--spec", default="",
        help="plain decoding and MTP speculation side by side: 'off' and POLICY:K_MAX variants "
        "(e.g. off,fixed:4,paper:8,online:8), each with +block (draft steps as one graph) or "
        "+vocabN (draft steps over a hot head of N ids: fixed:4,fixed:4+vocab32768); replaces "
        "--drafter, --spec-width, --width-policy",
    )  # fmt: skip
    ap.add_argument(
        "--selections", default="random", choices=("random", "replay"),
        help="what decode and verify queries attend: the random model's own top-k (consecutive "
        "queries share little), or the shipped model's recorded selections replayed "
        "(bench/load/replay.py: its step-to-step overlap and reuse)",
    )  # fmt: skip
    ap.add_argument("--trace", default=str(TRACE), help="the traces --selections replay reads")
    ap.add_argument("--out", default="docs/results/scaled.json")


@dataclass(frozen=True)
class SpecVariant:
    """An engine's speculation: ``label`` ('' with no ``--spec``), the drafter (None: plain
    decoding), K_max and the width policy."""

    label: str
    drafter: str | None
    width: int
    policy: str
    mtp_block: bool = False  # a round's greedy draft steps as one CUDA graph
    # the MTP layer's draft steps score the ids 0 .. N-1 only (``model.hot_vocab``: a random
    # model's ids have no frequencies, so what is timed is a head of N rows, not acceptance)
    draft_vocab: int | None = None


VOCAB = "vocab"  # a variant's suffix: +vocabN, the MTP draft steps' hot head of N ids


def _variant(item: str) -> SpecVariant:
    """``POLICY:K`` with suffixes ``+block`` and ``+vocabN``; raises UsageError on others."""
    spec, *suffixes = item.split("+")
    policy, _, k = spec.partition(":")
    ok = policy in WIDTH_POLICIES and k.isdigit() and int(k) >= 2
    block, hot = False, None
    for suffix in suffixes:
        n = suffix.removeprefix(VOCAB)
        if suffix == "block" and not block:
            block = True
        elif n != suffix and n.isdigit() and int(n) >= 1 and hot is None:
            hot = int(n)
        else:
            ok = False
    if not ok:
        raise UsageError(
            f"--spec takes off and POLICY:K[+block][+vocabN] (POLICY of "
            f"{', '.join(WIDTH_POLICIES)}, K >= 2, N >= 1), got {item!r}"
        )
    return SpecVariant(item, "mtp", int(k), policy, block, hot)


def spec_variants(args: argparse.Namespace) -> list[SpecVariant]:
    """``--spec``'s variants, or the one ``--drafter`` names; raises UsageError on bad ones.
    With ``--spec`` speculating, ``args.drafter`` becomes ``mtp`` and ``args.spec_width`` the
    widest K_max (the acceptance control's rates cover it)."""
    if not args.spec:
        drafter = None if args.drafter == "none" else args.drafter
        return [SpecVariant("", drafter, args.spec_width, args.width_policy)]
    out = []
    for item in (v for v in args.spec.split(",") if v):
        out.append(SpecVariant("off", None, 1, "fixed") if item == "off" else _variant(item))
    if not out or len({v.label for v in out}) < len(out):
        raise UsageError(f"--spec needs distinct variants, got {args.spec!r}")
    if any(v.drafter for v in out):
        args.drafter = "mtp"
        args.spec_width = max(v.width for v in out)
    return out


def parse(args: argparse.Namespace) -> tuple[list[str], list[int], list[int], list[str]]:
    """(families, contexts, concurrencies, modes); raises UsageError on unknown or bad ones."""
    fams = [f for f in args.family.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES]
    if bad or not fams:
        raise UsageError(f"unknown --family {bad}; known: {', '.join(FAMILIES)}")
    modes = [m for m in args.modes.split(",") if m]
    known = {*MODES, *(f"{m}{INLINE}" for m in MODES if m != "resident")}
    if not modes or set(modes) - known:
        raise UsageError(f"--modes takes {', '.join(sorted(known))}, got {args.modes!r}")
    try:
        ctxs = [int(v) for v in args.contexts.split(",") if v]
        cs = [int(v) for v in args.concurrency.split(",") if v]
    except ValueError as e:
        raise UsageError(f"--contexts and --concurrency take integers: {e}") from None
    if not ctxs or not cs or min(ctxs + cs) < 1:
        raise UsageError("--contexts and --concurrency take positive integers")
    return fams, ctxs, cs, modes


def v4_refused(args: argparse.Namespace, device: str) -> list[str]:
    """What a DeepSeek-V4 family is not run with on ``device`` as ``args`` ask (empty: it
    runs): replayed selections (mapped onto MLA index producers; an HCA layer attends every
    row it sees), then every setting the engine does not serve V4 with (``v4_refusals`` of
    the engines' configuration)."""
    out = []
    if args.selections != "random":
        out.append(f"--selections {args.selections}")
    probe = EngineConfig(
        model="v4", device=device, kv_cache_dtype=args.kv_cache_dtype,
        speculation=SpeculationConfig("mtp" if args.drafter != "none" else None),
    )  # fmt: skip
    return out + v4_refusals(probe)


def acceptance_rates(args: argparse.Namespace) -> tuple[float, ...] | None:
    """The acceptance control's rates by draft position (None: no control); raises
    UsageError on bad ones."""
    if args.drafter == "none" or args.acceptance == "model":
        return None
    if args.spec_width < 2:
        raise UsageError("--spec-width: a verify round needs an anchor and a proposal (>= 2)")
    if args.acceptance == "shipped":
        rates = shipped_rates()
    else:
        try:
            rates = tuple(float(v) for v in args.acceptance.split(","))
        except ValueError:
            raise UsageError(
                f"--acceptance takes shipped, model or rates, not {args.acceptance!r}"
            ) from None
    if len(rates) < args.spec_width - 1 or not all(0.0 <= c <= 1.0 for c in rates):
        raise UsageError(
            f"--acceptance: {args.spec_width - 1} rates in [0, 1] are needed, got {rates}"
        )
    return rates


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's tensors on the device, by dtype."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def _engine(
    name: str, model, variant: str, ctx: int, c_max: int, args, spec: SpecVariant | None = None
) -> Engine:
    """One mode's engine on the model's device; its KV pool holds ``c_max`` resident sessions
    of the context (a hierarchy mode's: ``c_max`` of its own where those take more, at
    contexts shorter than a hot cache's rows per source). ``variant``: the mode, with
    ``INLINE`` for followers resolved inline;
    ``spec``: its speculation (None: plain decoding)."""
    mode = variant.removesuffix(INLINE)
    device = next(model.parameters()).device.type
    dtype = model.dtype
    codecs = kv_codecs(model.cfg, args.kv_cache_dtype, dtype)
    per_token = bytes_per_token(
        model.cfg, dtype.itemsize, True, codecs.rows.row_bytes, codecs.keys.row_bytes
    )
    tokens = ctx + args.decode_tokens + 16
    common = dict(
        model=name, device=device, dtype=str(dtype).removeprefix("torch."), mode=mode,
        page_size=args.page,
        max_num_seqs=c_max, max_model_len=tokens, max_prefill_tokens=args.max_prefill_tokens,
        hot_cache_rows=args.hot_cache_rows,
        host_arena_mib=args.host_gib * 1024,
        graphs=GraphConfig(not args.eager, mtp_block=spec is not None and spec.mtp_block),
        kv_cache_dtype=args.kv_cache_dtype,
        followers=FollowerPrefetch(overlap=not variant.endswith(INLINE)),
        speculation=SpeculationConfig(
            *((spec.drafter, spec.width, spec.policy) if spec else (None, 1, "fixed")),
            draft_vocab_size=spec.draft_vocab if spec else None,
        ),
    )  # fmt: skip
    # the pool's fixed parts and a session's floor do not depend on the pool's size
    kv_cfg = EngineConfig(kv_pool_mib=0, **common).kv_config(dtype)
    session = tokens * per_token
    if mode != "resident":  # B rows and a tail per source, and the index keys' pages
        keys = bytes_per_token(model.cfg, dtype.itemsize, False, key_bytes=codecs.keys.row_bytes)
        pages = len(model.cfg.key_producers) * args.page * codecs.keys.row_bytes
        session = max(session, session_floor_bytes(model.cfg, kv_cfg) + tokens * keys + pages)
    budget = c_max * session * 1.02
    fixed = workspace_bytes(model.cfg, kv_cfg)  # as bench capacity sizes its pools
    if mode != "resident":
        fixed += hierarchy_fixed_bytes(model.cfg, kv_cfg)
    else:  # a windowed model's rings (DeepSeek-V4's), which the hierarchy's count too
        fixed += token_ring_bytes(model.cfg, kv_cfg)
    cfg = EngineConfig(kv_pool_mib=(budget + fixed) / 2**20, **common)
    return Engine(cfg, model=model, tokenizer=ByteTokenizer())


def _graph_counts(engine: Engine) -> dict[str, int]:
    g = engine.passes.graphs
    if g is None:
        return {"replays": 0, "captures": 0, "eager": 0}
    return {"replays": g.replays, "captures": g.captures, "eager": g.eager}


def _spec_counts(engine: Engine) -> tuple[int, int]:
    """(verify rounds, proposals accepted) so far; (0, 0) without speculation."""
    spec = engine.speculator
    return (0, 0) if spec is None else (spec.counters.drafts, spec.counters.accepted)


def run_context(
    name: str,
    models: dict[bool, torch.nn.Module],
    ctx: int,
    cs: list[int],
    modes: list[str],
    variants: list[SpecVariant],
    args,
) -> list[dict]:
    """Every mode and speculation variant at one context: engines built (on ``models[True]``
    when speculating, else ``models[False]``), warmed with each C's requests, then each C
    timed in lockstep (on the model's device: a CPU run is the smoke test)."""
    model = models[any(v.drafter for v in variants)]
    vocab = model.family.vocab_size
    g = torch.Generator().manual_seed(args.seed + ctx)
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(max(cs))]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    rates = acceptance_rates(args)
    # per mode, the target's greedy continuations, from a plain run in that mode first (alone):
    # a random model's logits are nearly flat, so another mode's last bits could flip a token
    refs: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for m in modes if rates is not None and args.control == "reference" else ():
        plain = _engine(name, model, m, ctx, max(cs), args)
        outs = plain.generate(prompts, params)
        plain.close()
        refs[m] = {tuple(p): [*p, *o.output_ids] for p, o in zip(prompts, outs, strict=True)}
    engines = {
        f"{m}/{v.label}" if v.label else m: _engine(
            name, models[v.drafter is not None], m, ctx, max(cs), args, v
        )
        for m in modes
        for v in variants
    }
    replayed = None
    if args.selections == "replay":
        replay = replay_for(model, ctx, load_traces(Path(args.trace)))
        for e in engines.values():
            install(e, replay)  # before any pass: captured graphs hold it
        t = replay.trace
        replayed = {"trace": t.source, "trace_context": t.context, "trace_steps": t.steps,
                    "expansion": expansion(model.cfg.index_topk, t), "spread": replay.spread}  # fmt: skip
    controls = {}
    if rates is not None:
        controls = {
            m: force(e, rates, seed=args.seed)
            if args.control == "force"
            else control(e, refs[m.split("/")[0]], rates, seed=args.seed)
            for m, e in engines.items()
            if e.speculator is not None
        }
    splits = {m: RoundSplit(e) for m, e in engines.items() if e.speculator is not None}
    device = next(model.parameters()).device.type
    sweep_args = SimpleNamespace(decode_tokens=args.decode_tokens, trace=False, device=device)
    rows = []
    pauses = GcPauses()
    for c in cs:
        for _ in range(args.warmup_runs):  # warm-up: the same shapes as the timed requests
            for engine in engines.values():
                engine.generate(prompts[:c], params)
        before = {m: _graph_counts(e) for m, e in engines.items()}
        spec0 = {m: _spec_counts(e) for m, e in engines.items()}
        for split in splits.values():
            split.reset()
        sweeps = [Sweep(e, m, c, sweep_args, prompts, pauses) for m, e in engines.items()]
        lockstep(sweeps)
        for sw in sweeps:
            row = sw.row()
            after = _graph_counts(sw.engine)
            row["graphs"] = {k: after[k] - before[sw.mode][k] for k in after}
            if sw.engine.speculator is not None:
                (d0, a0), (d1, a1) = spec0[sw.mode], _spec_counts(sw.engine)
                row["acceptance_length"] = 1.0 + (a1 - a0) / max(d1 - d0, 1)
                row["width_in_use"] = sw.engine.speculator.counters.width
                row["widths"] = sw.engine.speculator.widths.estimates()
                row["round_split"] = splits[sw.mode].row()
                if rates is not None:
                    ctl = controls[sw.mode]
                    row["acceptance_control"] = {
                        "kind": args.control, "rates": list(rates), "rounds": ctl.rounds,
                        "planned": ctl.planned, "misses": ctl.misses,
                    }  # fmt: skip
            row["graphs_off_reason"] = sw.engine.graphs_off_reason
            row["context"] = ctx
            row["selections"] = replayed or "random"
            rows.append(row)
            print(json.dumps({k: row[k] for k in (
                "mode", "context", "concurrency", "decode_tokens_per_s",
                "decode_tokens_per_s_median", "steady_tokens_per_s", "graphs", "sessions_admitted",
            )}), flush=True)  # fmt: skip
    pauses.close()
    for engine in engines.values():
        engine.close()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _build(name: str, args, fmt: WeightFormat, mtp: bool) -> torch.nn.Module:
    return build_model(FAMILIES[name], seed=args.seed, device="cuda", dtype=torch.bfloat16,
                       weights=fmt, in_place=True, mtp=mtp)  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    fams, ctxs, cs, modes = parse(args)
    variants = spec_variants(args)
    acceptance_rates(args)  # bad rates are refused before the build
    if not torch.cuda.is_available():
        raise UsageError("bench scaled runs on a CUDA GPU (real-dimension models of 40+ GB)")
    for name in (f for f in fams if f in V4_SCALED):  # before any build
        refused = v4_refused(args, "cuda")
        if refused:
            raise UsageError(f"{name}: DeepSeek-V4 is not run with {', '.join(refused)}")
    if args.weights == "fp4" and any(f not in V4_SCALED for f in fams):
        raise UsageError("--weights fp4 (FP4 routed experts) is for DeepSeek-V4 only")
    fmt = WeightFormat(
        fp8=args.weights != "bf16", mode=args.fp8_mode, fp4_experts=args.weights == "fp4"
    )
    families = []
    speculating = any(v.drafter for v in variants)
    for name in fams:
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = _build(name, args, fmt, speculating)
        torch.cuda.synchronize()
        built_s = time.perf_counter() - t0
        wb = weight_bytes(model)
        models = {speculating: model}
        plain_model = None
        if speculating and any(v.drafter is None for v in variants):
            # the plain engines' own model when it fits beside the first and the engines' pools
            # (a third of the device left), else the speculating one's
            free, total = torch.cuda.mem_get_info()
            own = free - sum(wb.values()) > total / 3
            models[False] = _build(name, args, fmt, False) if own else model
            plain_model = "own" if own else "shared"
        params = sum(p.numel() for p in model.parameters()) + sum(
            b.numel() * (2 if b.dtype == torch.uint8 else 1)  # packed FP4: two per byte
            for b in model.buffers() if b.dtype in (torch.float8_e4m3fn, torch.uint8)
        )  # fmt: skip
        fam = {
            "family": name,
            "config": FAMILIES[name].config,
            "weights": args.weights,
            "fp8_mode": args.fp8_mode if fmt.fp8 else None,
            "kv_cache_dtype": args.kv_cache_dtype,
            "parameters": params,
            "weight_bytes": wb,
            "weight_bytes_total": sum(wb.values()),
            "allocated_after_build": torch.cuda.memory_allocated(),
            "build_s": built_s,
            "plain_model": plain_model,
            "rows": [],
        }
        print(json.dumps({k: fam[k] for k in ("family", "weight_bytes", "build_s")}), flush=True)
        for ctx in ctxs:
            fam["rows"] += run_context(name, models, ctx, cs, modes, variants, args)
        families.append(fam)
        del model, models
        torch.cuda.empty_cache()
    return {
        "benchmark": "scaled",
        "machine": torch.cuda.get_device_name(),
        "decode_tokens": args.decode_tokens,
        "warmup_runs": args.warmup_runs,
        "hot_cache_rows": args.hot_cache_rows,
        "drafter": args.drafter,
        "spec_width": args.spec_width if args.drafter != "none" else None,
        "width_policy": args.width_policy if args.drafter != "none" else None,
        "spec": [v.label for v in variants] if args.spec else None,
        "selections": args.selections,
        "families": families,
    }
