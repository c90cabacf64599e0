"""``/metrics`` over HTTP in the Prometheus text format, always.

prometheus_client's own server answers OpenMetrics when a scraper asks for it (Prometheus does
by default), and its OpenMetrics writer turns the ``:`` of our ``dhisparse:`` names into ``_``
in samples (prometheus/client_python#1177), so dashboards would find nothing. The gateway
serves the text format from FastAPI; the worker and the store use this server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serves ``registry`` at ``/metrics`` on a daemon thread; ``port`` 0 picks a free one
    (``server.server_port``). Stop with ``server.shutdown(); server.server_close()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # scrapes every few seconds would flood the log

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
