"""Invite-only runs: every stream, DHT request and record is checked against the owner's invitations,
and records belong to the peer that signed them (dedloc/auth, net/serve.py)."""

from __future__ import annotations

import asyncio
import os
import re
import concurrent.futures as cf
import time

import msgpack
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from conftest import run_id
from dedloc import Peer
from dedloc.auth.authorizer import OpenRun, make_authorizer
from dedloc.auth.invitation import Invitation, RunOwner, owner_public_key
from dedloc.averaging.wire import VERSION
from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import ConfigError, Unauthorized
from dedloc.auth.identity import create_identity, load_identity
from dedloc.net import links
from dedloc.net.node import Node
from dedloc.net.relay_guard import RelayGuard
from dedloc.net.serve import Streams

AVG = AveragingConfig(matchmaking_time=2, averaging_timeout=30, probe_interval=0)


def member(owner: RunOwner, tmp_path, name: str, expires: float = 3600.0, backbone: bool = False,
           **kwargs) -> PeerConfig:
    path = str(tmp_path / f"{name}.key")
    peer_id = create_identity(path)
    return PeerConfig(run_id=owner.run_id, owner=owner.public, invite=owner.invite(peer_id, expires, backbone),
                      identity_path=path, **kwargs)


class Presents(OpenRun):
    """An intruder's authorizer: presents whatever credential it was given (a stolen one)."""

    def __init__(self, credential):
        self._credential = credential

    def credential(self):
        return self._credential


async def intruder(run: str, target_maddrs: list[str]) -> Node:
    """An uninvited node of the same run id, connected to the target's daemon (its DHT cannot
    bootstrap through an invite-only peer, so it starts alone)."""
    node = await Node.create(PeerConfig(run_id=run))
    peer = Multiaddr(target_maddrs[0])["p2p"]
    await node.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(a.split("/p2p/")[0]) for a in target_maddrs])
    return node


def test_an_uninvited_peer_can_neither_store_join_contribute_probe_nor_download(tmp_path, capfd):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    a = Peer(member(owner, tmp_path, "a"), AVG)
    b = Peer(member(owner, tmp_path, "b", initial_peers=tuple(a.maddrs)), AVG)
    try:
        xs = [torch.full((1000,), 1.0), torch.full((1000,), 4.0)]
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p[0].average(p[1], step=0, weight=1.0, expected_peers=2), zip((a, b), xs)))
        assert torch.equal(xs[0], torch.full((1000,), 2.5)) and torch.equal(xs[1], xs[0])
        a.offer_state(0, b"the members' state")

        async def attack() -> tuple[str, dict]:
            node = await intruder(owner.run_id, a.maddrs)
            out: dict = {}
            try:
                run = owner.run_id
                for proto in ("join", "allreduce", "probe", "state"):
                    try:
                        await asyncio.wait_for(node.streams.open(a.peer_id, f"dedloc.{run}.{proto}"), 20)
                        out[proto] = "admitted"
                    except Unauthorized as e:
                        out[proto] = str(e)
                try:
                    await node.streams.call(a.peer_id, f"dedloc.{run}.join", {"v": VERSION, "step": 1}, 20)
                except Unauthorized as e:
                    out["join request"] = str(e)
                stolen = Streams(node.p2p, Presents(b.config.invite))  # b's invitation, presented by another peer
                try:
                    await asyncio.wait_for(stolen.open(a.peer_id, f"dedloc.{run}.state"), 20)
                    out["stolen"] = "admitted"
                except Unauthorized as e:
                    out["stolen"] = str(e)
                proto = node.dht.protocol
                key = DHTID.generate(source=f"{run}.progress")
                subkey = node.peer_id.to_base58()
                value = msgpack.packb([b"\x01", b"x" * 64, None])
                out["store"] = await proto.call_store(PeerID.from_base58(a.peer_id), [key], [value],
                                                      time.time() + 60, subkeys=[subkey])
                out["find"] = await proto.call_find(PeerID.from_base58(a.peer_id), [key])
                return node.peer_id.to_base58(), out
            finally:
                await node.shutdown()

        stranger, out = asyncio.run(attack())
        for proto in ("join", "allreduce", "probe", "state", "join request"):
            assert f"refused dedloc.{owner.run_id}.{proto.split()[0]}: peer {stranger} presented no invitation" \
                   in out[proto], (proto, out[proto])
        assert f"peer {stranger} presented the invitation of {b.peer_id}" in out["stolen"]
        assert out["store"] is None and out["find"] is None, out  # the DHT requests were dropped unanswered
        # the members still hold their state and average, exactly
        assert b.download_state([a.peer_id], 0, timeout=30)[:2] == (0, b"the members' state")
        xs = [torch.full((1000,), 3.0), torch.full((1000,), 5.0)]
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p[0].average(p[1], step=1, weight=1.0, expected_peers=2), zip((a, b), xs)))
        assert torch.equal(xs[0], torch.full((1000,), 4.0)) and torch.equal(xs[1], xs[0])
    finally:
        b.close()
        a.close()
    err = capfd.readouterr().err
    for proto in ("join", "allreduce", "probe", "state"):  # each refusal is logged, naming the peer
        assert f"refused a dedloc.{owner.run_id}.{proto} stream from {stranger}: peer {stranger} presented no " \
               f"invitation" in err, proto
    assert f"refused a DHT StoreRequest from {stranger}: peer {stranger} presented no invitation" in err
    assert f"refused a DHT FindRequest from {stranger}" in err


