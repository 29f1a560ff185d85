"""Horovod's Gloo rendezvous server for a one-machine launch: listening on loopback only, and who arrived."""

from __future__ import annotations

import threading
from typing import Any

LOOPBACK = "127.0.0.1"


def start_loopback_rendezvous() -> tuple[Any, int]:
    """A started ``RendezvousServer`` that listens on 127.0.0.1 only, and its port.

    Horovod's own ``RendezvousServer.start`` listens on every interface: the unauthenticated HTTP
    store the workers exchange their addresses through would be open to the network for the whole
    job. The workers of a one-machine launch reach it on loopback, so nothing else needs to. Built
    from Horovod's server and handler classes, so every Horovod build behaves the same.
    """
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer

    server = RendezvousServer()
    httpd = RendezvousHTTPServer((LOOPBACK, 0), RendezvousHandler, 0)  # port 0: the system picks a free one
    server._httpd = httpd
    server._listen_thread = threading.Thread(target=httpd.serve_forever, name="hvd_plugins-rendezvous", daemon=True)
    server._listen_thread.start()
    return server, int(httpd.server_address[1])


def rendezvous_arrivals(server: Any) -> set[int]:
    """Ranks that have reached ``hvd.init()`` and put their address into a Gloo ``RendezvousServer``.

    Each rank's Gloo context writes the keys ``<rank>`` and ``rank_<rank>`` in the ``global``
    scope of the server's key-value cache; the scope is cleared only once every rank has connected.
    """
    httpd = server._httpd
    with httpd.cache_lock:
        keys = list(httpd.cache.get("global", {}))
    return {int(key.removeprefix("rank_")) for key in keys if key.removeprefix("rank_").isdigit()}
