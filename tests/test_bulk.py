"""Credit-paced sends and zero-copy reads (dedloc.net.bulk) over real Unix sockets, as the p2p
daemon's streams are, and over direct connections (net/direct_stream.py: plaintext TCP and TLS)."""

import asyncio
import os
import socket

import pytest

from dedloc.errors import ProtocolError
from dedloc.net import bulk
from dedloc.net.direct_stream import DirectProtocol
from dedloc.net.tcp import _Certificate


KINDS = ["unix", "tcp", "tls"]


async def pair(kind: str = "unix"):
    """Two connected streams: a Unix socket pair (the daemon's), or a direct connection on loopback."""
    if kind == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ra, wa = await asyncio.open_unix_connection(sock=a)
        rb, wb = await asyncio.open_unix_connection(sock=b)
        return (ra, wa), (rb, wb)
    loop = asyncio.get_running_loop()
    cert = _Certificate() if kind == "tls" else None
    accepted = loop.create_future()
    server = await loop.create_server(lambda: DirectProtocol(loop, 1 << 20, lambda r, w: accepted.set_result((r, w))),
                                      "127.0.0.1", 0, ssl=cert.server if cert else None)
    port = server.sockets[0].getsockname()[1]
    transport, proto = await loop.create_connection(lambda: DirectProtocol(loop, 1 << 20), "127.0.0.1", port,
                                                    ssl=cert.client if cert else None,
                                                    server_hostname="dedloc" if cert else None)
    other = await accepted
    server.close()
    return (proto.reader, asyncio.StreamWriter(transport, proto, proto.reader, loop)), other


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, bulk.UNIT, bulk.UNIT + 1, 3 * (1 << 20) + 17, 40 << 20])
def test_paced_payload_arrives_exactly_and_credits_balance(size, kind):
    """Small payloads take the ordinary path, large ones the zero-copy path; either way the bytes
    are exact, and the sender consumes exactly the credits sent: what follows on the stream is intact."""

    async def go():
        (ra, wa), (rb, wb) = await pair(kind)
        data = os.urandom(size)
        out = bytearray(size)

        async def receive():
            got = await bulk.recv_into(rb, wb, memoryview(out), on_progress=progress.append)
            wb.write(b"after")
            await wb.drain()
            return got

        progress: list[int] = []
        sent, received = await asyncio.wait_for(asyncio.gather(bulk.send_paced(wa, ra, memoryview(data), 1 << 20),
                                                         receive()), 60)
        assert bytes(out) == data
        assert await asyncio.wait_for(ra.readexactly(5), 10) == b"after"
        assert sent.nbytes == received.nbytes == size
        assert 0 <= sent.queue_s <= sent.seconds < 30 and 0 <= received.seconds < 30
        assert progress[-1] == size and progress == sorted(progress)
        # the reader keeps working normally after a zero-copy read
        wa.write(b"tail")
        await wa.drain()
        assert await rb.readexactly(4) == b"tail"
        wa.close()
        wb.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_zero_copy_read_starts_from_what_the_reader_already_buffered(kind):
    async def go():
        (ra, wa), (rb, wb) = await pair(kind)
        data = os.urandom(5 << 20)
        wa.write(b"H" + data[:100_000])  # arrives before the payload read starts
        await wa.drain()
        assert await rb.readexactly(1) == b"H"  # the rest of that write is now in the reader's buffer
        out = bytearray(len(data))
        reading = asyncio.create_task(bulk.recv_into(rb, None, memoryview(out)))
        wa.write(data[100_000:])
        await wa.drain()
        await asyncio.wait_for(reading, 30)
        assert bytes(out) == data
        wa.close()
        wb.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_sender_closing_mid_payload_raises_incomplete_read(kind):
    async def go():
        (ra, wa), (rb, wb) = await pair(kind)
        for size in (1000, 4 << 20):  # ordinary and zero-copy paths
            reading = asyncio.create_task(bulk.recv_into(rb, None, memoryview(bytearray(size))))
            wa.write(os.urandom(size // 2))
            await wa.drain()
            wa.close()
            with pytest.raises(asyncio.IncompleteReadError):
                await asyncio.wait_for(reading, 10)
            wb.close()
            (ra, wa), (rb, wb) = await pair(kind)
        wa.close()
        wb.close()

    asyncio.run(go())


@pytest.mark.parametrize("answer, why, left", [
    # a refusal after some credits: reported, and left on the stream for the caller to read
    (bytes([bulk.CREDIT]) * 3 + b"DDLC not a credit", "before reading the whole payload", b"DDLC not a credit"),
    # credits ahead of the bytes (to make the sender flood the link): caught, not believed
    (bytes([bulk.CREDIT]) * bulk.credits_for(8 << 20), "not sent yet", b""),
], ids=["answers-instead-of-crediting", "credits-ahead"])
def test_receiver_misbehaving_while_we_send_is_a_protocol_error(answer, why, left):
    async def go():
        (ra, wa), (rb, wb) = await pair()
        wb.write(answer)
        await wb.drain()

        async def discard():
            while await rb.read(1 << 20):
                pass

        sink = asyncio.create_task(discard())
        with pytest.raises(ProtocolError, match=why):
            await asyncio.wait_for(bulk.send_paced(wa, ra, memoryview(bytes(8 << 20)), 1 << 20), 10)
        if left:
            assert await asyncio.wait_for(ra.readexactly(len(left)), 10) == left
        wa.close()
        await asyncio.wait_for(sink, 10)
        wb.close()

    asyncio.run(go())


def test_window_does_not_trust_a_rate_taken_over_milliseconds():
    """Regression (a CI failure): the first credits of a payload arrive within milliseconds, out of
    socket buffers and the token bucket, not at the link's rate. Taken as the rate, 64 KiB in 10 ms
    opened a 6 MiB window on a 1 MB/s link, and three such probes queued ~7 s unpaced. Before
    MIN_SPAN the window only doubles what was credited; after it, it is rate x TARGET_DELAY."""
    w = bulk._Window(now=0.0)
    w.credited(64 << 10, now=0.01)
    assert w.size == bulk.FIRST_WINDOW  # not 6.5 MB/s x 1 s
    w.credited(bulk.FIRST_WINDOW, now=0.02)
    assert w.size == 2 * bulk.FIRST_WINDOW  # slow start: doubles per round trip
    w.credited(1_000_000, now=1.0)  # 1 MB/s over a second
    assert w.size == int(1_000_000 * bulk.TARGET_DELAY)
    w.credited(1_010_000, now=3.5)  # the link slowed to a trickle: the window falls to its floor
    assert w.size == bulk.MIN_WINDOW