def test_an_uninvited_peer_cannot_join_the_dht(tmp_path, caplog):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    async def main():
        a = await Node.create(member(owner, tmp_path, "a"))
        try:
            with pytest.raises(Exception, match="could not join the collaboration"):
                await Node.create(PeerConfig(run_id=owner.run_id, initial_peers=tuple(await a.visible_maddrs()),
                                             startup_timeout=15))
        finally:
            await a.shutdown()

    with caplog.at_level("WARNING", logger="dedloc.auth.dht"):
        asyncio.run(main())
    assert "presented no invitation" in caplog.text and "refused a DHT" in caplog.text, caplog.text


def test_bad_own_invitations_fail_at_start_by_name(tmp_path):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    other = RunOwner.init(str(tmp_path / "other"), owner.run_id)
    config = member(owner, tmp_path, "a")
    elsewhere = create_identity(tmp_path / "b.key")

    async def start(cfg):
        node = await Node.create(cfg)
        await node.shutdown()

    cases = {
        "needs the run owner's public key": PeerConfig(run_id=owner.run_id, invite=config.invite),
        "is invite-only (an owner key is set); pass the invitation": PeerConfig(run_id=owner.run_id, owner=owner.public),
        f"the invitation is for peer {elsewhere}": PeerConfig(run_id=owner.run_id, owner=owner.public,
                                                               invite=owner.invite(elsewhere, 60),
                                                               identity_path=config.identity_path),
        "not signed by this run's owner": PeerConfig(run_id=owner.run_id, owner=owner.public,
                                                     invite=other.invite(elsewhere, 60),
                                                     identity_path=str(tmp_path / "b.key")),
        "expired": PeerConfig(run_id=owner.run_id, owner=owner.public, invite=owner.invite(elsewhere, 1e-3),
                              identity_path=str(tmp_path / "b.key")),
        "is not an owner public key": PeerConfig(run_id=owner.run_id, owner="nonsense", invite="x"),
    }
    for reason, cfg in cases.items():
        with pytest.raises(ConfigError, match=re.escape(reason)):
            asyncio.run(start(cfg))


