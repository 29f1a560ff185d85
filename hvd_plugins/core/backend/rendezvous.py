"""Reading Horovod's Gloo rendezvous server: which ranks have reached ``hvd.init()``."""

from __future__ import annotations

from typing import Any


def rendezvous_arrivals(server: Any) -> set[int]:
    """Ranks that have reached ``hvd.init()`` and put their address into a Gloo ``RendezvousServer``.

    Each rank's Gloo context writes the keys ``<rank>`` and ``rank_<rank>`` in the ``global``
    scope of the server's key-value cache; the scope is cleared only once every rank has connected.
    """
    httpd = server._httpd
    with httpd.cache_lock:
        keys = list(httpd.cache.get("global", {}))
    return {int(key.removeprefix("rank_")) for key in keys if key.removeprefix("rank_").isdigit()}
