"""A worker that spans ranks: engines stepping as one (``lockstep``), which rank serves a
request under data-parallel attention (``placement``), rank 0's mirrors of the others'
requests (``mirror``), the node's host store shared by a tensor-parallel group
(``region_group``), and the engine's role in its group (``role``)."""
