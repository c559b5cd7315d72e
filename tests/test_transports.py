"""One conformance test for every Transport (net/transport.py): in-process socket pairs, libp2p
streams through the daemon, and direct TCP connections under a grant with the libp2p fallback.
Each must carry a request and its answer with the opener's identity, refuse a protocol the peer
does not serve, and go on serving after a handler fails."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import pytest

from dedloc.config import PeerConfig
from dedloc.net.messages import read_message, write_message

from conftest import run_id

PROTO = "dedloc.test.conformance"


@contextlib.asynccontextmanager
async def local_pairs() -> AsyncIterator[tuple]:
    from dedloc.net.transport import LocalPairs

    pairs = LocalPairs()
    try:
        yield pairs.transport("a"), "a", pairs.transport("b"), "b"
    finally:
        await pairs.close(5)


@contextlib.asynccontextmanager
async def two_nodes() -> AsyncIterator[tuple]:
    from dedloc.net.node import Node

    rid = run_id()
    a = await Node.create(PeerConfig(run_id=rid))
    try:
        b = await Node.create(PeerConfig(run_id=rid, initial_peers=tuple(await a.visible_maddrs())))
        try:
            yield rid, a, b
        finally:
            await b.shutdown()
    finally:
        await a.shutdown()


@contextlib.asynccontextmanager
async def libp2p_streams() -> AsyncIterator[tuple]:
    async with two_nodes() as (_, a, b):
        yield a.streams, a.peer_id.to_base58(), b.streams, b.peer_id.to_base58()


@contextlib.asynccontextmanager
async def direct_connections() -> AsyncIterator[tuple]:
    from dedloc.net.peer_connections import PeerConnections
    from dedloc.net.tcp import DirectTCP

    async def no_rounds(round_id: bytes):
        return None

    async with two_nodes() as (rid, a, b):
        sides = []
        for node in (a, b):
            me = node.peer_id.to_base58()
            tcp = DirectTCP(me, True, node.sign, node.authorizer.proven)
            await tcp.listen("127.0.0.1", "127.0.0.1", 0, no_rounds)
            peers = PeerConnections(node.streams, tcp, rid, True)
            await peers.start()
            sides.append((peers, me, tcp))
        try:
            yield sides[0][0], sides[0][1], sides[1][0], sides[1][1]
            assert sides[0][0].counts["direct"] >= 1, sides[0][0].counts  # not the fallback every time
        finally:
            for _, _, tcp in sides:
                await tcp.close()


TRANSPORTS: dict[str, Callable] = {"local pairs": local_pairs, "libp2p streams": libp2p_streams,
                                   "direct connections": direct_connections}


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_every_transport_carries_a_request_refuses_an_unserved_protocol_and_survives_a_failing_handler(kind):
    async def main() -> None:
        async with TRANSPORTS[kind]() as (opener, opener_id, server, server_id):
            seen: list[str] = []

            async def handler(info, reader, writer) -> bool:
                request = await read_message(reader)
                seen.append(info.peer_id.to_base58())
                if request == "fail":
                    raise RuntimeError("the handler failed")
                await write_message(writer, {"echo": request})
                return True  # wrote last: the transport waits for the opener to close first

            await server.serve(PROTO, handler)
            for attempt in ("first", "fail", "after the failure"):
                reader, writer = await asyncio.wait_for(opener.open(server_id, PROTO), 20)
                try:
                    await write_message(writer, attempt)
                    if attempt == "fail":
                        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                            await asyncio.wait_for(read_message(reader), 20)
                    else:
                        assert await asyncio.wait_for(read_message(reader), 20) == {"echo": attempt}
                finally:
                    writer.close()
            assert seen == [opener_id] * 3  # the handler knows who opened each stream
            with pytest.raises(ConnectionError, match="serves no|protocols not supported"):
                await asyncio.wait_for(opener.open(server_id, PROTO + ".unserved"), 20)

    asyncio.run(main())
