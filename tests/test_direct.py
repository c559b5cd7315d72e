"""Direct TCP connections for round streams (net/tcp.py): who may connect, what is pinned, and the
per-pair fallback to libp2p; real sockets on loopback, real peers for the fallback."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging

import pytest
import torch

from dedloc.config import AveragingConfig
from dedloc.errors import ProtocolError
from cryptography.hazmat.primitives.asymmetric import ed25519

from dedloc.auth.identity import create_identity, peer_id_of
from dedloc.net.messages import read_message, write_message
from dedloc.net.tcp import VERSION, DirectTCP, Endpoint, _HELLO, _mac, _signed

_KEYS = [ed25519.Ed25519PrivateKey.generate() for _ in range(3)]
A, B, C = (peer_id_of(k.public_key()) for k in _KEYS)
SIGN = dict(zip((A, B, C), (k.sign for k in _KEYS)))
ROUND, KEY, PROTO = bytes(range(16)), bytes(32), "dedloc.test.allreduce"


def direct(me: str, encryption: bool = True, **kwargs) -> DirectTCP:
    """``me``'s transport, signing with its identity key as a peer's does."""
    return DirectTCP(me, encryption, SIGN[me], **kwargs)


async def echo_server(encryption: bool = True, members=(A, B), **kwargs):
    """B listening for round ROUND (members ``members``), echoing one message per stream."""
    server = direct(B, encryption, **kwargs)
    served = []

    async def keys(round_id):
        return (KEY, frozenset(members)) if round_id == ROUND else None

    async def handler(info, reader, writer):
        served.append(info.peer_id.to_base58())
        await write_message(writer, await read_message(reader))

    await server.serve(PROTO, handler)
    endpoint = await server.listen("127.0.0.1", "127.0.0.1", 0, keys)
    return server, endpoint, served


@pytest.mark.parametrize("encryption", [True, False], ids=["tls", "plaintext"])
def test_a_member_with_the_round_key_gets_a_stream(encryption):
    async def main():
        server, endpoint, served = await echo_server(encryption)
        client = direct(A, encryption)
        try:
            assert (endpoint.fingerprint is not None) == encryption
            reader, writer = await client.open(B, PROTO, endpoint, ROUND, KEY, require_encryption=encryption)
            assert (writer.get_extra_info("ssl_object") is not None) == encryption
            await write_message(writer, {"x": 1})
            assert await read_message(reader) == {"x": 1}
            writer.close()
            assert served == [A]
        finally:
            await server.close()
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("case", ["wrong key", "not a member", "unknown round", "unserved protocol",
                                  "wrong fingerprint", "plaintext refused", "closed port", "another's grant",
                                  "grant for another protocol", "expired grant", "replaced grant"])
def test_every_bad_connection_is_refused_by_name_and_the_pair_falls_back(case, caplog):
    """Each failure raises ConnectionError naming it, before any payload, and the client stops
    trying that peer directly for a while (the averager then uses libp2p)."""
    me = C if case in ("not a member", "another's grant") else A

    async def main():
        server, endpoint, served = await echo_server(encryption=case != "plaintext refused", members=(A, B))
        client = direct(me)
        key, rid, ep, proto = KEY, ROUND, endpoint, PROTO
        if case == "wrong key":
            key = bytes([1]) * 32
        elif case == "unknown round":
            rid = bytes(16)
        elif case == "wrong fingerprint":
            ep = Endpoint(endpoint.host, endpoint.port, "0" * 64)
        elif case == "closed port":
            await server.close()
        elif case == "unserved protocol":
            proto = "dedloc.test.state"
        elif "grant" in case:  # a grant outside rounds (net/peer_connections.py), for A
            protocols = frozenset({"dedloc.test.probe"} if case == "grant for another protocol" else {PROTO})
            rid, key = server.grant(A, protocols, 0.0 if case == "expired grant" else 60.0)
            if case == "replaced grant":
                server.grant(A, protocols, 60.0)
        try:
            with pytest.raises(ConnectionError) as err:
                await client.open(B, proto, ep, rid, key, require_encryption=True)
            assert not client.usable(B) and served == []
            return str(err.value)
        finally:
            await server.close()
            await client.close()

    with caplog.at_level("WARNING", logger="dedloc.net.tcp"):
        why = asyncio.run(main())
    expected = {"wrong key": "MAC does not check", "not a member": f"{C} is not a member of this round",
                "unknown round": "unknown round", "unserved protocol": "serves no 'dedloc.test.state'",
                "wrong fingerprint": "certificate is not the one its group names",
                "plaintext refused": "plaintext and this round requires encryption",
                "closed port": "cannot connect", "another's grant": f"{C} is not a member of this round (or the holder",
                "grant for another protocol": f"the grant does not cover {PROTO!r}",
                "expired grant": "the grant has expired", "replaced grant": "unknown round or grant"}[case]
    assert expected in why, why
    if case not in ("wrong fingerprint", "plaintext refused", "closed port"):  # the server names it too
        assert f"refused a direct stream from {me}: " in caplog.text


def test_garbage_and_silence_are_refused_without_a_handler():
    """A stranger that sends no hello, or junk, is answered or dropped within the hello wait;
    nothing reaches the handler."""
    async def main():
        server, endpoint, served = await echo_server(encryption=False)
        try:
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            writer.write((10 ** 6).to_bytes(4, "big") + b"x" * 100)  # claims a 1 MB hello
            await writer.drain()
            answer = await asyncio.wait_for(read_message(reader), 10)
            assert "exceeds" in answer["refused"]
            writer.close()
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            await write_message(writer, {"v": 1, "r": "no"})
            assert "malformed hello" in (await asyncio.wait_for(read_message(reader), 10))["refused"]
            writer.close()
            assert served == []
        finally:
            await server.close()

    asyncio.run(main())


def _hello(sender: str, to: str, nonce: bytes, signer: str | None = None, key: bytes = KEY) -> dict:
    """The hello ``sender``'s transport would send, signed by ``signer`` (default: the sender)."""
    return {"v": VERSION, "r": ROUND, "p": PROTO, "f": sender, "t": to, "n": nonce,
            "m": _mac(key, _HELLO, ROUND, PROTO, sender, to, nonce),
            "s": SIGN[signer or sender](_signed(ROUND, PROTO, sender, to, nonce))}


