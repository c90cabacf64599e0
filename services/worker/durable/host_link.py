"""The worker process's registration with the node's host store: its generation, the lease it
renews from a background thread, and what it does when the store goes away. Each rank of a
data-parallel-attention group holds one of its own (its own owner id, generation and renewing
thread); a tensor-parallel group holds one, rank 0's.

States: ``ok``; ``down`` (the store does not answer: admissions fail fast, running requests go
on — their bytes are in this process's mapping of the arena); ``restarted`` (a store answers
but it is a new process with a new arena); ``superseded`` (the store refused this generation: a
newer process registered this worker id, so this one must not touch its sessions again). A
restarted store is re-attached between engine steps once no request holds regions of the old
arena: map the new arena, register a new generation. The worker reports unhealthy while not
``ok``, so the gateway routes nothing here.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from services.kv_host_store.errors import StoreError
from services.worker.kv.errors import describe

if TYPE_CHECKING:
    from services.kv_host_store.client import KVHostStoreClient
    from services.worker.hierarchy.host_backup import HostBackups
    from services.worker.hierarchy.local_store import LocalHostStore

log = logging.getLogger(__name__)


class HostLink:
    def __init__(
        self,
        client: KVHostStoreClient | LocalHostStore,
        owner: str,
        lease_ttl_s: float,
        backups: HostBackups,
        salt: str = "",
    ) -> None:
        """``client``: a ``KVHostStoreClient`` (or ``LocalHostStore``); ``backups``: the
        engine's ``HostBackups``, whose generation follows this registration; ``salt``: how
        the engine computes rows (registered: a peer adopts only with an equal one)."""
        self.client = client
        self.owner = owner
        self.ttl_s = lease_ttl_s
        self.backups = backups
        self.salt = salt
        self.generation = 0
        self.store_id = ""
        self.state = "down"
        self.problem = "not registered yet"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def healthy(self) -> bool:
        return self.state == "ok"

    def status(self) -> str:
        return "ok" if self.healthy else f"host KV store unavailable ({self.state}): {self.problem}"

    def register(self) -> int:
        """Registers a new generation (fencing off every earlier process of this worker id);
        returns it. Raises what the client raises."""
        self.store_id = self.client.get_arena().store_id
        lease = self.client.register_owner(self.owner, self.ttl_s, self.salt)
        self.generation = lease.generation
        self.backups.who.generation = lease.generation
        self.state, self.problem = "ok", ""
        log.info("registered with the host store as %s generation %d", self.owner, self.generation)
        return self.generation

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="host-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.check()

    def check(self) -> None:
        """Renews the lease and notices a store that went away or came back as a new one."""
        try:
            arena = self.client.get_arena()
            if arena.store_id != self.store_id:
                self._lost("restarted", f"the store restarted (arena {arena.store_id})")
                return
            if self.state == "superseded":
                return
            self.client.renew_owner(self.owner, self.generation)
            if self.state != "ok":
                log.info("host store link ok again")
                self.state, self.problem = "ok", ""
        except StoreError as e:  # it answers, but not for this generation any more
            self._lost("superseded", str(e))
        except Exception as e:  # transport: down, or hung past the client's timeout
            self._lost("down", describe(e))

    def _lost(self, state: str, problem: str) -> None:
        if state != self.state:
            log.warning("host store link %s: %s", state, problem)
        self.state, self.problem = state, problem

    def maintain(self, in_group: bool) -> None:
        """Between engine steps (engine thread): re-attaches to a restarted store once nothing
        holds regions of the old arena. A group of ranks (``in_group``) does not: each rank holds
        its own mapping of the arena, and rank 0 alone remapping would write where the others no
        longer read (TP), or the ranks would remap at different steps with different generations
        (data-parallel attention, each rank its own owner); the group goes on in the old arena,
        unhealthy, for its supervisor (Kubernetes, ``up``) to restart it onto the new one."""
        if self.state != "restarted" or self.backups.slots:
            return
        if in_group:
            self.problem = "the store restarted under a group of ranks: restart the worker"
            return
        try:
            info, mapping = self.client.map_arena()
            self.backups.remap(mapping, 0)
            self.register()
        except Exception as e:  # try again on a later step
            self._lost("restarted", f"re-attaching failed: {describe(e)}")
            return
        log.info("re-attached to the restarted host store (arena %s)", info.path)

    def close(self, release: bool = True) -> None:
        """Stops renewing; with ``release``, ends this generation at the store (a graceful
        shutdown: whatever it still holds becomes adoptable at once) once every durable mark
        queued so far reached it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if release and self.state == "ok":
            try:
                self.backups.flush()
                self.client.release_owner(self.owner, self.generation)
            except Exception as e:
                log.warning("could not release generation %d: %s", self.generation, e)
