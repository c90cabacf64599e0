"""The OpenAI-compatible HTTP gateway: tokenizes, renders chat templates, validates, admits by
memory against a capacity ledger (Redis or in-process), routes to a worker that can hold the
request (the one whose node likely holds its prompt's prefix, weighed against load; else the
least loaded) over gRPC and streams the answer back (DESIGN §1, §9)."""

from services.gateway.admission import AdmissionConfig, MemoryAdmission
from services.gateway.affinity import AffinityConfig, PrefixAffinity, PrefixAffinityRouter
from services.gateway.app import create_app, memory_admission, prefix_affinity
from services.gateway.ledger import Ledger, LocalLedger
from services.gateway.routing import Admission, ImmediateAdmission, LeastLoadedRouter, Router
from services.gateway.settings import GatewaySettings

__all__ = [
    "Admission",
    "AdmissionConfig",
    "AffinityConfig",
    "GatewaySettings",
    "ImmediateAdmission",
    "LeastLoadedRouter",
    "Ledger",
    "LocalLedger",
    "MemoryAdmission",
    "PrefixAffinity",
    "PrefixAffinityRouter",
    "Router",
    "create_app",
    "memory_admission",
    "prefix_affinity",
]
