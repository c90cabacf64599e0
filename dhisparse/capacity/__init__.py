"""The capacity model (DESIGN §3–§6): per-session GPU bytes for resident serving and for the KV
hierarchy, with and without a drafter (draft ring, eq. 9–10; staging, eq. 11); sessions per
GPU; host bytes for the backups; and when speculation pays (eq. 13).

Pure Python, no torch: ``dhisparse plan``, the worker's accountant and the gateway's admission
all call this package rather than restating its arithmetic. The accounting rules are in
:mod:`dhisparse.capacity.model`; the derivation of the paper's figures is in
``docs/capacity.md``. Assumptions (each needed to reproduce a printed figure):

A1. Histories, index keys and host backups are allocated in pages of p rows, and each history
    page has a 4 B page-map entry. Without paging, Table 1's 4.444 and 4.469 GiB do not come
    out.
A2. The tail is one page with or without a drafter. Resident serving with a drafter adds the
    draft ring only (4.469 = 4.444 + 0.025); it needs no staging.
A3. The paper's "6.6 GiB of fixed allocations" for speculation includes the staging reserved
    for its 35 slots (1.23 GiB). The DFlash2 drafter's own fixed bytes are the remainder.
A4. The paper's 208/140 sessions (and "about 20"/"12" resident) are totals over 4 GPUs, each
    holding its own sessions, with a per-GPU pool in [22.60, 22.91) GiB; we use 22.75 GiB.
    No pool reproduces them on 1 or 2 GPUs, or with the staging counted twice.
A5. GPU figures are in GiB (2^30 B) and host figures in TB (10^12 B).
A6. Host backups hold the rows of sparse (offloaded) sources only. Index keys stay on the GPU.
A7. ``dsv4-flash`` is partly estimated: see ``Profile.estimated``.
A8. Engine presets get B = 2k and their config's dtype unless told otherwise.
A9. A Hugging Face model directory (DeepSeek-V3.2, GLM-5) is sized by ``model_size``: its
    parameters from config.json alone, and bytes per token in bf16 and in FP8 laid out as the
    GLM-5.3 profile is (one byte per element, 132 B index keys).
A10. Workers that span N GPUs (``layouts``): each rank's weights are the worker's tensors
    (``weights``) cut by the layouts' one table (``dhisparse.family.parallel_layout``); a
    session needs the same bytes on each GPU under every layout (the MLA latent row is one
    head, replicated under TP); a TP worker holds one GPU's pool of sessions, a DP-attention
    worker N. The MTP layer's head is counted as the target's (the released checkpoints'
    copy equals it), and an FP8 checkpoint's unquantized modules are those its
    ``modules_to_not_convert`` names.
A11. A prefix common to every session (``shared_prefix``) is held once per GPU in the pages the
    worker shares: resident, the complete pages of rows and index keys; the hierarchy, of the
    index keys (none for compressed or windowed producers, or a tensor-parallel group). The
    host keeps each session's backup whole and one more copy of the prefix in the store.
"""

from __future__ import annotations

from dhisparse.capacity.admitted import HostSizing, SpeculationTest
from dhisparse.capacity.builtin import (
    default_deployment,
    dsv4_flash,
    get_profile,
    glm53,
    glm53_paper_deployment,
    profile_from_model_config,
    profile_from_model_dir,
    profile_names,
)
from dhisparse.capacity.layouts import LayoutAdmission, LayoutPlan, Refusal, layouts_of
from dhisparse.capacity.model import (
    GIB,
    MODES,
    TB,
    Mode,
    SessionBytes,
    draft_ring_bytes,
    host_bytes,
    host_sessions,
    pool_range,
    prefix_unshared,
    required_bytes,
    ring_address,
    ring_rows,
    session_bytes,
    sessions_kept_share,
    sessions_per_gpu,
    sessions_that_fit,
    shared_prefix_bytes,
    shared_prefix_host_bytes,
    speculation_pays,
    staging_bytes,
)
from dhisparse.capacity.model_size import ModelSize, TokenBytes, model_size, model_size_from_dir
from dhisparse.capacity.plan import Plan, build_plan
from dhisparse.capacity.profile import (
    Deployment,
    DrafterProfile,
    IndexGroup,
    Profile,
    SourceGroup,
)
from dhisparse.capacity.shared_prefix import SharedPrefix
from dhisparse.capacity.weights import ModelWeights, PartBytes, RankWeights, model_weights_of

__all__ = [
    "GIB",
    "MODES",
    "TB",
    "Deployment",
    "DrafterProfile",
    "HostSizing",
    "IndexGroup",
    "LayoutAdmission",
    "LayoutPlan",
    "Mode",
    "ModelSize",
    "ModelWeights",
    "PartBytes",
    "Plan",
    "Profile",
    "RankWeights",
    "Refusal",
    "SessionBytes",
    "SharedPrefix",
    "SourceGroup",
    "SpeculationTest",
    "TokenBytes",
    "build_plan",
    "default_deployment",
    "draft_ring_bytes",
    "dsv4_flash",
    "get_profile",
    "glm53",
    "glm53_paper_deployment",
    "host_bytes",
    "host_sessions",
    "layouts_of",
    "model_size",
    "model_size_from_dir",
    "model_weights_of",
    "pool_range",
    "prefix_unshared",
    "profile_from_model_config",
    "profile_from_model_dir",
    "profile_names",
    "required_bytes",
    "ring_address",
    "ring_rows",
    "session_bytes",
    "sessions_kept_share",
    "sessions_per_gpu",
    "sessions_that_fit",
    "shared_prefix_bytes",
    "shared_prefix_host_bytes",
    "speculation_pays",
    "staging_bytes",
]