def test_expired_and_revoked_invitations_are_refused_and_revocations_spread(tmp_path):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    echo = f"dedloc.{owner.run_id}.echo"

    async def main():
        # a publishes the owner's revocation list; d learns it from the DHT
        a = await Node.create(member(owner, tmp_path, "a", revocations=str(tmp_path / "run" / "revoked")))
        nodes = [a]
        try:
            initial = tuple(await a.visible_maddrs())
            brief = member(owner, tmp_path, "brief", expires=8.0, initial_peers=initial)  # (3 s ran out under a loaded CI)
            c_config = member(owner, tmp_path, "c", initial_peers=initial)
            for cfg in (member(owner, tmp_path, "d", initial_peers=initial), brief, c_config):
                nodes.append(await Node.create(cfg))
            _, d, short, c = nodes

            async def answer(peer, request):
                return request

            for node in (a, d):
                await node.streams.serve_requests(echo, answer)
            assert await c.streams.call(a.peer_id, echo, "hello", 10) == "hello"
            assert await short.streams.call(d.peer_id, echo, "hello", 10) == "hello"

            expiry = Invitation.verify(brief.invite, owner_public_key(owner.public), owner.run_id).expires
            while time.time() < expiry:
                await asyncio.sleep(0.2)  # the invitation's clock, not a synchronisation
            with pytest.raises(Unauthorized, match=f"the invitation of {short.peer_id} has expired"):
                await short.streams.call(d.peer_id, echo, "hello", 10)

            owner.revoke(c.peer_id.to_base58())
            await a.revocations.refresh()  # re-reads the owner's file, publishes the list
            await d.revocations.refresh()  # finds it in the DHT
            for node in (a, d):
                with pytest.raises(Unauthorized, match=f"the invitation of {c.peer_id} was revoked"):
                    await c.streams.call(node.peer_id, echo, "hello", 10)

            # invited again after the revocation: admitted
            await c.shutdown()
            nodes.remove(c)
            renewed = PeerConfig(**{**c_config.__dict__, "invite": owner.invite(c.peer_id.to_base58(), 3600)})
            c2 = await Node.create(renewed)
            nodes.append(c2)
            assert await c2.streams.call(d.peer_id, echo, "again", 10) == "again"
        finally:
            for node in nodes:
                await node.shutdown()

    asyncio.run(main())


def test_a_peer_cannot_write_overwrite_or_extend_another_peers_record(tmp_path, caplog):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    async def main():
        a = await Node.create(member(owner, tmp_path, "a"))
        b_config = member(owner, tmp_path, "b")
        b = await Node.create(PeerConfig(**{**b_config.__dict__, "initial_peers": tuple(await a.visible_maddrs())}))
        try:
            me, mallory = a.peer_id.to_base58(), b.peer_id.to_base58()
            key = a.key("progress")
            assert await a.store(key, me, {"step": 5, "samples": 10}, 60)
            assert (await b.get(key))[me][0] == {"step": 5, "samples": 10}

            # through the public API: b's node does not sign a record under a's subkey, and nobody keeps it
            assert not await b.store(key, me, {"step": 5, "samples": 10 ** 9}, 60)
            # by hand: a value b signed, under a's subkey; a's own signed record with a longer expiry;
            # a plain value with no subkey (a forged "ready" or "closed")
            b_key = load_identity(b_config.identity_path)
            dht_key = DHTID.generate(source=key)
            value = msgpack.packb({"step": 5, "samples": 10 ** 9}, use_bin_type=True)
            forged = msgpack.packb([value, b_key.sign(value), b_config.invite], use_bin_type=True)
            stored = dict(a.dht.protocol.storage.get(dht_key)[0].data)[me]
            results = {}
            results["forged"] = await b.dht.protocol.call_store(a.peer_id, [dht_key], [forged], time.time() + 60,
                                                                subkeys=[me])
            results["extended"] = await b.dht.protocol.call_store(a.peer_id, [dht_key], [stored.value],
                                                                  time.time() + 3600, subkeys=[me])
            results["plain"] = await b.dht.protocol.call_store(
                a.peer_id, [DHTID.generate(source=a.key("closed", 3))], [msgpack.packb(["x"])], time.time() + 60)
            assert results == {"forged": [False], "extended": [False], "plain": [False]}, results
            assert (await a.get(key))[me][0] == {"step": 5, "samples": 10}
            assert (await b.get(key))[me][0] == {"step": 5, "samples": 10}
            return mallory, me
        finally:
            await b.shutdown()
            await a.shutdown()

    with caplog.at_level("DEBUG", logger="dedloc.auth.records"):
        mallory, me = asyncio.run(main())
    for why in ("is not a signed record", f"is not signed by {me}"):  # the first at WARNING, the rest at DEBUG
        assert f"refused a DHT record from peer {mallory}: the record under {me} {why}" in caplog.text, why
    assert f"refused a DHT record from peer {mallory}: its subkey is not a peer id" in caplog.text


