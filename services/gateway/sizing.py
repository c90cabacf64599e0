"""Bytes a request needs on a worker, from the capacity model (DESIGN §6): the worker's model
config (``ModelInfo.config_json``) becomes a ``Profile``, its serving mode picks resident or
hierarchy accounting, and the session is sized for its whole budget (prompt + max tokens), so
that an admitted request can always run to its end.

The worker reports its KV geometry (``ModelInfo.kv_layout_json``: element size, its
``kv_cache_dtype`` and stored row and index-key bytes, page size, hot cache and tail rows,
index keys per page); an older worker that does not is sized with the capacity model's defaults,
overridable here (page size, B = 2k, one tail page).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache

from dhisparse.capacity import Mode, Profile, profile_from_model_config, required_bytes
from dhisparse.capacity.model import shared_prefix_bytes
from dhisparse.family.config import ModelConfig
from services.gateway.routing import WorkerStatus

log = logging.getLogger(__name__)

# Worker modes that serve through the KV hierarchy (hot cache + tail on the GPU).
HIERARCHY_MODES = frozenset({"hisparse", "adaptive"})


def capacity_mode(worker_mode: str) -> Mode:
    return "hierarchy" if worker_mode in HIERARCHY_MODES else "resident"


class SessionSizer:
    def __init__(self, page_size: int = 16, hot_cache_rows: int | None = None) -> None:
        self.page_size = page_size
        self.hot_cache_rows = hot_cache_rows
        self._profile = lru_cache(maxsize=16)(self._build_profile)
        self._shared = lru_cache(maxsize=256)(self._shared_bytes)
        self._unusable: set[str] = set()

    def _build_profile(self, config_json: str, layout_json: str = "") -> Profile:
        cfg = ModelConfig.from_dict(json.loads(config_json))
        layout = _layout(layout_json)
        page = layout.get("page_size") or self.page_size
        tail = layout.get("tail_rows")
        return profile_from_model_config(
            cfg,
            kv_dtype_bytes=layout.get("kv_dtype_bytes"),
            kv_cache_dtype=layout.get("kv_cache_dtype") or "auto",
            row_bytes=layout.get("row_bytes"),  # stored sizes: packed in fp8, keys padded
            key_bytes=layout.get("index_key_bytes"),
            page_size=page,
            hot_cache_rows=layout.get("hot_cache_rows") or self.hot_cache_rows,
            tail_pages=max(1, -(-tail // page)) if tail else 1,
            key_page_rows=layout.get("index_key_page_rows"),
        )

    def profile(self, worker: WorkerStatus) -> Profile | None:
        """``worker``'s capacity profile; None while it has not told a usable model config."""
        if not worker.config_json or worker.config_json in self._unusable:
            return None
        try:
            return self._profile(worker.config_json, worker.kv_layout_json)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("worker %s: its model config is unusable for sizing: %s", worker.address, e)
            self._unusable.add(worker.config_json)
            return None

    def shared_bytes(self, worker: WorkerStatus, page: int, pages: int) -> tuple[int, ...] | None:
        """The bytes of prefixes of 0, 1, ..., ``pages`` pages of ``page`` tokens that sessions
        sharing them hold once on ``worker`` (its device pages; the capacity model's
        ``shared_prefix_bytes``), computed once per worker config and length; None while the
        worker is not sized."""
        if self.profile(worker) is None:
            return None
        longest = 1 << max(0, pages - 1).bit_length()  # computed for powers of two, sliced
        series = self._shared(worker.config_json, worker.kv_layout_json, worker.mode, page, longest)
        return series[: pages + 1]

    def _shared_bytes(
        self, config_json: str, layout_json: str, mode: str, page: int, pages: int
    ) -> tuple[int, ...]:
        profile = self._profile(config_json, layout_json)
        return tuple(
            shared_prefix_bytes(profile, i * page, capacity_mode(mode)) for i in range(pages + 1)
        )

    def required_bytes(self, worker: WorkerStatus, context_tokens: int) -> int | None:
        """Bytes one session of ``context_tokens`` tokens needs on ``worker``; None while the
        worker has not told its model config."""
        profile = self.profile(worker)
        if profile is None:
            return None
        mode = capacity_mode(worker.mode)
        if mode == "hierarchy":  # the worker reserves index keys for a verification block more
            context_tokens += int(_layout(worker.kv_layout_json).get("spec_block") or 1)
        return required_bytes(profile, context_tokens, mode)


@lru_cache(maxsize=16)
def _layout(layout_json: str) -> dict:
    """A worker's reported KV layout, parsed once ({} from a worker that reports none)."""
    return json.loads(layout_json) if layout_json else {}
