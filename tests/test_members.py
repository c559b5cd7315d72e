"""A malicious *invited* member, speaking the real protocol (docs/security.md, "What a member can
do"): each test is one attack that worked at b122246, with honest peers unaffected after."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading

import pytest
import torch

from conftest import bare_node, run_id
from dedloc.auth.invitation import RunOwner
from dedloc.config import BackboneConfig, OptimizerConfig, PeerConfig
from dedloc.optim.optimizer import CollaborativeOptimizer
from dedloc.peer import Peer
from dedloc.records import Role
from dedloc.roles.backbone import Backbone
from dedloc.state import lineage, snapshot
from test_membership import member
from dedloc.testing.members import AloneTaker, ClosingPeer, is_evil
from test_optimizer import AVG, N, Trainer, data, flat, join_all, make_model, make_opt

EVIL = 0.777


class Usurper(threading.Thread):
    """An invited member that joins like anyone (its optimizer downloads the run's state), then
    rewrites its parameters (every weight ``EVIL``) and its step (``ahead`` steps past the run's),
    and keeps publishing that progress and serving that state, as its real optimizer does.
    ``role``: the role it claims in its records (e.g. a backbone's, whose checkpoint step counted)."""

    def __init__(self, peer: Peer, cfg: OptimizerConfig, ahead: int = 1000, role: Role | None = None):
        super().__init__(daemon=True)
        self.peer, self.cfg, self.ahead, self.role = peer, cfg, ahead, role
        self.publishing, self.stop = threading.Event(), threading.Event()
        self.step = -1
        self.error: BaseException | None = None

    def run(self):
        try:
            model = make_model()
            opt, _ = make_opt(model)
            copt = CollaborativeOptimizer(opt, self.peer, self.cfg, model=model)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(EVIL)
            copt.global_step = copt.local.applied_step = self.step = copt.global_step + self.ahead
            copt.local.fingerprint = copt.local.hash()
            copt.local.lineage = lineage.extend({}, copt.local.fingerprint)
            if self.role is not None:
                record = copt._record
                copt._record = lambda busy: dataclasses.replace(record(busy), role=self.role)
            copt.offer_state()
            copt._report(busy=False)
            self.publishing.set()
            while not self.stop.wait(0.3):
                copt._report(busy=False)  # serves its state to whoever asks (the "wanted" flag)
        except BaseException as e:  # surfaced by the test
            self.error = e
            self.publishing.set()


def invite_only_run(tmp_path, checkpoint_interval: float):
    """The README's deployment of an invite-only run: its owner, a backbone with a backbone
    invitation pulling in the background, and the initial peers every other member is given."""
    torch.set_num_threads(1)
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    backbone = Backbone(member(owner, tmp_path, "backbone", backbone=True),
                        BackboneConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=checkpoint_interval), AVG)
    return owner, backbone, backbone.in_background(), dict(initial_peers=tuple(backbone.maddrs))


def evil_model() -> torch.Tensor:
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(EVIL)
    return flat(model)


@pytest.mark.timeout(300)
def test_a_member_publishing_step_plus_1000_with_its_own_weights_is_adopted_by_nobody(tmp_path, caplog, capfd):
    """At b122246 both honest trainers loaded such a state within a second and the backbone
    checkpointed it; so did a newcomer. Here one usurper publishes as a trainer, another claims a
    backbone's role without a backbone's invitation."""
    owner, backbone, pulling, joined = invite_only_run(tmp_path, checkpoint_interval=0.3)
    peers: list[Peer] = []
    usurpers: list[Usurper] = []
    attacking = threading.Event()
    steps, attack_at = 9, 3
    cfg = OptimizerConfig(target_batch_size=48)

    held: set[int] = set()

    def hold(opt):  # the honest trainers go on once both usurpers publish their far step
        if opt.global_step == attack_at:
            held.add(id(opt))
            attacking.wait(120)

    try:
        peers = [Peer(member(owner, tmp_path, f"honest{i}", **joined), AVG) for i in range(2)]
        # the honest trainers go one step past the newcomer's last: it ends on a step they still hold
        honest = [Trainer(i, p, cfg, micro=6, delay=0.02, steps=steps + 1, gate=hold) for i, p in enumerate(peers)]
        for t in honest:
            t.start()
        pause = threading.Event()
        while len(held) < 2 and not pause.wait(0.1):
            assert all(t.is_alive() for t in honest), "an honest trainer ended early"
        for name, role in (("usurper", None), ("fake-backbone", Role.BACKBONE)):
            peers.append(Peer(member(owner, tmp_path, name, **joined), AVG))
            usurpers.append(Usurper(peers[-1], cfg, role=role))
            usurpers[-1].start()
        for u in usurpers:
            assert u.publishing.wait(120) and u.error is None, f"the usurper failed: {u.error!r}"
        peers.append(Peer(member(owner, tmp_path, "newcomer", **joined), AVG))
        newcomer = Trainer(2, peers[-1], cfg, micro=6, delay=0.02, steps=steps)
        newcomer.start()  # it joins while the usurpers publish, before the honest trainers go on
        attacking.set()
        join_all(honest + [newcomer], timeout=200)
    finally:
        attacking.set()
        for u in usurpers:
            u.stop.set()
            u.join(30)
        pulling.stop()
        for p in peers:
            p.close()
        backbone.close()
    evil = evil_model()
    for t in honest + [newcomer]:
        assert max(t.params) == (steps if t is newcomer else steps + 1), f"trainer {t.index} jumped to step {max(t.params)}"
        assert not any(torch.equal(v, evil) for v in t.params.values()), f"trainer {t.index} loaded the usurper's weights"
        assert torch.equal(t.params[steps], honest[0].params[steps])
    assert backbone.step <= steps + 1 and all(s <= steps + 1 for s in backbone.store.steps())
    names = {u.peer.peer_id for u in usurpers}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(usurpers[0].peer.peer_id in w and "attests" in w for w in warned), warned
    assert f"peer {usurpers[1].peer.peer_id} publishes a backbone's record" in capfd.readouterr().err
    assert names  # both attacks ran


@pytest.mark.timeout(300)
def test_a_member_taking_each_step_alone_is_followed_by_nobody(tmp_path):
    """Stop 46 (bench/member_close.py): a member stored, at each step the run attested, a ``closed``
    record of a group of one (itself), and published and served that step's update applied with
    parameters of its own: every honest trainer missed each step and loaded its parameters (27
    resyncs in 12 steps). Now a group of one closes a step only for a peer that sees nobody else at
    it (matchmaking rule 13); at odd steps its record also names the honest trainers as members,
    without their signed joins, and still counts as a group of one. Nor does the backbone vouch
    for the member's steps ahead of three trainers (the run's step ran to its checkpoint + 64)."""
    owner, backbone, pulling, joined = invite_only_run(tmp_path, checkpoint_interval=0.5)
    peers: list[Peer] = []
    # the honest trainers take about a second per step: the member's record is stored before they are ready
    steps, cfg = 9, OptimizerConfig(target_batch_size=96)
    evil: AloneTaker | None = None
    try:
        peers = [Peer(member(owner, tmp_path, f"honest{i}", **joined), AVG) for i in range(3)]
        honest = [Trainer(i, p, cfg, micro=6, delay=0.1, steps=steps) for i, p in enumerate(peers)]
        peers.append(ClosingPeer(member(owner, tmp_path, "member", **joined), AVG))
        x, y = data()
        order = torch.randperm(N, generator=torch.Generator().manual_seed(99))
        at = [0]

        def micro_batch(model):
            ids = order[at[0]:at[0] + 6]
            at[0] = (at[0] + 6) % (N - 6)
            torch.nn.functional.mse_loss(model(x[ids]), y[ids]).backward()
            threading.Event().wait(0.02)
            return len(ids)

        model = make_model()
        evil = AloneTaker(peers[-1], model, make_opt(model)[0], cfg, micro_batch, attack_at=2,
                          others=lambda: tuple(p.peer_id for p in peers[:3]))
        for t in [*honest, evil]:
            t.start()
        join_all(honest, timeout=200)
    finally:
        if evil is not None:
            evil.stop.set()
            evil.join(30)
        pulling.stop()
        for p in peers:
            p.close()
        backbone.close()
    assert evil.error is None, f"the member failed: {evil.error!r}"
    assert len(evil.took) >= 3, f"the member took only steps {evil.took} alone"
    for t in honest:
        assert max(t.params) == steps
        assert not any(is_evil(v) for v in t.params.values()), f"trainer {t.index} loaded the member's weights"
        assert t.opt.resyncs == 0 and t.opt.catchups == 0, f"trainer {t.index} missed steps the member took alone"
        for s in range(steps + 1):
            assert torch.equal(t.params[s], honest[0].params[s]), f"trainers differ at step {s}"
    # (once the honest trainers have left, the member is the run: docs/security.md, what it still can do)
    kept = [s for s in backbone.store.steps() if s <= steps]
    assert kept and max(kept) >= steps - 1, backbone.store.steps()
    for s in kept:
        model = snapshot.decode(backbone.store.path(s).read_bytes())["model"]
        assert not is_evil(torch.cat([v.reshape(-1) for v in model.values()])), f"the backbone checkpointed the member's step {s}"


@pytest.mark.timeout(300)
def test_a_leader_answering_missed_without_a_group_that_closed_the_step_is_passed_over(tmp_path):
    """A member with the smallest peer id leads; it answered every join ``missed``, and each joiner
    took the step as missed and downloaded the only state past it (its own). Now a joiner checks
    (matchmaking rule 13): here one joiner gets a bare ``missed``, the other a ``closed`` record of
    the liar's group listing the joiner's own signed join (it never got that group); both find no
    group that closed the step for them, pass the liar over and take the step together."""
    from dedloc.auth.identity import create_identity
    from dedloc.records import Member, ReadyRecord

    keys = sorted((create_identity(tmp_path / f"p{i}.key"), tmp_path / f"p{i}.key") for i in range(3))
    (liar_id, liar_key), (a_id, a_key), (b_id, b_key) = keys
    rid = run_id()
    a = Peer(PeerConfig(run_id=rid, identity_path=str(a_key)), AVG)
    b = Peer(PeerConfig(run_id=rid, identity_path=str(b_key), initial_peers=tuple(a.maddrs)), AVG)
    asked: list[str] = []

    async def lie(node, finished):
        me = node.peer_id.to_base58()

        async def answer(remote, request):
            asked.append(remote.to_base58())
            if remote.to_base58() == a_id:
                return {"missed": True}
            return {"missed": True, "held": True,
                    "closed": {"members": [me, remote.to_base58()], "sigs": {remote.to_base58(): request["j"]}}}

        await node.streams.serve_requests(f"dedloc.{rid}.join", answer)
        await node.store(node.key("ready", 0), me, ReadyRecord(Member(me, 8.0, 1.0)).to_wire(), ttl=60)

    try:
        with bare_node(PeerConfig(run_id=rid, identity_path=str(liar_key), initial_peers=tuple(a.maddrs)), lie):
            with cf.ThreadPoolExecutor(2) as pool:
                runs = [pool.submit(p.average, torch.ones(4), step=0, weight=1.0, expected_peers=3, gather_time=2.0)
                        for p in (a, b)]
                stats = [r.result(timeout=90) for r in runs]
    finally:
        a.close()
        b.close()
    assert set(asked) == {a_id, b_id}, asked  # both asked the liar first
    assert [s.group_size for s in stats] == [2, 2], stats


def test_a_member_replaying_another_members_dht_request_800_times_gets_it_cut_off_no_more(tmp_path, caplog):
    """At b122246 the victim cut the *honest* member off ("too many DHT requests from B"): requests
    were bound to no recipient and no nonce was remembered. A replay is now refused before it counts."""
    import asyncio

    from hivemind.dht.protocol import DHTProtocol

    from dedloc.auth.dht import DHT_BURST
    from dedloc.config import PeerConfig
    from dedloc.net.node import Node

    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    def capturing(node, into):  # what the node's DHT receives, as a member sitting there sees it
        access = node.dht.protocol.authorizer
        validate = access.validate_request

        async def keep(request):
            copy = type(request)()
            copy.CopyFrom(request)
            into.append(copy)
            return await validate(request)
        access.validate_request = keep

    async def main():
        a = await Node.create(member(owner, tmp_path, "a"))
        maddrs = tuple(await a.visible_maddrs())
        b, m = [await Node.create(PeerConfig(**{**member(owner, tmp_path, n).__dict__, "initial_peers": maddrs}))
                for n in ("b", "m")]
        try:
            at_m, at_a = [], []
            capturing(m, at_m)
            capturing(a, at_a)
            assert await b.dht.protocol.call_ping(m.peer_id, validate=False) is not None
            assert await b.dht.protocol.call_ping(a.peer_id, validate=False) is not None
            sent_to_m, sent_to_a = at_m[-1], at_a[-1]
            raw = super(DHTProtocol, m.dht.protocol).get_stub(m.p2p, a.peer_id)  # sends what it is given, unsigned
            replays = int(DHT_BURST) + 300
            for captured in (sent_to_m,) * replays + (sent_to_a,) * 10:
                try:
                    answer = await raw.rpc_ping(captured)
                except Exception:
                    answer = None
                assert answer is None or not answer.peer.node_id, "a replay was answered"
            assert await b.dht.protocol.call_ping(a.peer_id, validate=False) is not None  # b is not cut off
            return b.peer_id.to_base58()
        finally:
            await m.shutdown()
            await b.shutdown()
            await a.shutdown()

    with caplog.at_level("DEBUG", logger="dedloc.auth.dht"):
        honest = asyncio.run(main())
    assert f"from {honest}: it is addressed to another peer" in caplog.text
    assert f"from {honest}: it was already received (a replay)" in caplog.text
    assert "too many DHT requests" not in caplog.text


def test_a_record_planted_for_ten_years_is_refused_and_a_revoked_members_records_are_not_read(tmp_path, caplog):
    """At b122246 a member's record with a 10-year life was stored, and members still read it after
    the member was revoked."""
    import asyncio

    from dedloc.auth.records import MAX_LIFE
    from dedloc.config import PeerConfig
    from dedloc.net.node import Node

    owner = RunOwner.init(str(tmp_path / "run"), run_id())

    async def main():
        a = await Node.create(member(owner, tmp_path, "a", revocations=str(tmp_path / "run" / "revoked")))
        m = await Node.create(PeerConfig(**{**member(owner, tmp_path, "m").__dict__,
                                            "initial_peers": tuple(await a.visible_maddrs())}))
        try:
            key, me = a.key("progress"), m.peer_id.to_base58()
            assert not await m.store(key, me, {"step": 5}, 10 * 365 * 86400.0)
            assert await m.store(key, me, {"step": 5}, MAX_LIFE / 2)
            assert (await a.get(key))[me][0] == {"step": 5}
            owner.revoke(me)
            await a.revocations.refresh()
            return me, await a.get(key)
        finally:
            await m.shutdown()
            await a.shutdown()

    with caplog.at_level("WARNING", logger="dedloc.auth.records"):
        planter, after = asyncio.run(main())
    assert f"the record under {planter} would live" in caplog.text
    assert planter not in after


def test_a_donor_announcing_60_gib_costs_only_what_it_sends(tmp_path):
    """At b122246 a donor announcing a state just under the 64 GiB cap made a requester without
    ``max_bytes`` allocate it all: MemoryError, nothing logged. Memory now follows the bytes sent."""
    from conftest import bare_node
    from dedloc.config import AveragingConfig, PeerConfig
    from dedloc.errors import StateError
    from dedloc.net import messages

    rid = run_id()
    good = Peer(PeerConfig(run_id=rid), AveragingConfig(probe_interval=0))
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), AveragingConfig(probe_interval=0))

    async def serve(node, finished):
        async def answer(info, reader, writer):
            await messages.read_message(reader)
            await messages.write_message(writer, {"step": 3, "size": 60 << 30, "lineage": []})
            writer.write(b"\0" * (1 << 20))  # a little of it, then it hangs up
            await writer.drain()
            return True

        await node.streams.serve(f"dedloc.{rid}.state", answer)

    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), serve) as donor:
            with pytest.raises(StateError, match=donor) as refused:
                newcomer.download_state([donor], 3, timeout=30)
        assert "MemoryError" not in str(refused.value), refused.value
    finally:
        newcomer.close()
        good.close()
