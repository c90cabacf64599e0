"""The OpenAI-compatible HTTP gateway: tokenizes, renders chat templates, validates, admits by
memory against a capacity ledger (Redis or in-process), routes to the least-loaded worker that
can hold the request over gRPC and streams the answer back (DESIGN §1)."""

from services.gateway.admission import AdmissionConfig, MemoryAdmission
from services.gateway.app import create_app, memory_admission
from services.gateway.ledger import Ledger, LocalLedger
from services.gateway.routing import Admission, ImmediateAdmission, LeastLoadedRouter, Router
from services.gateway.settings import GatewaySettings

__all__ = [
    "Admission",
    "AdmissionConfig",
    "GatewaySettings",
    "ImmediateAdmission",
    "LeastLoadedRouter",
    "Ledger",
    "LocalLedger",
    "MemoryAdmission",
    "Router",
    "create_app",
    "memory_admission",
]
