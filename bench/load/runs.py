"""The runs of one family at one context: its prepared histories and prompts, the lockstep
groups of variants at each C (``run_group``), and what is derived from their rows: eq. 13
beside each speculative run's measured gain, and the run-to-run noise (``derived``)."""

from __future__ import annotations

import json
import time

from bench.core.clock import OwnClock
from bench.core.lockstep import lockstep
from bench.serving.config import Load
from bench.serving.loop import ClosedLoop
from bench.serving.summary import summarize
from bench.spec_control import force
from services.worker.request.request import SamplingParams

from .engines import EngineSizing, Variant, build, check_fits, close
from .history import KEY_TOKENS, HistoryImport, history_tokens, prepared_prompts, random_history
from .replay import Replay, install
from .speculation import compare


class Context:
    """Every run of one family at one context: its histories, prompts and engines."""

    def __init__(self, family: str, model, ctx: int, args, sizing: dict,
                 engine_sizing: EngineSizing, load: Load,
                 replay: Replay | None = None) -> None:  # fmt: skip
        """``args``: the flags (prefixes, page, seed, output and spec width); ``sizing``: the
        pool and host arena (``cli.pool_sizing``), as the JSON records them; ``replay``: the
        selections every engine's decode steps are served (None: the model's own)."""
        self.family, self.model, self.ctx, self.args = family, model, ctx, args
        self.replay = replay
        self.sizing, self.engine_sizing, self.load = sizing, engine_sizing, load
        self.histories: list = []
        self.prompts: list[list[int]] = []
        self.prepare_s: float | None = None

    def prepare(self, kv) -> None:
        """Histories drawn as ``kv``'s codecs store them, one prompt per history."""
        t0 = time.monotonic()
        n = history_tokens(self.ctx, self.args.page)
        self.histories = [random_history(kv, n, seed=self.args.seed * 1000 + i)
                          for i in range(self.args.prefixes)]  # fmt: skip
        self.prompts = prepared_prompts(self.histories, self.ctx, self.model.cfg.vocab_size,
                                        self.args.seed)  # fmt: skip
        self.prepare_s = time.monotonic() - t0

    @property
    def by_key(self) -> dict:
        return {tuple(p[:KEY_TOKENS]): h for p, h in zip(self.prompts, self.histories,
                                                        strict=True)}  # fmt: skip


def run_group(c: Context, variants: list[Variant], cs: list[int], store, out: dict,
              rates, deadline: float | None, noise_c: int | None) -> None:  # fmt: skip
    """``variants`` in lockstep at each C of ``cs``: one engine each, built and warmed first;
    rows appended to ``out['runs']``; with ``noise_c`` that C's point is run twice."""
    check_fits(c.model, c.family, variants, c.engine_sizing)
    built = {}
    try:
        for v in variants:
            eng, info = build(c.model, c.family, v, c.engine_sizing, store)
            if c.replay is not None:
                install(eng, c.replay)  # before any pass: captured graphs hold it
            if not c.histories:
                c.prepare(eng.kv)
            imp = HistoryImport(eng, c.by_key)
            built[v] = (eng, imp)
            out["engines"].append({**info, "context": c.ctx})
        warm = SamplingParams(temperature=0.0, max_tokens=2 * c.args.spec_width + 2,
                              ignore_eos=True)  # fmt: skip
        controls = {}
        for v, (eng, _) in built.items():
            eng.generate(c.prompts[:2], warm)  # kernels compiled, graphs captured
            if v.spec != "off":  # each verify round accepts at the rates (``force``)
                controls[v] = force(eng, rates, seed=c.args.seed)
        points = [(x, 0) for x in cs] + ([(noise_c, 1)] if noise_c in cs else [])
        for conc, repeat in points:
            per = (c.load.duration_s or 0) + c.load.warmup_s
            if deadline is not None and time.monotonic() + per * len(variants) > deadline:
                out["skipped"] += [{"context": c.ctx, "concurrency": conc, "variant": v.name,
                                    "why": "time limit"} for v in variants]  # fmt: skip
                continue
            imported0 = {v: built[v][1].imported for v in variants}
            loops = [ClosedLoop(built[v][0], c.prompts, conc, c.load,
                                f"{v.name}-C{conc}-{repeat}", OwnClock())
                     for v in variants]  # fmt: skip
            lockstep(loops)
            for v, loop in zip(variants, loops, strict=True):
                eng, imp = built[v]
                m = summarize(loop.result(), eng.kv.row_bytes, c.args.page, c.args.output_len)
                tp = (m.get("tpot_s") or {}).get("mean")
                m["per_request_tokens_per_s"] = 1.0 / tp if tp else None
                m["imported"] = imp.imported - imported0[v]
                if v in controls:
                    m["acceptance_control"] = {"kind": "force", "rates": list(rates),
                                               "rounds": controls[v].rounds,
                                               "planned": controls[v].planned}  # fmt: skip
                row = {"name": f"{v.name}@C{conc}/in{c.ctx}", "family": c.family,
                       "context": c.ctx, "mode": v.mode, "spec": v.spec, "concurrency": conc,
                       "repeat": repeat, "metrics": m}  # fmt: skip
                out["runs"].append(row)
                print(
                    json.dumps(
                        {k: row[k] for k in ("name", "repeat")}
                        | {k: m[k] for k in ("sessions_admitted", "output_tokens_per_s")}
                    ),
                    flush=True,
                )
    finally:
        close([eng for eng, _ in built.values()])


def derived(out: dict) -> None:
    """Eq. 13 beside each speculative run's measured gain, and the run-to-run noise."""
    first = {(r["family"], r["context"], r["mode"], r["spec"], r["concurrency"]): r
             for r in out["runs"] if r["repeat"] == 0}  # fmt: skip
    out["speculation"] = []
    for (fam, ctx, mode, spec, conc), r in first.items():
        base = first.get((fam, ctx, mode, "off", conc))
        if spec == "off" or base is None:
            continue
        plan = next(z["plan"] for z in out["sizing"] if (z["family"], z["context"]) == (fam, ctx))
        planned = None if plan is None else plan["mtp_sessions_per_gpu"]
        cmp = compare(r["metrics"], base["metrics"], planned, conc)
        out["speculation"].append({"family": fam, "context": ctx, "mode": mode, "spec": spec,
                                   "concurrency": conc, "eq13": cmp})  # fmt: skip
    out["noise"] = []
    for r in out["runs"]:
        if r["repeat"] != 1:
            continue
        a = first[(r["family"], r["context"], r["mode"], r["spec"], r["concurrency"])]
        x, y = a["metrics"]["output_tokens_per_s"], r["metrics"]["output_tokens_per_s"]
        out["noise"].append({"family": r["family"], "context": r["context"],
                             "variant": r["name"], "first": x, "second": y,
                             "relative_difference": abs(y - x) / x if x else None})  # fmt: skip
