"""The OpenAI-compatible HTTP gateway: tokenizes, renders chat templates, validates, routes to
the least-loaded healthy worker over gRPC and streams the answer back (DESIGN §1)."""

from services.gateway.app import create_app
from services.gateway.routing import Admission, ImmediateAdmission, LeastLoadedRouter, Router
from services.gateway.settings import GatewaySettings

__all__ = [
    "Admission",
    "GatewaySettings",
    "ImmediateAdmission",
    "LeastLoadedRouter",
    "Router",
    "create_app",
]
