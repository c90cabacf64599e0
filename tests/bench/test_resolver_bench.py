"""``python -m bench resolver`` times the resolve and the plain gather it is compared with in
the same rounds: one timed run of each per round, the first rotating, each after its own setup
(the GPU run itself is a device command; here the device clock is a stand-in)."""

from __future__ import annotations

from bench import resolver


def test_every_round_runs_each_piece_once_in_turn(monkeypatch) -> None:
    runs: list[str] = []

    def fake_ms(fn, iters, setup=None) -> list[float]:
        assert iters == 1
        out = []
        for i in range(iters + 1):  # an untimed run, then the timed one
            if setup:
                setup()
            fn()
            if i:
                out.append(float(len(runs)))
        return out

    monkeypatch.setattr(resolver, "cuda_ms", fake_ms)
    work = {
        name: (lambda name=name: runs.append(name), setup)
        for name, setup in (("resolve", lambda: runs.append("restore")), ("copy", None),
                            ("total", lambda: runs.append("restore")), ("gather", None))
    }  # fmt: skip
    times = resolver.in_lockstep(work, 4)
    assert {name: len(v) for name, v in times.items()} == dict.fromkeys(work, 4)
    timed = [r for r in runs if r != "restore"][1::2]  # every second run is the timed one
    order = ["resolve", "copy", "total", "gather"]
    assert timed == [name for r in range(4) for name in order[r:] + order[:r]]
    # a resolve always starts from a restored hot cache
    assert all(runs[i - 1] == "restore" for i, r in enumerate(runs) if r in ("resolve", "total"))
