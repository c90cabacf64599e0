"""When an index producer's followers are resolved: a policy, apart from the selections that
carry it out (``selection.py``). Either way the locations and the bytes copied are the same.

A producer's selection serves the follower layers after it (IndexShare), each with a source of
its own, so their resolutions — hot-cache lookups and host reads — can start as soon as the
selection exists. Overlapped, they run on a side stream beside the producer's attention and
the layers in between (inside a captured CUDA graph: a parallel branch of the graph); inline,
they run on the pass's own stream before the producer's attention."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FollowerPrefetch:
    overlap: bool = True  # on a GPU: beside the layers in between (False: inline)