async def _say(endpoint: Endpoint, hello: dict) -> dict:
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        await write_message(writer, hello)
        return await asyncio.wait_for(read_message(reader), 10)
    finally:
        writer.close()


def test_a_member_claiming_another_members_id_replaying_or_inventing_hellos_is_refused(caplog):
    """At b122246 a member holding the round's secret could name another member in its hello (the
    aggregator then refused the real member's contribution as late), replay a hello byte for byte
    on a plaintext connection, and log one WARNING per invented id, holding each connection while
    it waited for an invented round. Hellos are now signed by their sender, admitted once, from
    members of the run only, and refusals before the signature are logged per address."""
    async def main():
        server, endpoint, served = await echo_server(encryption=False, members=(A, B, C),
                                                     admits=lambda peer: peer in (A, B))
        try:
            # C (a member of the round, not of the run here) and A's id claimed by C
            assert "not signed by" in (await _say(endpoint, _hello(A, B, bytes(16), signer=C)))["refused"]
            assert "is not a member of this run" in (await _say(endpoint, _hello(C, B, bytes([1]) * 16)))["refused"]
            replayed = _hello(A, B, bytes([2]) * 16)
            assert "ok" in await _say(endpoint, replayed)
            assert "already received" in (await _say(endpoint, replayed))["refused"]
            for i in range(20):  # invented ids: keys of its own, each a valid signature of nobody invited
                key = ed25519.Ed25519PrivateKey.generate()
                SIGN[invented := peer_id_of(key.public_key())] = key.sign
                answer = await _say(endpoint, _hello(invented, B, bytes([3 + i]) * 16))
                assert "refused" in answer
            assert served == [A]
        finally:
            await server.close()

    with caplog.at_level("WARNING", logger="dedloc.net.tcp"):
        asyncio.run(main())
    assert f"refused a direct stream from address 127.0.0.1: the hello is not signed by {A}" in caplog.text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) <= 3, [r.getMessage() for r in warnings]  # per address / member, not per invented id


def test_endpoints_are_parsed_strictly():
    e = Endpoint("10.0.0.1", 4000, "ab" * 32)
    assert Endpoint.parse(e.to_wire()) == e
    assert Endpoint.parse("10.0.0.1:4000/plain") == Endpoint("10.0.0.1", 4000, None)
    for bad in ("10.0.0.1/plain", "10.0.0.1:0/plain", "10.0.0.1:4000/xyz", ":4000/plain", "h:99999/plain"):
        with pytest.raises(ProtocolError):
            Endpoint.parse(bad)


def test_rounds_go_direct_and_a_pair_that_cannot_falls_back_to_libp2p(make_peers, tmp_path):
    """Three peers; the one with the largest peer id listens in plaintext (encryption off), the leader
    (the smallest id) asks for encryption: every stream to the plaintext peer goes over libp2p, every
    other stream directly, and the mean is exact and identical."""
    paths = sorted((create_identity(tmp_path / f"{i}.key"), str(tmp_path / f"{i}.key")) for i in range(3))
    avg = dict(matchmaking_time=3, averaging_timeout=30, probe_interval=0, planner="equal")
    peers = make_peers(3, averaging=[AveragingConfig(**avg, encryption=i < 2) for i in range(3)],
                       per_peer=[{"identity_path": path} for _, path in paths])
    xs = [torch.full((100_000,), float(i)) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as pool:
        stats = list(pool.map(lambda a: a[0].average(a[1], step=0, weight=1.0, expected_peers=3), zip(peers, xs)))
    for x in xs:
        assert torch.equal(x, torch.full((100_000,), 1.0))
    # peers 0 and 1 open 2 streams to each other directly and 2 to peer 2 over libp2p; peer 2's own
    # streams to them go direct (their endpoints are TLS, which it can always use)
    assert stats[0].streams == {"direct": 2, "libp2p": 2}, stats[0]
    assert stats[1].streams == {"direct": 2, "libp2p": 2}, stats[1]
    assert stats[2].streams == {"direct": 4, "libp2p": 0}, stats[2]

    # states and probes take the same path, under a grant each peer asks for over libp2p
    blob = bytes(range(256)) * 4096  # 1 MiB
    for p in peers:
        p.offer_state(5, blob)
    ids = [p.peer_id for p in peers]
    assert peers[1].download_state([ids[0]], 5, timeout=30) == (5, blob, ids[0])
    assert peers[2].download_state([ids[0]], 5, timeout=30) == (5, blob, ids[0])
    assert peers[0].download_state([ids[2]], 5, timeout=30) == (5, blob, ids[2])  # plaintext: over libp2p
    result = peers[1].probe([ids[0]])
    assert not result["failed"] and result["pushed"][ids[0]] > 0, result
    assert peers[0].stream_counts() == {"direct": 0, "libp2p": 1}
    assert peers[1].stream_counts() == {"direct": 3, "libp2p": 0}  # a state, a push and a pull
    assert peers[2].stream_counts() == {"direct": 1, "libp2p": 0}
