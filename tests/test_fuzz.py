"""Protocol fuzzing with hypothesis: every message type a peer reads from others (stream hellos,
msgpack control messages, frame headers, DHT records, invitations, state headers) is either
accepted or refused with the error its reader documents; none crashes a handler, none hangs, and
none makes the reader allocate by the sender's claim."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time

import msgpack
import pytest
import torch
from hivemind.dht.validation import DHTRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_id
from dedloc import Peer
from dedloc.auth.authorizer import OpenRun
from dedloc.auth.invitation import Invitation, Revocations, RunOwner
from dedloc.auth.records import SignedRecords
from dedloc.averaging.group import Group
from dedloc.averaging.matchmaking import Matchmaker, _parse_entry
from dedloc.averaging.wire import HEADER, MAGIC, VERSION, unpack_header
from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import ProtocolError, Unauthorized
from dedloc.net import messages
from dedloc.auth.identity import create_identity, load_identity
from dedloc.net.node import Node
from dedloc.records import CapabilityRecord, ProgressRecord

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# msgpack-shaped values: what a peer can put in any control message or record
values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20) |
    st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=20)
near_join = st.fixed_dictionaries(
    {"v": st.sampled_from([VERSION, VERSION + 1, "6", None]), "step": values | st.integers(-5, 5),
     "w": values | st.floats(), "s": values | st.floats(), "c": values, "f": values, "p": values,
     "g": values | st.floats(), "i": values})


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@FAST
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size) | st.builds(
    lambda kind, code, part, weight, numel: HEADER.pack(MAGIC, VERSION, kind, code, bytes(16), part, weight, numel),
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1), st.floats(), st.integers(0, 2**64 - 1)))
def test_frame_headers_are_parsed_or_refused(raw):
    try:
        header = unpack_header(raw)
    except ProtocolError:
        return
    assert 0 <= header.weight <= 2.0 ** 52 and header.numel >= 0


@FAST
@given(values)
def test_control_messages_and_records_are_parsed_or_skipped(obj):
    for parse in (lambda o: _parse_entry("12D3KooWpeer", o), lambda o: ProgressRecord.from_wire("p", o),
                  lambda o: CapabilityRecord.from_wire("p", o)):
        parse(obj)  # returns a record or None; raising would crash the reader
    try:
        Group.from_wire(obj)
    except ProtocolError:
        pass


@FAST
@given(st.binary(max_size=64), st.integers(0, 2**32 - 1))
def test_a_claimed_message_length_never_sizes_an_allocation(body, claimed):
    async def main():
        try:
            await messages.read_message(_reader(claimed.to_bytes(4, "big") + body), limit=4096)
        except (ProtocolError, asyncio.IncompleteReadError):
            pass

    asyncio.run(main())  # a claim above the limit is refused before reading; one below reads what came


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    return RunOwner.init(str(tmp_path_factory.mktemp("run")), "fuzz")


@FAST
@given(text=st.text(max_size=200) | st.builds(lambda a, b: f"inv1.{a}.{b}", st.text(max_size=80), st.text(max_size=90)))
def test_invitations_and_revocations_are_verified_or_refused(owner, text):
    public = owner.key.public_key()
    with pytest.raises(Unauthorized):  # nothing random is signed by the owner
        Invitation.verify(text, public, "fuzz")
    with pytest.raises(Unauthorized):
        Revocations.verify(text.replace("inv1", "rev1"), public, "fuzz")


@FAST
@given(key=st.binary(max_size=24), subkey=st.binary(max_size=48) | st.builds(
    lambda s: msgpack.packb(s), st.text(max_size=60)), value=st.binary(max_size=200) | st.builds(
    lambda v: msgpack.packb(v, use_bin_type=True), values), expiration=st.floats())
def test_dht_records_are_validated_or_refused(tmp_path_factory, key, subkey, value, expiration):
    path = tmp_path_factory.mktemp("id") / "k"
    peer = create_identity(path)
    validator = SignedRecords(load_identity(path), peer, OpenRun())
    assert validator.validate(DHTRecord(key, subkey, value, expiration)) is False
    own = DHTRecord(key, msgpack.packb(peer), value, 1e9)
    signed = DHTRecord(key, own.subkey, validator.sign_value(own), own.expiration_time)
    assert validator.validate(signed) and validator.strip_value(signed) == value


def test_handlers_refuse_fuzzed_join_requests_and_hellos_without_crashing(tmp_path):
    """A real matchmaker's join handler and a real stream server, fed hypothesis' inputs."""

    async def main():
        node = await Node.create(PeerConfig(run_id=run_id()))
        try:
            mm = Matchmaker(node, AveragingConfig(matchmaking_time=0.05), share=1.0)
            mm._newest = 0
            for step in range(-5, 6):  # this peer has decided these steps (as after matchmaking for them):
                mm._decision(step).set()  # a join for one is answered at once, whatever wait it asks for
            loop = asyncio.get_running_loop()

            @settings(max_examples=200, deadline=None)
            @given(st.one_of(near_join, values))
            def join(request):
                answer = asyncio.run_coroutine_threadsafe(mm._on_join(node.peer_id, request), loop).result(5)
                assert isinstance(answer, dict)

            @settings(max_examples=200, deadline=None)
            @given(st.binary(max_size=64) | st.builds(lambda v: (lambda b: len(b).to_bytes(4, "big") + b)(
                msgpack.packb(v, use_bin_type=True)), values | st.fixed_dictionaries({"v": values, "c": values})))
            def hello(data):
                async def admit():  # the reader belongs to the node's loop
                    try:
                        return await node.streams._admit("p", _reader(data))
                    except asyncio.IncompleteReadError:
                        return "ended early", True  # the serving helper logs it at DEBUG and closes

                refusal, _ = asyncio.run_coroutine_threadsafe(admit(), loop).result(15)
                assert refusal is None or isinstance(refusal, str)

            await asyncio.to_thread(join)
            await asyncio.to_thread(hello)
        finally:
            await node.shutdown()

    asyncio.run(main())


def test_random_bytes_on_every_protocol_leave_the_peer_serving():
    """Random bytes after the hello, on each protocol of a real peer: each stream is refused or
    dropped within its deadline, and the peer then still averages and serves its state."""
    peer = Peer(PeerConfig(run_id=run_id()), AveragingConfig(matchmaking_time=1, averaging_timeout=10, probe_interval=0))
    other = Peer(PeerConfig(run_id=peer.config.run_id, initial_peers=tuple(peer.maddrs)), peer.averaging)
    try:
        peer.offer_state(0, b"state")

        async def fuzz():
            node = await Node.create(PeerConfig(run_id=peer.config.run_id, initial_peers=tuple(peer.maddrs)))
            try:
                rng = random.Random(7)

                async def one(proto: str, data: bytes) -> None:
                    reader, writer = await node.streams.open(peer.peer_id, f"dedloc.{peer.config.run_id}.{proto}")
                    started = time.monotonic()
                    writer.write(data)
                    writer.write_eof()  # all it will get: the server reads to its end, or to its deadline
                    try:
                        while await asyncio.wait_for(reader.read(1 << 16), 40):
                            pass  # an answer, then the stream closed
                    except (ConnectionError, asyncio.TimeoutError):
                        pass
                    assert time.monotonic() - started < 40, f"{proto} hung on {data[:16]!r}"
                    writer.close()

                await asyncio.gather(*(one(proto, rng.randbytes(rng.choice([1, 4, 44, 100, 4096])))
                                       for proto in ("join", "allreduce", "probe", "state") for _ in range(6)))
            finally:
                await node.shutdown()

        asyncio.run(fuzz())
        xs = [torch.full((100,), 1.0), torch.full((100,), 3.0)]
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda a: a[0].average(a[1], step=0, weight=1.0, expected_peers=2), zip((peer, other), xs)))
        assert torch.equal(xs[0], torch.full((100,), 2.0)) and torch.equal(xs[1], xs[0])
        assert other.download_state([peer.peer_id], 0, timeout=30)[:2] == (0, b"state")
    finally:
        other.close()
        peer.close()


def test_state_headers_from_a_hostile_donor_are_refused_by_name():
    """A donor answering the state request with every kind of header: refused with a StateError
    naming it (never an allocation by its claimed size, never a hang), until a real donor serves."""
    from conftest import bare_node
    from dedloc.errors import StateError

    rid = run_id()
    good = Peer(PeerConfig(run_id=rid), AveragingConfig(probe_interval=0))
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), AveragingConfig(probe_interval=0))
    heads = [None, [], "x", {"step": "3", "size": 10}, {"step": 3, "size": -1}, {"step": 3, "size": 2**70},
             {"step": 1, "size": 10}, {"step": 3, "size": 1 << 40}, {"busy": True}, {"error": "no"}, {"step": 3}]
    try:
        for head in heads:
            async def serve(node, finished, head=head):
                async def answer(info, reader, writer):
                    await messages.read_message(reader)
                    await messages.write_message(writer, head)
                    return True

                await node.streams.serve(f"dedloc.{rid}.state", answer)

            with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), serve) as donor:
                with pytest.raises(StateError, match=donor):
                    newcomer.download_state([donor], 3, timeout=20, max_bytes=1 << 20)
        good.offer_state(3, b"a state of step 3")
        assert newcomer.download_state([good.peer_id], 3, timeout=20)[:2] == (3, b"a state of step 3")
    finally:
        newcomer.close()
        good.close()

