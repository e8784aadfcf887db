"""The TLS context every httpx client of the reference connector shares."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def client_tls() -> ssl.SSLContext:
    """Pass as ``verify=``: httpx makes a context for each client it opens, reading the CA
    bundle, about 25 ms of CPU on the thread that opens the client (an agent's event loop, when
    it registers or queries the bootstrap server), even for a server that speaks plain HTTP."""
    return httpx.create_ssl_context()
