"""The upstream pool over TLS, as every hosted provider is reached: a real TLS server on 127.0.0.1
with a certificate from a throwaway CA (trustme), which the pool is made to trust.

Checks that https works and keeps its connection, that the certificate must name the host the
pool connects to, and that one from a CA the pool does not trust is refused.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest
import trustme

import providers.pool
from gateway.errors import UpstreamUnavailable
from providers.pool import UpstreamPool

BODY = b'{"ok": true}'


class TLSServer:
    """Answers every request on a keep-alive TLS connection with ``BODY``; counts connections."""

    def __init__(self, certificate: trustme.LeafCert) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        certificate.configure_cert(self.context)
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> TLSServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
def trusted(monkeypatch: pytest.MonkeyPatch) -> trustme.CA:
    """A CA the pool trusts (in place of the public ones)."""
    ca = trustme.CA()

    def context() -> ssl.SSLContext:
        made = ssl.create_default_context()
        ca.configure_trust(made)
        return made

    monkeypatch.setattr(providers.pool, "_tls_context", context)
    return ca


async def serve(certificate: trustme.LeafCert) -> AsyncIterator[TLSServer]:
    server = await TLSServer(certificate).start()
    try:
        yield server
    finally:
        await server.stop()


def pool_for(url: str) -> UpstreamPool:
    return UpstreamPool(url, {}, connect_timeout_s=2.0, read_timeout_s=2.0, max_connections=4)


async def test_https_works_and_keeps_its_connection(trusted: trustme.CA) -> None:
    async for server in serve(trusted.issue_cert("127.0.0.1")):
        pool = pool_for(f"https://127.0.0.1:{server.port}/v1")
        try:
            for _ in range(3):
                response = await pool.post("/chat/completions", b"{}", {})
                assert (response.status, await response.read(1024)) == (200, BODY)
        finally:
            await pool.aclose()
        assert server.connections == 1


async def test_a_certificate_for_another_host_is_refused(trusted: trustme.CA) -> None:
    async for server in serve(trusted.issue_cert("upstream.example")):
        pool = pool_for(f"https://127.0.0.1:{server.port}/v1")
        try:
            with pytest.raises(UpstreamUnavailable):
                await pool.post("/chat/completions", b"{}", {})
        finally:
            await pool.aclose()


async def test_a_certificate_from_an_untrusted_ca_is_refused(trusted: trustme.CA) -> None:
    async for server in serve(trustme.CA().issue_cert("127.0.0.1")):
        pool = pool_for(f"https://127.0.0.1:{server.port}/v1")
        try:
            with pytest.raises(UpstreamUnavailable):
                await pool.post("/chat/completions", b"{}", {})
        finally:
            await pool.aclose()