def test_a_member_flooding_dht_requests_is_cut_off_and_named(tmp_path, caplog):
    """Past its burst of DHT requests, a member's requests get no answer (WARNING naming it); another
    member's requests are still answered: the budget is per signed sender."""
    from dedloc.auth.dht import DHT_BURST

    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    async def main():
        a = await Node.create(member(owner, tmp_path, "a"))
        maddrs = tuple(await a.visible_maddrs())
        b = await Node.create(PeerConfig(**{**member(owner, tmp_path, "b").__dict__, "initial_peers": maddrs}))
        c = await Node.create(PeerConfig(**{**member(owner, tmp_path, "c").__dict__, "initial_peers": maddrs}))
        try:
            flood = int(DHT_BURST) + 300
            answers = await asyncio.gather(*(b.dht.protocol.call_ping(a.peer_id, validate=False)
                                             for _ in range(flood)))
            answered = sum(x is not None for x in answers)
            assert DHT_BURST - 50 <= answered < flood, answered  # the burst, plus what refilled meanwhile
            assert await c.dht.protocol.call_ping(a.peer_id, validate=False) is not None
            return b.peer_id.to_base58()
        finally:
            await c.shutdown()
            await b.shutdown()
            await a.shutdown()

    with caplog.at_level("WARNING", logger="dedloc.auth.dht"):
        flooder = asyncio.run(main())
    assert f"from {flooder}: too many DHT requests from this peer" in caplog.text, caplog.text


def test_a_running_peer_renews_its_invitation_from_its_file(tmp_path, monkeypatch, caplog):
    """An invitation given as a file is re-read when the file changes: a longer one for this peer is
    adopted (and admitted by others), a wrong or shorter one is ignored by name; a short-lived one
    warns that it must be renewed, and how."""
    from dedloc.auth import authorizer as auth
    from dedloc.auth.authorizer import InviteOnly

    monkeypatch.setattr(auth, "RENEW_CHECK_S", 0.0)
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    me = create_identity(tmp_path / "me.key")
    other = create_identity(tmp_path / "other.key")
    path = tmp_path / "invite.txt"
    first = owner.invite(me, 3600)
    path.write_text(first + "\n")
    mine = InviteOnly(owner.run_id, owner.public, str(path), me)
    theirs = InviteOnly(owner.run_id, owner.public, owner.invite(other, 86400 * 7), other)

    def write(text: str) -> None:  # a new mtime each time, as an editor or `>` would give
        path.write_text(text)
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000 * (1 + len(caplog.records))))

    with caplog.at_level("INFO", logger="dedloc.auth.authorizer"):
        assert mine.credential() == first
        assert "this peer's invitation expires in 1.0 h" in caplog.text and f"write it into {path}" in caplog.text
        write(owner.invite(other, 86400 * 30))  # someone else's
        assert mine.credential() == first
        assert f"ignored the new invitation in {path}: the invitation is for peer {other}" in caplog.text
        write(owner.invite(me, 60))  # shorter
        assert mine.credential() == first
        assert "it expires no later than the one held" in caplog.text
        longer = owner.invite(me, 86400 * 30)
        write(longer)
        assert mine.credential() == longer
        assert "renewed this peer's invitation: it expires in 30.0 days" in caplog.text
    theirs.admit(me, mine.credential())


