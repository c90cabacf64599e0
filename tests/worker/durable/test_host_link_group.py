"""A restarted host store under a group of ranks: rank 0 does not re-attach alone (the other
ranks read their own mapping of the old arena); it stays unhealthy, naming why, so that the
group's supervisor restarts every rank onto the new arena. A single process re-attaches."""

from __future__ import annotations

from types import SimpleNamespace

from services.worker.durable.host_link import HostLink


class Store:
    """The client surface ``maintain`` uses, recording what it was asked."""

    def __init__(self) -> None:
        self.mapped = 0

    def map_arena(self):
        self.mapped += 1
        return SimpleNamespace(path="/dev/shm/new"), object()


class Backups:
    def __init__(self) -> None:
        self.slots: dict = {}  # no request holds regions of the old arena
        self.remapped: list = []

    def remap(self, mapping, offset: int) -> None:
        self.remapped.append(mapping)


def _restarted_link(store: Store, backups: Backups) -> HostLink:
    link = HostLink(store, "w0", 30.0, backups)
    link.state, link.problem = "restarted", "a new store process"
    return link


def test_a_group_stays_on_the_old_arena_and_reports_why() -> None:
    store, backups = Store(), Backups()
    link = _restarted_link(store, backups)
    link.maintain(in_group=True)
    assert store.mapped == 0 and backups.remapped == []
    assert not link.healthy and "group of ranks" in link.status()


def test_a_single_process_re_attaches(monkeypatch) -> None:
    store, backups = Store(), Backups()
    link = _restarted_link(store, backups)
    registered = []
    monkeypatch.setattr(link, "register", lambda: registered.append(1) or 1)
    link.maintain(in_group=False)
    assert store.mapped == 1 and len(backups.remapped) == 1 and registered == [1]