def test_an_invitation_file_that_cannot_be_read_fails_at_start_by_name(tmp_path):
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    config = member(owner, tmp_path, "a")
    missing = str(tmp_path / "no-such-file")
    with pytest.raises(ConfigError, match="no invitation file .*no-such-file"):
        make_authorizer(owner.run_id, owner.public, missing, Invitation.verify(
            config.invite, owner_public_key(owner.public), owner.run_id).peer_id)
    with pytest.raises(ConfigError, match="cannot read the invitation file"):
        make_authorizer(owner.run_id, owner.public, str(tmp_path), "x")  # a directory


def test_an_invitation_cut_short_when_pasted_is_refused_saying_so(tmp_path):
    """A token whose start was lost was read as a file name ("cannot read the invitation file
    hKFy...", issue 41), one whose end was lost as "not signed by this run's owner"."""
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    token = member(owner, tmp_path, "a").invite
    peer = Invitation.verify(token, owner_public_key(owner.public), owner.run_id).peer_id
    cases = {token[5:]: "is neither an invitation (a token starts with 'inv1.': was its start cut off?) nor a file",
             token[:-3]: "is incomplete: its signature has 62 of 64 bytes",
             token[:40]: "is malformed or incomplete"}
    for cut, says in cases.items():
        with pytest.raises(ConfigError, match=re.escape(says)):
            make_authorizer(owner.run_id, owner.public, cut, peer)
    assert make_authorizer(owner.run_id, owner.public, token, peer).credential() == token


@pytest.mark.alone  # a 1 s grace: under a second test's load the member's proof could come later
def test_a_relay_drops_peers_that_show_no_invitation(tmp_path, caplog):
    """A relay of an invite-only run (relay_guard.py) keeps a member that proved itself (its DHT
    requests carry its invitation) and disconnects an uninvited peer once its grace is over; the
    peer coming back is disconnected at the next sweep, with no new grace."""
    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    async def scenario() -> tuple[list[list[str]], dict, str, str]:
        relay = await Node.create(member(owner, tmp_path, "relay", relay_service=True))
        nodes = [relay]
        try:
            maddrs = [str(a) for a in await relay.p2p.get_visible_maddrs()]
            m = await Node.create(member(owner, tmp_path, "m", initial_peers=tuple(maddrs)))
            nodes.append(m)
            stranger = await intruder(owner.run_id, maddrs)
            nodes.append(stranger)
            me, intruder_id = relay.peer_id.to_base58(), stranger.peer_id.to_base58()
            guard = RelayGuard(relay.p2p, relay.authorizer, me, grace=1.0)
            sweeps: list[list[str]] = []

            async def sweep_until_dropped() -> None:
                async with asyncio.timeout(20):
                    while intruder_id not in (dropped := await guard.sweep()):
                        sweeps.append(dropped)
                        await asyncio.sleep(0.2)
                    sweeps.append(dropped)

            assert intruder_id in await links.connections(relay.p2p)
            await sweep_until_dropped()
            first = len(sweeps)
            connected = await links.connections(relay.p2p)
            peer = Multiaddr(maddrs[0])["p2p"]
            await stranger.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(a.split("/p2p/")[0]) for a in maddrs])
            assert intruder_id in await links.connections(relay.p2p)
            await sweep_until_dropped()
            return sweeps[first:], connected, m.peer_id.to_base58(), intruder_id
        finally:
            for node in reversed(nodes):
                await node.shutdown()

    with caplog.at_level("INFO", logger="dedloc.net.relay_guard"):
        again, connected, member_id, intruder_id = asyncio.run(scenario())
    assert member_id in connected and intruder_id not in connected, connected  # the member stayed
    assert again == [[intruder_id]], again  # back again: dropped at the first sweep
    assert f"disconnected {intruder_id}: not a member of this run (showed no invitation within 1 s)" in caplog.text
    assert f"disconnected {intruder_id}: not a member of this run (came back without an invitation)" in caplog.text
    assert member_id not in caplog.text
