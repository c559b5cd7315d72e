"""Regressions from the chaos soak (bench/chaos.py): restarts, freezes, forks and rounds lost by all."""

import asyncio
import concurrent.futures as cf
import contextlib
import os
import signal
import threading
import time

import pytest
import torch

from dedloc.averaging.join_answer import JoinAnswer
from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.errors import ForkError, LeftToTrainersError, MatchmakingError, MissedRoundError, StateError
from dedloc.auth.identity import create_identity, load_identity, peer_id_of
from dedloc.optim import CollaborativeOptimizer
from dedloc.optim import step_rules
from dedloc.optim.optimizer import StepOutcome
from dedloc.peer import Peer
from dedloc.records import ProgressRecord, Role

from conftest import bare_node, run_id, wait_for
from test_optimizer import Trainer, join_all, make_model, make_opt

AVG = AveragingConfig(matchmaking_time=2, averaging_timeout=20, probe_interval=0)


def session_signal(peer: Peer, sig: int) -> None:
    """Send ``sig`` to a peer's whole background session: its runtime and its p2p daemon."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == peer.runtime.pid:
                    os.kill(int(entry), sig)
            except OSError:
                pass


def test_a_peer_restarted_after_leaving_is_visible_at_once(tmp_path):
    """A clean stop leaves a 'left' mark for 2 x ttl; it must hide only the records from before it."""
    rid = run_id()
    first = Peer(PeerConfig(run_id=rid), AVG)
    key = str(tmp_path / "b.key")
    cfg = PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs), identity_path=key)
    try:
        b = Peer(cfg, AVG)
        b.publish_progress(3, 8, 1.0)
        b.leave()
        assert b.peer_id not in {r.peer_id for r in first.collaboration().peers}
        b.close()
        again = Peer(cfg, AVG)
        try:
            assert again.peer_id == b.peer_id
            again.publish_progress(3, 16, 1.0)
            seen = {r.peer_id: r for r in first.collaboration().peers}
            assert again.peer_id in seen and seen[again.peer_id].samples == 16
        finally:
            again.close()
    finally:
        first.close()


def ordered_identities(tmp_path, n: int = 2) -> list:
    """Identity files for ``n`` peers, sorted by peer id (the first leads: it has the smallest)."""
    keys = [tmp_path / f"peer{i}.key" for i in range(n)]
    return [k for _, k in sorted((create_identity(k), k) for k in keys)]


def test_a_restarted_peer_is_not_handed_its_predecessors_group(tmp_path):
    """The leader answers a member's new process with 'missed', not the group its predecessor joined
    (that group holds the old process's weight: the round then failed on a weight mismatch)."""
    lead_key, member_key = ordered_identities(tmp_path)  # the leader has the smaller id
    rid = run_id()
    leader = Peer(PeerConfig(run_id=rid, identity_path=str(lead_key)), AVG)
    cfg = PeerConfig(run_id=rid, initial_peers=tuple(leader.maddrs), identity_path=str(member_key))
    member = Peer(cfg, AVG)
    try:
        results = {}
        threads = [threading.Thread(target=lambda p=p, w=w: results.update(
            {p.peer_id: p.average(torch.full((64,), w), step=0, weight=w, expected_peers=2)}))
            for p, w in ((leader, 1.0), (member, 3.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 2 and results[leader.peer_id].group_size == 2
        member.close()
        member = Peer(cfg, AVG)
        with pytest.raises(MissedRoundError):
            member.average(torch.ones(64), step=0, weight=5.0, expected_peers=2, gather_time=1.0)
    finally:
        member.close()
        leader.close()


def test_a_peer_suspended_during_matchmaking_does_not_take_the_step_alone():
    """Frozen (SIGSTOP of the whole peer) past the step's records' lifetime, a peer wakes up to a step
    whose ready/closed records expired: it must not lead a group of one and rewrite the step, nor
    store a closed record for a group that will never run."""
    avg = AveragingConfig(matchmaking_time=1, averaging_timeout=3, probe_interval=0)  # records live 9 s
    peer = Peer(PeerConfig(run_id=run_id()), avg)
    try:
        future, _ = peer.average_async(torch.ones(16), step=0, weight=1.0, expected_peers=2, gather_time=3.0)
        while not peer.pending_round(0):  # its ready entry is stored: it is matchmaking now
            assert not future.done(), future.result()
        session_signal(peer, signal.SIGSTOP)
        try:
            threading.Event().wait(12)  # a suspended laptop: nothing to synchronise with
        finally:
            session_signal(peer, signal.SIGCONT)
        with pytest.raises(MatchmakingError, match="suspended"):
            future.result(60)
        # and it closed nothing: a closed record of a group that never ran would hold the others'
        # decisions on the step for a round's length (the delayed soak's 33 s frozen leader)
        assert peer.round_deadline(0) is None and peer.closed_round(0) == {}
    finally:
        peer.close()


def test_a_failed_round_whose_state_every_peer_holds_downloads_nothing():
    """A round that failed for every member leaves each with the state of its step: resyncing must
    drop the gradients without asking anyone for that same state (peers that all held step 50 waited
    on each other for minutes)."""
    peer = Peer(PeerConfig(run_id=run_id()), AVG)
    try:
        model = make_model()
        opt, sched = make_opt(model)
        copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=10_000, state_timeout=5),
                                      scheduler=sched, model=model)
        model[0].weight.sum().backward()
        copt.step(8)
        assert copt.acc.samples == 8
        started = time.monotonic()
        copt._resync(peer.collaboration(), "step 0 failed: every member lost the round")
        assert copt.acc.samples == 0 and copt.resyncs == 0 and copt.applied_step == 0
        assert time.monotonic() - started < 5, "it waited for a donor (state_timeout) instead of returning"
        copt.close()
    finally:
        peer.close()


@pytest.mark.timeout(240)
def test_a_fork_is_refused_and_the_forked_peer_steps_back():
    """A peer that took steps alone from an old state (a newcomer that saw only a stale checkpoint)
    shows up ahead of the collaboration: the others must not adopt its history, and it must go back
    to theirs. Before lineages, the others saw 'the collaboration is at step 22' and downloaded it."""
    torch.set_num_threads(1)
    rid = run_id()
    a = Peer(PeerConfig(run_id=rid), AVG)
    b = Peer(PeerConfig(run_id=rid, initial_peers=tuple(a.maddrs)), AVG)
    e = Peer(PeerConfig(run_id=rid, initial_peers=tuple(a.maddrs)), AVG)
    cfg = OptimizerConfig(target_batch_size=32)
    at_two: dict = {}
    try:
        def keep(step):
            if step == 2 and not at_two:
                at_two["state"] = ta.opt.state_dict()

        ta = Trainer(0, a, cfg, 8, delay=0.5, steps=16, on_step=keep)
        tb = Trainer(1, b, cfg, 8, delay=0.5, steps=16)
        ta.start()
        tb.start()
        deadline = time.monotonic() + 60
        while "state" not in at_two:
            assert time.monotonic() < deadline and ta.is_alive(), "the collaboration never reached step 2"
            time.sleep(0.05)
        # the fork: step 2's state, then twenty steps alone in a run of its own
        alone = Peer(PeerConfig(run_id=run_id()), AveragingConfig(matchmaking_time=0.3, probe_interval=0))
        forked = {}
        try:
            model = make_model()
            opt, sched = make_opt(model)
            solo = CollaborativeOptimizer(opt, alone, OptimizerConfig(target_batch_size=8), scheduler=sched,
                                          model=model)
            solo.load_state_dict(at_two["state"])
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
            while solo.applied_step < 22:
                model(x).pow(2).mean().backward()
                solo.step(8)
                forked[solo.applied_step] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
            fork_state = solo.state_dict()
            solo.close()
        finally:
            alone.close()
        assert ta.opt.applied_step < 20, "the collaboration outran the fork; the test needs it ahead"

        def inject(copt):
            if not getattr(inject, "done", False):
                inject.done = True
                copt.load_state_dict(fork_state)

        te = Trainer(2, e, cfg, 8, delay=0.5, steps=16, gate=inject)
        te.start()
        join_all([ta, tb, te], timeout=200)
        for t in (ta, tb):
            for step, params in t.params.items():
                assert not (step in forked and torch.equal(params, forked[step])), \
                    f"peer {t.index} adopted the fork's step {step}"
        final = max(set(ta.params) & set(tb.params) & set(te.params))
        assert final == 16
        assert torch.equal(ta.params[final], tb.params[final]) and torch.equal(ta.params[final], te.params[final])
        assert te.opt.resyncs >= 1, "the forked peer never stepped back"
    finally:
        for p in (a, b, e):
            p.close()


@pytest.mark.timeout(240)
def test_a_step_lost_by_every_member_is_skipped_by_all():
    """Delayed updates: when a round fails for every member (a ring member killed mid-round), nobody
    holds the next state. The members agree that the step is lost and go on, identical, from the
    state they share, instead of waiting state_timeout for a donor and raising StateError.

    A fourth peer is resyncing all along, publishing step 2 (the soak: a peer that waited for a later
    state kept the others waiting state_timeout, counted as one that "may still take" the lost step):
    it must not hold up the decision. A fifth publishes step 2 as an ordinary trainer that never takes
    its round (in the delayed soak, a peer held back by its own catch-up, which waited on the others'
    decision: 2 minutes): it holds the decision up for a round's length at most. state_timeout exceeds
    the test's wait, so waiting on either fails."""
    torch.set_num_threads(1)
    rid = run_id()
    avg = AveragingConfig(matchmaking_time=2, averaging_timeout=10, strategy="ring", probe_interval=0)
    peers = [Peer(PeerConfig(run_id=rid), avg)]
    peers += [Peer(PeerConfig(run_id=rid, initial_peers=tuple(peers[0].maddrs)), avg) for _ in range(4)]
    cfg = OptimizerConfig(target_batch_size=48, delay_updates=True, state_timeout=400)
    resyncing = threading.Event()

    def publish_resyncing() -> None:  # what a peer inside _resync publishes, and one stuck at step 2
        while not resyncing.wait(0.5):
            peers[3].report(ProgressRecord(peers[3].peer_id, 2, 0, 0.0, Role.TRAINER, time=time.time(), syncing=True))
            peers[4].report(ProgressRecord(peers[4].peer_id, 2, 8, 1.0, Role.TRAINER, time=time.time()))
    results: dict[int, dict] = {}
    done = threading.Barrier(2, timeout=120)

    def train(i: int) -> None:
        try:
            model = torch.nn.Linear(2048, 4096, bias=False)  # 8M parameters: a round lasts long enough
            with torch.no_grad():  # the same start on every peer (threads: not the global RNG)
                model.weight.copy_(0.01 * torch.randn(4096, 2048, generator=torch.Generator().manual_seed(0)))
            copt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), peers[i], cfg, model=model)
            gen = torch.Generator().manual_seed(i)
            prints = {copt.applied_step: copt.local.fingerprint}
            while copt.global_step < 6:
                model(torch.randn(8, 2048, generator=gen)).pow(2).mean().backward()
                copt.step(8)
                prints.setdefault(copt.applied_step, copt.local.fingerprint)
            copt.offer_state()  # a survivor behind may still need this state: serve it until both are done
            done.wait()
            copt.close()
            prints[copt.applied_step] = copt.local.fingerprint
            results[i] = {"prints": prints, "skipped": copt.skipped_steps,
                          "history": [(r.step, r.skipped) for r in copt.history]}
        except Exception as e:  # the victim's thread ends here once its runtime is killed
            results[i] = {"error": e}

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(3)]
    threads.append(threading.Thread(target=publish_resyncing, daemon=True))
    try:
        for t in threads[:3]:
            t.start()
        deadline = time.monotonic() + 120
        while not any(peers[2].peer_id in m for m in peers[0].closed_round(2).values()):
            assert time.monotonic() < deadline, "step 2's group never formed"
            time.sleep(0.01)
        threads[3].start()  # from here on, peers 3 and 4 publish step 2 (3 while it waits for a later state)
        peers[2].runtime.kill()  # mid-round: the ring cannot complete for anyone
        for t in threads[:2]:
            t.join(200)
        assert not any(t.is_alive() for t in threads[:2]), "the survivors are still waiting for a donor"
        assert "error" not in results[0] and "error" not in results[1], results
        a, b = results[0], results[1]
        # each survivor skipped step 2 itself, or took it skipped inside the other's state
        assert a["skipped"] + b["skipped"] >= 1
        common = set(a["prints"]) & set(b["prints"])
        # both went on past the lost step 2 from one state: they share a later step, and agree at every
        # step they share (with delayed updates a peer that stops at global step 6 may not have applied
        # step 6 yet, and a peer that caught up by download skips the steps in between: 5 is shared)
        assert max(common) >= 5 and all(a["prints"][s] == b["prints"][s] for s in common), \
            ("the survivors' parameters differ at some step", sorted(a["prints"]), sorted(b["prints"]))
        for r in (a, b):
            for step, skipped in r["history"]:
                if skipped and step + 1 in r["prints"] and step in r["prints"]:  # parameters as they were
                    assert r["prints"][step].split(":")[1] == r["prints"][step + 1].split(":")[1]
    finally:
        resyncing.set()
        if threads[3].is_alive():
            threads[3].join(10)
        for p in peers:
            p.close()


def test_a_stalled_donor_is_given_up_after_stall_wait_but_a_slow_steady_one_is_not():
    """A donor frozen after its header (a stopped laptop) once held a newcomer for all of
    state_timeout: the bytes had no bound of their own. Now the next donor is tried after STALL_WAIT.
    STALL_WAIT bounds silence, not speed: a donor that keeps sending, however slowly (a byte a
    second, 23 s in all, past the 20 s bound), completes its download. The two downloads run at once."""

    from dedloc.net import messages

    rid = run_id()
    good = Peer(PeerConfig(run_id=rid), AVG)
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), AVG)
    blob = bytes(range(23))

    async def stall(node, finished):
        async def serve(info, reader, writer):
            await messages.read_message(reader)
            await messages.write_message(writer, {"step": 3, "size": 1 << 20})
            writer.write(b"x" * 100)  # a start, then nothing more
            await writer.drain()
            await asyncio.to_thread(finished.wait, 120)
            writer.close()

        await node.streams.serve(f"dedloc.{rid}.state", serve)

    async def trickle(node, finished):
        async def serve(info, reader, writer):
            await messages.read_message(reader)
            await messages.write_message(writer, {"step": 4, "size": len(blob)})
            for b in blob:
                writer.write(bytes([b]))
                await writer.drain()
                await asyncio.sleep(1.0)  # a slow link: a byte a second (pacing, not synchronisation)
            await messages.wait_peer_closed(reader, 30)
            writer.close()

        await node.streams.serve(f"dedloc.{rid}.state", serve)

    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), stall) as staller, \
                bare_node(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), trickle) as slow, \
                cf.ThreadPoolExecutor(1) as pool:
            good.offer_state(3, b"a state of step 3")
            slowly = pool.submit(newcomer.download_state, [slow], 4, 90)
            assert newcomer.download_state([staller, good.peer_id], 3, timeout=60) == \
                (3, b"a state of step 3", good.peer_id)
            assert slowly.result(90) == (4, blob, slow)
    finally:
        newcomer.close()
        good.close()


def test_a_donor_that_starts_resyncing_answers_a_waiting_requester_at_once():
    """A requester asks for a state newer than the donor has cached; the donor's training loop is at
    that step, so it waits (up to FRESH_WAIT, 15 s) for the loop's next state. In the fork test's
    failure the loop then stepped back (a forked peer resyncing): it would never produce that step,
    and two honest peers were held the whole 15 s while the others took their steps. Now the donor
    answers ``behind`` as soon as its loop resyncs. The requester's deadline (8 s) is shorter than
    FRESH_WAIT: without that, it ends with no answer instead."""
    rid = run_id()
    donor = Peer(PeerConfig(run_id=rid), AVG)
    requester = Peer(PeerConfig(run_id=rid, initial_peers=tuple(donor.maddrs)), AVG)
    try:
        donor.offer_state(3, b"a state of step 3")
        record = ProgressRecord(donor.peer_id, 6, 0, 0.0, Role.TRAINER, time=time.time())
        donor.report(record)
        result: dict = {}

        def ask() -> None:
            try:
                requester.download_state([donor.peer_id], 6, timeout=8)
            except StateError as e:
                result["error"] = str(e)

        asking = threading.Thread(target=ask)
        asking.start()
        deadline = time.monotonic() + 8
        while not donor.report(record)[1]:  # the donor flags its state as wanted once the request waits
            assert time.monotonic() < deadline, "the request never reached the donor"
            time.sleep(0.05)
        donor.report(ProgressRecord(donor.peer_id, 6, 0, 0.0, Role.TRAINER, time=time.time(), syncing=True))
        asking.join(30)
        assert f"{donor.peer_id}: StateError: no state at step >= 6" in result["error"], result
    finally:
        requester.close()
        donor.close()


def test_a_step_most_peers_already_took_is_missed_even_after_its_closed_records_expired():
    """The sync soak's lost step: a trainer froze between reading the collaboration's step and asking
    for that step's round, longer than the round's closed records live. Waking, it saw no group and
    took the step alone, a fork of one. The others' progress records say they hold the parameters
    after that step: now that is a missed round. One peer alone ahead (a forked peer, before it
    steps back) is not the collaboration, and does not close the step."""
    rid = run_id()
    peers = [Peer(PeerConfig(run_id=rid), AVG)]
    peers += [Peer(PeerConfig(run_id=rid, initial_peers=tuple(peers[0].maddrs)), AVG) for _ in range(2)]
    late, a, b = peers

    def publish(peer: Peer, applied: int) -> None:
        peer.report(ProgressRecord(peer.peer_id, applied, 0, 1.0, Role.TRAINER, time=time.time(),
                                   fingerprint=f"{applied}:{'ab' * 8}"))
    try:
        publish(a, 6)
        publish(b, 6)
        with pytest.raises(MissedRoundError, match="step 5: the collaboration already took it"):
            late.average(torch.ones(4), step=5, weight=1.0, expected_peers=1)
        publish(a, 5)
        publish(b, 22)
        with pytest.raises(MatchmakingError, match="not taken by a group of one contributor"):  # a trainer at the step: rule 14
            late.average(torch.ones(4), step=5, weight=1.0, expected_peers=1)
        publish(a, 5)  # it is alive (it publishes), yet does not join: the second time the step is taken
        stats = late.average(torch.ones(4), step=5, weight=1.0, expected_peers=1)
        assert stats.group_size == 1
    finally:
        for p in peers:
            p.close()


def test_a_lead_of_one_that_saw_no_ready_peer_still_misses_a_step_another_group_closed():
    """The delayed soak's lost steps 95-98: a trainer led step 95 alone while three others took it
    together; their ready records never reached it (it had woken from a freeze 12 s before), so the
    checks for a lead that ready peers never joined did not run. Now a lead of one also runs them
    when the progress records show another training peer at the step: here a bare node publishes
    one, and stores the closed record of a group without this peer while it leads."""
    from dedloc.records import ClosedRecord

    rid = run_id()
    avg = AveragingConfig(matchmaking_time=3, averaging_timeout=20, probe_interval=0)
    peer = Peer(PeerConfig(run_id=rid), avg)

    async def other_group(node, finished):  # a trainer at step 0 whose group closes it during the lead
        me = node.peer_id.to_base58()
        record = ProgressRecord(me, 0, 8, 1.0, Role.TRAINER, fingerprint="0:feedbeef", time=time.time())
        await node.store(node.key("progress"), me, record.to_wire(), ttl=60.0)

        async def close_while_it_leads():
            while peer.peer_id not in await node.get(node.key("ready", 0)):
                await asyncio.sleep(0.05)
            # its gather (1 s) and lead (3 s) windows follow its ready record: store inside the lead,
            # after the look that ends the gather (pacing with a second of margin on either side)
            await asyncio.sleep(2.0)
            await node.store(node.key("closed", 0), me, ClosedRecord(me, (me, "12D3KooWother"),
                                                                     time.time() + 20).to_wire(), ttl=60.0)

        asyncio.get_running_loop().create_task(close_while_it_leads())

    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs)), other_group) as other:
            deadline = time.monotonic() + 20
            while not any(r.peer_id == other for r in peer.collaboration().peers):
                assert time.monotonic() < deadline, "the other trainer's record never showed"
                time.sleep(0.1)
            with pytest.raises(MissedRoundError, match=f"step 0: the round led by {other} closed without this peer"):
                peer.average(torch.ones(4), step=0, weight=1.0, expected_peers=2, gather_time=1.0)
    finally:
        peer.close()


def test_a_closed_record_outliving_its_failed_round_closes_nothing():
    """The sync soak's 66 s stall: a leader closed step 119, froze, and stored its closed record
    when it woke; its round failed for every member, but the record kept the step closed for its
    whole TTL, and every retry was "missed". The record now carries the round's deadline: past it,
    it closes the step only if a member that can hand it on (not a client) holds the step's update."""
    from dedloc.records import ClosedRecord

    rid = run_id()
    late = Peer(PeerConfig(run_id=rid), AVG)
    member = Peer(PeerConfig(run_id=rid, initial_peers=tuple(late.maddrs)), AVG)
    stored = threading.Event()

    async def frozen_leader(node, finished):  # rounds it led for steps 0 and 1, both over a minute ago
        me = node.peer_id.to_base58()
        for step in (0, 1, 2):
            record = ClosedRecord(me, tuple(sorted((me, member.peer_id))), until=time.time() - 60)
            await node.store(node.key("closed", step), me, record.to_wire(), ttl=120)
        stored.set()

    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(late.maddrs)), frozen_leader) as leader:
            assert stored.is_set()
            # step 0's round failed: no member holds its update, so the record closes nothing
            member.report(ProgressRecord(member.peer_id, 0, 0, 1.0, Role.TRAINER, time=time.time(),
                                         fingerprint="0:" + "ab" * 8))
            assert late.closed_round(0) == {}
            with pytest.raises(MatchmakingError, match="not taken by a group of one contributor"):  # the member is at step 0
                late.average(torch.ones(4), step=0, weight=1.0, expected_peers=1)
            member.report(ProgressRecord(member.peer_id, 0, 0, 1.0, Role.TRAINER, time=time.time(),
                                         fingerprint="0:" + "ab" * 8))  # alive, not joining: taken the second time
            assert late.average(torch.ones(4), step=0, weight=1.0, expected_peers=1).group_size == 1
            # step 1's round succeeded for its member (it holds the update of step 1): the step stays closed
            member.report(ProgressRecord(member.peer_id, 2, 0, 1.0, Role.TRAINER, time=time.time(),
                                         fingerprint="2:" + "cd" * 8))
            assert leader in late.closed_round(1)
            # (missed by the record, or by the member's progress: the record names the member without its
            # signed join, which this test cannot make, so it counts as a group of one: rule 13)
            with pytest.raises(MissedRoundError, match=f"step 1: (the round led by {leader} closed without this peer|"
                                                       f"the collaboration already took it)"):
                late.average(torch.ones(4), step=1, weight=1.0, expected_peers=1)
            # step 2's update is held by a client-mode member only: nobody can download it, so past the
            # round the record closes nothing (in a CI soak a client held step 9's update, waiting for a
            # trainer to reach step 10, and the step stayed closed for everyone else for 76 s)
            member.report(ProgressRecord(member.peer_id, 3, 0, 1.0, Role.CLIENT, time=time.time(),
                                         fingerprint="3:" + "ef" * 8))
            assert late.closed_round(2) == {}
    finally:
        member.close()
        late.close()


def test_a_follower_leading_past_its_deadline_still_sees_the_group_that_took_the_step():
    """The delayed soak's fork at step 153: the smallest peer was killed mid-matchmaking, and its
    followers' stream opens to it hung until their join deadline. Each then led past that deadline,
    so its lead loop never read the ready records, saw no one unjoined, skipped the look at the
    closed records, and took the step alone: two groups of one. Now such a lead reads the ready
    records once, and misses the step that a group of others took."""
    from dedloc.averaging.matchmaking import Matchmaker
    from dedloc.records import Member, ReadyRecord

    rid = run_id()
    a = Peer(PeerConfig(run_id=rid), AVG)
    b = Peer(PeerConfig(run_id=rid, initial_peers=tuple(a.maddrs)), AVG)
    outcome: dict = {}

    async def late_lead(node, finished):
        me = node.peer_id.to_base58()
        mm = Matchmaker(node, AVG, share=1.0)
        member = Member(me, 8.0, 1.0)
        await node.store(node.key("ready", 0), me, ReadyRecord(member).to_wire(), ttl=60)
        loop = asyncio.get_running_loop()
        try:  # what _run_follow does once every leader it tried failed, its deadline already past
            outcome["group"] = await mm._run_lead(0, member, None, loop.time() - 1, 4, 20.0)
        except MissedRoundError as e:
            outcome["missed"] = str(e)

    try:
        with cf.ThreadPoolExecutor(2) as pool:
            stats = list(pool.map(lambda p: p.average(torch.ones(4), step=0, weight=8.0, expected_peers=2), (a, b)))
        assert all(s.group_size == 2 for s in stats)
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(a.maddrs)), late_lead):
            pass
        assert "group" not in outcome, "it took step 0 alone, beside the group that took it"
        assert "closed without this peer" in outcome["missed"], outcome
    finally:
        b.close()
        a.close()


@pytest.mark.timeout(240)
def test_a_client_whose_round_failed_does_not_run_ahead_alone():
    """Delayed updates: a client-mode peer whose round failed (the reachable trainer was not there)
    moved on alone, skipping steps no one else skipped; every resync then chased its step, which no
    peer could send (clients accept no streams): trainers crashed with 'no donor is advertising it'.
    Now the client holds its round until a reachable trainer reaches its step, the trainer takes the
    step, and the client takes it with the trainer: one history."""
    torch.set_num_threads(1)
    rid = run_id()
    a = Peer(PeerConfig(run_id=rid), AVG)
    c = Peer(PeerConfig(run_id=rid, initial_peers=tuple(a.maddrs), client_mode=True), AVG)
    cfg = OptimizerConfig(target_batch_size=32, delay_updates=True, state_timeout=20)
    tc = None

    def pause_at_two(copt):  # the trainer stalls (a busy laptop) until the client has shown what it does
        if copt.global_step == 2 and not getattr(pause_at_two, "done", False):
            pause_at_two.done = True
            deadline = time.monotonic() + 25  # within the trainer's record's lifetime (progress_ttl)
            while time.monotonic() < deadline and not tc.opt._noted.seen(tc.opt.global_step, "held back") and not tc.opt.skipped_steps \
                    and tc.opt.global_step < 4:
                time.sleep(0.05)

    try:
        ta = Trainer(0, a, cfg, 8, delay=0.1, steps=6, gate=pause_at_two)
        tc = Trainer(1, c, cfg, 8, delay=0.1, steps=6)
        ta.start()
        tc.start()
        join_all([ta, tc], timeout=200)
        assert tc.opt.skipped_steps == 0, "the client skipped a step the trainer took"
        assert ta.opt.resyncs == 0, "the trainer chased the client's step"
        common = set(ta.params) & set(tc.params)
        assert max(common) == 6
        for step in sorted(common):
            assert torch.equal(ta.params[step], tc.params[step]), f"the peers differ after step {step}"
    finally:
        for p in (a, c):
            p.close()


def test_a_round_of_clients_and_aggregators_alone_does_not_close_the_step(make_peers):
    """A client and an aggregator-only peer took a step while the reachable trainers were slow to
    join: nobody could download that step, yet its closed record told the trainers they had missed
    it, and each retry was 'missed' again until the record expired (a 63 s stall in the soak). Now
    such a group closes the step for its members alone, and the trainer forms a group of its own."""

    trainer, client, aggregator = make_peers(3, clients=(1,), averaging=AVG)
    with cf.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(client.average, torch.ones(4), step=0, weight=8.0, expected_peers=2),
                pool.submit(aggregator.average, torch.zeros(4), step=0, weight=0.0, expected_peers=2)]
        stats = [r.result(60) for r in runs]
    assert sorted(stats[0].peers) == sorted([client.peer_id, aggregator.peer_id])
    # their ready records are still up, and they never joined: the trainer declines once (rule 14)
    with pytest.raises(MatchmakingError, match="not taken by a group of one contributor"):
        trainer.average(torch.full((4,), 3.0), step=0, weight=8.0, expected_peers=1)
    late = trainer.average(torch.full((4,), 3.0), step=0, weight=8.0, expected_peers=1)
    assert late.peers == (trainer.peer_id,)


def test_a_round_of_clients_and_aggregators_is_left_to_a_trainer_at_the_step(make_peers):
    """The delayed soak's lost step 314: the trainers, catching up, were at step 314 but not yet
    ready when a client and the aggregator took it (a group that holds no state); the trainers took
    it 5 s later with other samples, and the client forked. Now such a group does not close while
    the progress records show a trainer at the step: the client and the aggregator are told so, and
    the step is taken once, by one group with the trainer in it."""
    trainer, client, aggregator = make_peers(3, clients=(1,), averaging=AVG)
    trainer.report(ProgressRecord(trainer.peer_id, 0, 8, 1.0, Role.TRAINER, time=time.time(), fingerprint="0:" + "ab" * 8))
    deadline = time.monotonic() + 20
    while not any(r.peer_id == trainer.peer_id for r in aggregator.collaboration().peers):
        assert time.monotonic() < deadline, "the trainer's progress record never showed"
        time.sleep(0.1)
    with cf.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(client.average, torch.ones(4), step=0, weight=8.0, expected_peers=2),
                pool.submit(aggregator.average, torch.zeros(4), step=0, weight=0.0, expected_peers=2)]
        with pytest.raises(MatchmakingError, match="closed with no member that can hand its state on"):
            runs[0].result(60)  # before: averaged by the client and the aggregator alone
        with pytest.raises(LeftToTrainersError, match=f"step 0: left to the trainers at it \\({trainer.peer_id}\\)"):
            runs[1].result(60)
        runs = [pool.submit(p.average, torch.full((4,), float(i)), step=0, weight=w, expected_peers=3)
                for i, (p, w) in enumerate([(trainer, 8.0), (client, 8.0), (aggregator, 0.0)])]
        stats = [r.result(60) for r in runs]
    assert all(sorted(s.peers) == sorted([trainer.peer_id, client.peer_id, aggregator.peer_id]) for s in stats), stats


def catching_up_on_step_0(peer: Peer, state_timeout: float) -> tuple[CollaborativeOptimizer, cf.Future]:
    """A delayed-updates optimizer whose round 0 failed in the background: at global step 1 with 8
    samples accumulated for it, and a failed catch-up download to hand to ``CatchUp``."""
    model = make_model()
    opt, sched = make_opt(model)
    copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=10_000, delay_updates=True,
                                                             state_timeout=state_timeout),
                                  scheduler=sched, model=model)
    copt.global_step = 1
    model[0].weight.sum().backward()
    copt.step(8)
    failed: cf.Future = cf.Future()
    failed.set_exception(StateError("no state at step >= 1"))
    return copt, failed


def test_a_missed_step_whose_only_holder_vanished_is_skipped_not_awaited():
    """Delayed updates: round s reached one member and failed for the rest; that member then died
    (kill -9). The others had switched from catching up to a blocking resync demanding step s+1,
    which nobody alive would ever hold: they waited, then raised, and the collaboration rewound to
    the backbone's checkpoint (a 258 s stall in the soak). Now a catch-up retries while a holder is
    alive and skips the step, gradients kept, once none is."""

    from dedloc.optim.state_sync import CatchUp

    rid = run_id()
    peer = Peer(PeerConfig(run_id=rid), AVG)

    async def holder(node, finished):  # says it applied step 1, serves nothing, and dies (its record expires)
        record = ProgressRecord(node.peer_id.to_base58(), 2, 0, 1.0, Role.TRAINER, fingerprint="1:feedbeef")
        await node.store(node.key("progress"), node.peer_id.to_base58(), record.to_wire(), ttl=4.0)

    try:
        copt, failed = catching_up_on_step_0(peer, state_timeout=5)
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs)), holder) as gone:
            deadline = time.monotonic() + 20
            while not any(r.peer_id == gone for r in peer.collaboration().peers):
                assert time.monotonic() < deadline, "the holder's record never showed"
                time.sleep(0.1)
            copt._catchup = CatchUp(1, failed, time.monotonic() - 100)
            assert copt._land_catchup(wait=False), "gradients dropped while a peer held the step"
            assert copt._catchup is not None and copt.skipped_steps == 0, "it did not keep asking the holder"
        deadline = time.monotonic() + 30
        while any(r.peer_id == gone for r in peer.collaboration().peers):
            assert time.monotonic() < deadline, "the holder's record never expired"
            time.sleep(0.2)
        assert copt._land_catchup(wait=True), "gradients dropped"  # its retry fails: nobody holds step 1 now
        assert copt.skipped_steps == 1 and copt.applied_step == 1 and copt.acc.samples == 8
        copt.close()
    finally:
        peer.close()


def test_a_lost_step_is_skipped_only_once_no_round_may_finish_and_the_view_is_fresh():
    """Delayed updates: two ways the delayed soak skipped a step that others took (a fork, healed
    later by the lineage vote), each a phase here:

    1. The aggregator-only peer led step 440's round with its own 60 s deadline (the leader's
       deadline binds every member), while a member that had failed waited only its own round
       length (20 s). Now the step is skipped only once every group that closed it is past its
       deadline (its closed record's ``until``, plus CLOSED_GRACE).
    2. A peer resumed from a 23 s freeze read nobody else for 15 s (its stale local copy of the
       DHT) and concluded that nobody held step 753, which all the others had taken. Now a skip
       needs news from another peer since the catch-up started.
    3. With both, the step is skipped."""

    from dedloc.averaging.matchmaking import CLOSED_GRACE
    from dedloc.optim.state_sync import CatchUp
    from dedloc.records import ClosedRecord

    rid = run_id()
    peer = Peer(PeerConfig(run_id=rid), AVG)
    until = time.time() + 4  # a leader with a longer deadline than this peer's own round length
    speak, published = threading.Event(), []

    async def leader(node, finished):  # closed step 0 with this peer in its group; a trainer at step 1
        me = node.peer_id.to_base58()

        async def publish():
            record = ProgressRecord(me, 1, 0, 1.0, Role.TRAINER, fingerprint="0:feedbeef", time=time.time())
            await node.store(node.key("progress"), me, record.to_wire(), ttl=60.0)
            published.append(record.time)

        async def later():
            await asyncio.to_thread(speak.wait, 60)
            await publish()

        await node.store(node.key("closed", 0), me, ClosedRecord(me, (me, peer.peer_id), until).to_wire(), ttl=60.0)
        await publish()
        asyncio.get_running_loop().create_task(later())

    try:
        copt, failed = catching_up_on_step_0(peer, state_timeout=90)
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs)), leader) as other:
            deadline = time.monotonic() + 20
            while peer.round_deadline(0) is None or not any(r.peer_id == other for r in peer.collaboration().peers):
                assert time.monotonic() < deadline, "the leader's records never showed"
                time.sleep(0.1)
            assert peer.round_deadline(0) == pytest.approx(until + CLOSED_GRACE)
            # 1: news (the leader's record is new to this catch-up), and it waited past its own round
            # length (2 * 2 + 20 + 10 s) already: only the leader's deadline holds it
            copt._catchup = CatchUp(1, failed, time.monotonic() - 40)
            assert copt._land_catchup(wait=False), "gradients dropped"
            assert copt.skipped_steps == 0 and copt._catchup is not None, \
                "it skipped the step while a round that closed it could still finish"
            while time.time() < until + CLOSED_GRACE:  # the round's deadline passes
                time.sleep(0.1)
            # 2: the same view as when the catch-up started: no news from anyone
            copt._catchup = CatchUp(1, failed, time.monotonic() - 40, {other: published[0]})
            assert copt._land_catchup(wait=False), "gradients dropped"
            assert copt.skipped_steps == 0 and copt._catchup is not None, \
                "it skipped the step on a view that brought no news since the catch-up started"
            speak.set()  # 3: the leader publishes again; nobody holds step 1: skipped
            assert copt._land_catchup(wait=True), "gradients dropped"
            assert len(published) == 2
            assert copt.skipped_steps == 1 and copt.applied_step == 1 and copt.acc.samples == 8
        copt.close()
    finally:
        peer.close()


def held_back(copt: CollaborativeOptimizer) -> bool:
    """Whether the step rule "held back alone" holds ``copt``'s round back now."""
    return step_rules.held_back_alone(copt.peer.collaboration(), copt.peer.peer_id, copt.global_step,
                                      copt.peer.role == Role.CLIENT, copt._catchup is not None) is not None


@contextlib.contextmanager
def held_back_while_catching_up_on_step_1(peer: Peer, setup, event: str, why: str):
    """A delayed-updates optimizer on ``peer``, with a bare node run by ``setup`` (conftest's
    ``bare_node``) beside it. Once that node's progress record shows, the optimizer is put at step 2
    while it catches up on step 1 (its round of step 1 failed or was missed; the download is under
    way), and must keep 3 micro-batches without starting step 2's round, having logged ``event``
    (else: ``why``). Yields the optimizer."""
    from dedloc.optim.state_sync import CatchUp

    model = make_model()
    opt, sched = make_opt(model)
    copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=8, delay_updates=True),
                                  scheduler=sched, model=model)
    with bare_node(PeerConfig(run_id=peer.config.run_id, initial_peers=tuple(peer.maddrs)), setup) as other:
        deadline = time.monotonic() + 20
        while not any(r.peer_id == other for r in peer.collaboration().peers):
            assert time.monotonic() < deadline, "the other trainer's record never showed"
            time.sleep(0.1)
        copt.global_step, copt.local.applied_step = 2, 1
        copt._catchup = CatchUp(2, cf.Future(), time.monotonic())
        for _ in range(3):
            model[0].weight.sum().backward()
            assert copt.step(8) == StepOutcome.ACCUMULATED and copt._inflight is None, why
        assert copt.acc.samples == 24 and copt._noted.seen(2, event)
        try:
            yield copt
        finally:
            copt._catchup = None
            copt.close()


def test_a_peer_still_catching_up_does_not_take_the_next_step_alone():
    """Delayed updates: a trainer whose round failed went on to the next round while its catch-up
    was pending; alone in it, it published a step ahead of everyone, who then waited for its state
    while it waited (catching up) for theirs: a stall in the soak. Now it holds that round, keeping
    its gradients, until another reachable trainer reaches its step."""

    rid = run_id()
    peer = Peer(PeerConfig(run_id=rid), AVG)
    moved, tasks = threading.Event(), []

    async def other(node, finished):  # another trainer, one step behind, then at this peer's step
        me = node.peer_id.to_base58()
        record = ProgressRecord(me, 1, 0, 1.0, Role.TRAINER, fingerprint="1:cafe")
        await node.store(node.key("progress"), me, record.to_wire(), ttl=60.0)

        async def later():
            await asyncio.to_thread(moved.wait, 60)
            record2 = ProgressRecord(me, 2, 0, 1.0, Role.TRAINER, fingerprint="2:cafe")
            await node.store(node.key("progress"), me, record2.to_wire(), ttl=60.0)
        tasks.append(asyncio.ensure_future(later()))

    try:
        with held_back_while_catching_up_on_step_1(peer, other, "held back", "it took the step alone") as copt:
            moved.set()
            deadline = time.monotonic() + 20
            while held_back(copt):
                assert time.monotonic() < deadline, "it kept holding once the other trainer reached its step"
                time.sleep(0.1)
    finally:
        peer.close()


@pytest.mark.parametrize("release", ["applied", "ready"])
def test_a_peer_that_missed_a_round_waits_for_its_members_before_the_next_step(release):
    """Delayed updates: a trainer that missed step 1's round catches up on it while the others at
    step 2 are still in that round (they publish step 2, applied 1, while it runs). In the delayed
    soak such a peer took step 437 alone during the others' 13 s round of 436, and the step was both
    taken and skipped (a fork). Now it keeps accumulating while that round may still run, and goes
    on once a member publishes its update applied, or is ready for step 2's round (its ready
    record comes first: a member publishes its progress only after its next micro-batch)."""

    from dedloc.records import ClosedRecord, Member, ReadyRecord

    rid = run_id()
    peer = Peer(PeerConfig(run_id=rid), AVG)
    released, tasks = threading.Event(), []

    async def member(node, finished):  # a member of step 1's round, at step 2 while that round runs
        me = node.peer_id.to_base58()
        await node.store(node.key("closed", 1), me, ClosedRecord(me, (me,), time.time() + 60).to_wire(), ttl=60.0)
        await node.store(node.key("progress"), me,
                         ProgressRecord(me, 2, 16, 1.0, Role.TRAINER, fingerprint="1:cafe").to_wire(), ttl=60.0)

        async def later():
            await asyncio.to_thread(released.wait, 60)
            if release == "applied":
                record = ProgressRecord(me, 2, 16, 1.0, Role.TRAINER, fingerprint="2:cafe")
                await node.store(node.key("progress"), me, record.to_wire(), ttl=60.0)
            else:
                ready = ReadyRecord(Member(me, 16.0, 1.0), numel=4)
                await node.store(node.key("ready", 2), me, ready.to_wire(), ttl=60.0)
        tasks.append(asyncio.ensure_future(later()))

    try:
        with held_back_while_catching_up_on_step_1(peer, member, "missed round runs", "it took step 2 while the "
                                                   "others were still in the round of step 1") as copt:
            assert not held_back(copt), "held back by the other rule, not this one"
            released.set()
            deadline = time.monotonic() + 20
            while copt.sync.waits_for_missed_round(peer.collaboration(), copt._catchup, copt.global_step):
                assert time.monotonic() < deadline, f"it kept waiting once a member's round was over ({release})"
                time.sleep(0.1)
    finally:
        peer.close()


def test_a_leader_whose_round_failed_reopens_the_step(tmp_path):
    """A round closed, then failed for its members (their joins timed out while the leader, starved
    or slowed by a dead DHT node, answered late). The leader's closed record and its answers kept the
    step closed: every retry by anyone was 'missed' again, and nobody took the step until the
    records expired (a 69 s stall in the soak on a loaded machine). Now a peer whose round failed
    withdraws its closed record and tells joiners to pass it over; a late peer takes the step at once."""
    from dedloc.averaging.matchmaking import Matchmaker

    rid = run_id()
    identity, own = ordered_identities(tmp_path)  # the late peer must ask the bare leader first
    peer = Peer(PeerConfig(run_id=rid, identity_path=str(own)), AVG)
    closed, reopen, reopened = threading.Event(), threading.Event(), threading.Event()

    tasks = []

    async def leader(node, finished):
        mm = Matchmaker(node, AVG, 1.0)
        await mm.start()
        group = await mm.form_group(0, 8.0, expected_peers=1)  # leads and closes step 0 alone
        assert [m.peer_id for m in group.members] == [node.peer_id.to_base58()]
        closed.set()

        async def fail_when_told():  # ends once reopen is set (the test's finally sets it)
            if await asyncio.to_thread(reopen.wait, 60):
                await mm.round_failed(0, group)
                reopened.set()

        tasks.append(asyncio.create_task(fail_when_told()))  # the node answers joins meanwhile

    def closed_by(leader: str) -> bool:
        return leader in peer.closed_round(0)

    try:
        leader_id = peer_id_of(load_identity(identity).public_key())
        config = PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs), identity_path=str(identity))
        with bare_node(config, leader):
            assert closed.wait(60), "the leader did not close step 0"
            deadline = time.monotonic() + 20
            while not closed_by(leader_id):
                assert time.monotonic() < deadline, "the closed record never showed"
                time.sleep(0.1)
            with pytest.raises(MissedRoundError):  # the step is closed without it, as it should be
                peer.average(torch.ones(4), step=0, weight=8.0, expected_peers=1)
            reopen.set()
            assert reopened.wait(30)
            # the record is withdrawn, not left to expire (3 matchmaking_time + averaging_timeout = 26 s)
            deadline = time.monotonic() + 12
            while closed_by(leader_id):
                assert time.monotonic() < deadline, "the failed leader's closed record still closes the step"
                time.sleep(0.1)
            # the leader answers 'pass me over' (before the fix: 'missed', for as long as it ran)
            stats = peer.average(torch.full((4,), 3.0), step=0, weight=8.0, expected_peers=1)
            assert stats.peers == (peer.peer_id,), stats
    finally:
        reopen.set()
        peer.close()


def test_a_donor_announcing_a_huge_state_is_refused_before_its_bytes():
    """A donor announced 32 GiB and streamed as much as it could: the newcomer's memory grew with it
    (it allocated what the donor claimed, up to 64 GiB). Now a state larger than the newcomer's own
    model allows is refused at the header, naming the size, and the next donor serves it."""

    from dedloc.net import messages

    rid = run_id()
    good = Peer(PeerConfig(run_id=rid), AVG)
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), AVG)
    sent = []

    async def huge(node, finished):
        async def serve(info, reader, writer):
            await messages.read_message(reader)
            await messages.write_message(writer, {"step": 3, "size": 32 << 30})
            try:
                while not finished.is_set():
                    writer.write(b"x" * (1 << 20))
                    await writer.drain()
                    sent.append(1)
            except (ConnectionError, OSError):
                pass
            writer.close()

        await node.streams.serve(f"dedloc.{rid}.state", serve)

    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(good.maddrs)), huge) as donor:
            good.offer_state(3, b"a state of step 3")
            with pytest.raises(StateError, match=f"{donor}: ProtocolError: it announces a state of {32 << 30} bytes"):
                newcomer.download_state([donor], 3, timeout=60, max_bytes=1 << 20)
            step, blob, served = newcomer.download_state([donor, good.peer_id], 3, timeout=60, max_bytes=1 << 20)
            assert (step, blob, served) == (3, b"a state of step 3", good.peer_id)
    finally:
        newcomer.close()
        good.close()


def test_a_forked_donor_is_refused_at_its_state_header():
    """A donor whose state's lineage rewrites a step the live peers took with other parameters (a
    fork) used to be refused only after its whole state was downloaded and decoded. Its header
    now carries the lineage: the requester refuses it before the bytes, naming the step it
    rewrites, and takes the state from the next donor, whose history the votes agree with."""
    rid = run_id()
    forked = Peer(PeerConfig(run_id=rid), AVG)
    good = Peer(PeerConfig(run_id=rid, initial_peers=tuple(forked.maddrs)), AVG)
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(forked.maddrs)), AVG)
    try:
        ours = ["3:aaaa", "4:bbbb", "5:cccc"]
        votes = {"peer-1": "4:bbbb", "peer-2": "5:cccc", good.peer_id: "5:cccc"}
        forked.offer_state(6, b"the fork's state of step 6", ["3:aaaa", "4:ffff", "5:eeee", "6:dddd"])
        good.offer_state(5, b"the collaboration's state of step 5", ours)
        with pytest.raises(ForkError, match=f"{forked.peer_id}: ForkError: its state of step 6 rewrites step 4, "
                                            f"which the collaboration took with other parameters \\(a fork\\): "
                                            f"refused before its 26 bytes") as refused:
            newcomer.download_state([forked.peer_id], 5, timeout=30, votes=votes)
        assert refused.value.peers == (forked.peer_id,)  # named, so the requester leaves it out of its target
        found = newcomer.download_state([forked.peer_id, good.peer_id], 5, timeout=30, votes=votes)
        assert found == (5, b"the collaboration's state of step 5", good.peer_id)
        # without votes (verify_sync off) the header is not judged
        assert newcomer.download_state([forked.peer_id], 5, timeout=30)[0] == 6
    finally:
        for p in (newcomer, good, forked):
            p.close()


@pytest.mark.parametrize("lands", ["while it leads", "just after it closed"])
def test_a_lead_that_ready_peers_never_joined_does_not_take_a_step_another_group_took(tmp_path, lands):
    """Found by the delayed-updates soak: a peer back from a freeze (smallest id) saw the others'
    ready records but not yet their closed record (a leader stores it after answering its joiners),
    led, waited for them in vain, and closed a group of one: its update was its own gradient, a fork
    that lasted 22 steps. Now a leader that ready peers never joined looks at the closed records once
    more before closing, and misses the step if another group took it (rule 8).

    The synchronous soak: two such leads of one closed the same step at once, each having looked
    before the other stored (two peers each stepped alone, and differed). Now a lead of one that
    ready peers never joined looks once more after it closed, and withdraws if it is outranked
    (rule 9): here by a group of two whose record lands just after its own (its member's signed join
    in it: rule 13)."""
    from dedloc.records import ClosedRecord, JoinProof, Member, ReadyRecord, join_statement

    rid = run_id()
    identity, closer, own = ordered_identities(tmp_path, 3)  # the late peer has the smallest id: it leads
    peer = Peer(PeerConfig(run_id=rid, identity_path=str(own)), AVG)
    try:
        other = peer.peer_id
        late = Peer(PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs), identity_path=str(identity)), AVG)
    except BaseException:
        peer.close()
        raise
    stored = threading.Event()

    async def publish(node, finished):
        async def closing():  # the other group's records: ready before the late peer looks, closed after
            me = node.peer_id.to_base58()
            await node.store(node.key("ready", 0), me, ReadyRecord(Member(me, 8.0, 1.0)).to_wire(), ttl=60)
            while late.peer_id not in await node.get(node.key("ready", 0)):
                await asyncio.sleep(0.05)
            if lands == "while it leads":  # its own checks at the start of matchmaking are over within
                await asyncio.sleep(AVG.matchmaking_time / 4)  # milliseconds; it leads for matchmaking_time
            else:  # the other group closed at the same moment: its record lands once the late peer's has
                while late.peer_id not in await node.get(node.key("closed", 0)):
                    await asyncio.sleep(0.02)
            joined = JoinProof("i", load_identity(own).sign(join_statement(rid, 0, me, other, "i", True)))  # rule 13
            await node.store(node.key("closed", 0), me, ClosedRecord(me, (me, other), None, ((other, joined),)).to_wire(),
                             ttl=60)
            stored.set()
        tasks.append(asyncio.create_task(closing()))

    tasks: list = []
    try:
        with bare_node(PeerConfig(run_id=rid, initial_peers=tuple(peer.maddrs), identity_path=str(closer)), publish):
            if lands != "while it leads":  # rule 14: a lead of one that a ready peer never joined declines once
                with pytest.raises(MatchmakingError, match="not taken by a group of one contributor"):
                    late.average(torch.ones(4), step=0, weight=8.0, expected_peers=2)
            with pytest.raises(MissedRoundError, match="closed without this peer"):
                late.average(torch.ones(4), step=0, weight=8.0, expected_peers=2)
            assert stored.is_set()
            assert late.peer_id not in peer.closed_round(0)  # it closed nothing, or withdrew its record
    finally:
        late.close()
        peer.close()


def test_a_leader_plans_within_its_budget_while_a_dht_neighbour_is_frozen():
    """The sync soak's 80 s stall at step 83: a leader plans between closing its group and answering
    its joiners. Its planner re-read the capability records first, and the read reached a peer frozen
    whole (SIGSTOP of its runtime and daemon): hivemind waits 3 s for it, longer than the joiners'
    deadline left (about matchmaking_time). They failed the step; the leader ran its round with
    members that had left it. Now the re-read gets ``matchmaking_time / 4``, then goes on in the
    background while this round plans with the snapshot in hand."""

    from dedloc.net.node import Node
    from dedloc.net.peer_connections import PeerConnections
    from dedloc.planning.planner import Planner
    from dedloc.records import Member

    rid = run_id()
    frozen = Peer(PeerConfig(run_id=rid), AVG)  # the planner's only DHT neighbour
    cfg = AveragingConfig(matchmaking_time=1, planner="lp", probe_interval=0).validate()

    async def main() -> float:
        node = await Node.create(PeerConfig(run_id=rid, initial_peers=tuple(frozen.maddrs)))
        planner = Planner(node, cfg, PeerConnections(node.streams, None, rid, True))
        members = (Member(node.peer_id.to_base58(), 8.0, 1.0), Member(frozen.peer_id, 8.0, 1.0))
        try:
            await planner.shares(members, 1000)  # a first read, with the neighbour running
            planner._snapshot_time = -1e9  # the snapshot is old: the next round re-reads
            session_signal(frozen, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert await planner.shares(members, 1000) == (1.0, 1.0)  # nothing measured: equal shares
                return time.monotonic() - t0
            finally:
                session_signal(frozen, signal.SIGCONT)
        finally:
            await planner.close()
            await node.shutdown()

    try:
        elapsed = asyncio.run(main())
        # 0.25 s and the LP here; 3.0 s without the budget (hivemind's wait for the frozen neighbour)
        assert elapsed < 2.0, f"planning waited {elapsed:.1f} s on a frozen DHT neighbour"
    finally:
        frozen.close()


def test_a_leader_with_longer_settings_answers_its_joiner_in_time_and_takes_the_shorter_timeout(tmp_path):
    """The CI soak's 74 s stall at step 40: the aggregator, at its defaults (matchmaking 3 s, rounds
    60 s), led trainers at 2 s and 20 s. It waited for an expected peer until its own close, after the
    trainers had given up on their joins; they came back with other gradients to a group that held
    their old weights, the round failed, and its 60 s deadline held the step for a minute. Now a join
    says how long the joiner waits and which timeout it wants: the leader answers in time, and the
    round's deadline is the smallest asked for."""
    lead_key, join_key = ordered_identities(tmp_path)
    rid = run_id()
    leader = Peer(PeerConfig(run_id=rid, identity_path=str(lead_key)),
                  AveragingConfig(matchmaking_time=3, averaging_timeout=60, probe_interval=0))
    joiner = Peer(PeerConfig(run_id=rid, initial_peers=tuple(leader.maddrs), identity_path=str(join_key)),
                  AveragingConfig(matchmaking_time=1, averaging_timeout=10, probe_interval=0))
    try:
        # a third expected peer never comes: the leader would wait for it until 6 s in (gather 3 s, then
        # close 3 s later); the joiner gives up 3 s in (gather 1 s, then twice 1 s for the answer)
        with cf.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(p.average, torch.full((64,), float(w)), step=0, weight=float(w), expected_peers=3)
                       for p, w in ((leader, 1), (joiner, 3))]
            stats = [f.result(120) for f in futures]  # before the fix: MatchmakingError at the joiner
        assert [s.group_size for s in stats] == [2, 2]
        # the round's deadline is the joiner's 10 s, not the leader's 60 s (plus CLOSED_GRACE, 5 s)
        assert leader.round_deadline(0) - time.time() < 15
    finally:
        joiner.close()
        leader.close()


def test_a_member_never_runs_again_a_round_that_failed_at_it(tmp_path):
    """Rule 12. A member whose round failed retries the step while its leader still runs that round:
    the leader answers with the same group, which holds the member's old weight. Running it again
    brought the member's new gradients into the round under the old weight (refused by every
    aggregator: the soak's 'weight 8.0 differs from the agreed 24.0'). Now the retry raises
    MatchmakingError and the step stays that group's."""
    from dedloc.averaging.matchmaking import Matchmaker
    from dedloc.net.node import Node

    lead_key, join_key = ordered_identities(tmp_path)
    rid = run_id()
    leader = Peer(PeerConfig(run_id=rid, identity_path=str(lead_key)), AVG)

    async def main() -> None:
        node = await Node.create(PeerConfig(run_id=rid, initial_peers=tuple(leader.maddrs),
                                            identity_path=str(join_key)))
        try:
            mm = Matchmaker(node, AVG, 1.0)
            await mm.start()
            group = await mm.form_group(0, 8.0, expected_peers=2)
            assert group.index(leader.peer_id) == 0 and len(group.members) == 2
            await mm.round_failed(0, group)
            with pytest.raises(MatchmakingError, match="already failed at this peer"):
                await mm.form_group(0, 24.0, expected_peers=2)
        finally:
            await node.shutdown()

    try:
        future, _ = leader.average_async(torch.ones(64), step=0, weight=1.0, expected_peers=2)
        asyncio.run(main())  # the leader's round waits for the member's contribution meanwhile
        future.exception(60)  # whatever the leader's round did without the member, it ended
    finally:
        leader.close()


def test_a_lead_of_one_whose_first_look_at_the_progress_records_timed_out_still_misses_a_taken_step():
    """The 2-minute soak's fork at step 6: a trainer's loop was stopped for 30 s; it woke as step 6's
    closed records expired, its first look at the progress records timed out (a slow DHT: dead and
    frozen nodes), it saw no ready peer, and it took step 6 alone while the others were at step 12.
    Now a lead of one that saw no ready peer looks at the progress records again: here they show
    the step taken (it misses it), or cannot be read (it does not take the step alone)."""
    from dedloc.averaging.matchmaking import Matchmaker
    from dedloc.net.node import Node
    from dedloc.records import CollaborationView

    avg = AveragingConfig(matchmaking_time=0.5, averaging_timeout=20, probe_interval=0)
    ahead = CollaborationView.build([ProgressRecord(p, 12, 0, 1.0, Role.TRAINER, time=time.time(),
                                                    fingerprint=f"12:{'ab' * 8}") for p in ("12D3KooWa", "12D3KooWb")])

    async def main() -> dict[int, str]:
        node = await Node.create(PeerConfig(run_id=run_id()))
        looks = []

        async def progress(step: int) -> CollaborationView:
            looks.append(step)
            if len(looks) == 1 or step == 1:
                await asyncio.sleep(3600)  # a read that times out (bounded by matchmaking_time)
            return ahead

        outcomes = {}
        try:
            for step in (6, 1):
                mm = Matchmaker(node, avg, 1.0, progress=lambda s=step: progress(s))
                try:
                    group = await mm.form_group(step, 8.0, expected_peers=1)
                    outcomes[step] = f"took it alone: {[m.peer_id for m in group.members]}"
                except (MissedRoundError, MatchmakingError) as e:
                    outcomes[step] = str(e)
        finally:
            await node.shutdown()
        return outcomes

    outcomes = asyncio.run(main())
    assert "step 6: the collaboration already took it" in outcomes[6], outcomes  # before: took it alone
    assert "the progress records could not be read; not taking the step alone" in outcomes[1], outcomes


def test_the_peers_that_pass_a_frozen_leader_over_regroup_in_a_fresh_window(tmp_path):
    """The delayed soak's step 309: the smallest ready peer was frozen whole (SIGSTOP of its runtime
    and daemon) after storing its ready record. Its followers' stream opens hung until their join
    deadline; the next one then led with no time left and closed alone at once (a group of one, 8
    samples), and the others missed the step. Now they regroup in one fresh window: the three
    take the step together."""
    avg = AveragingConfig(matchmaking_time=2, averaging_timeout=20, probe_interval=0)
    keys = ordered_identities(tmp_path, 4)
    rid = run_id()
    peers = [Peer(PeerConfig(run_id=rid, identity_path=str(keys[0])), avg)]
    peers += [Peer(PeerConfig(run_id=rid, initial_peers=tuple(peers[0].maddrs), identity_path=str(k)), avg)
              for k in keys[1:]]
    frozen, rest = peers[0], peers[1:]
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            stuck = pool.submit(frozen.average, torch.ones(64), step=0, weight=8.0, expected_peers=4, gather_time=30)
            deadline = time.monotonic() + 20
            while not rest[0].pending_round(0):  # its ready record is in the DHT: it is the one to lead
                assert time.monotonic() < deadline, "the frozen peer's ready record never showed"
                time.sleep(0.05)
            session_signal(frozen, signal.SIGSTOP)
            try:
                # (a gather long enough for every ready record to reach each of them through the slow DHT:
                # the frozen peer is a DHT node too, and costs each reader a timeout before it is passed by)
                runs = [pool.submit(p.average, torch.full((64,), 2.0), step=0, weight=8.0, expected_peers=4,
                                    gather_time=8) for p in rest]
                outcomes = []
                for r in runs:
                    try:
                        outcomes.append(sorted(r.result(60).peers))
                    except MatchmakingError as e:
                        outcomes.append(str(e))
            finally:
                session_signal(frozen, signal.SIGCONT)
            with contextlib.suppress(MatchmakingError):  # (with no progress records here, nothing tells it
                stuck.result(60)                          # that the others took the step: rule 10)
        # before: [[rest[0]], "...already closed...", "...already closed..."]
        assert outcomes == [sorted(p.peer_id for p in rest)] * 3, outcomes
    finally:
        for p in peers:
            p.close()


def test_a_leader_restarted_under_its_id_while_its_ready_record_lives_is_passed_over(tmp_path):
    """The sync soak's 77 s stall at step 507: the peer with the smallest id stored its ready record,
    was killed and came back under the same identity. Its new process had not matched yet, so it
    refused every join ("step 507 is not near this peer's step -1") while its old ready record made it the one
    to lead: each joiner failed the step, again and again. Now it refuses with ``pass``, and the
    others pass it over (rule 4) and take the step together."""
    avg = AveragingConfig(matchmaking_time=2, averaging_timeout=20, probe_interval=0)
    keys = ordered_identities(tmp_path, 3)
    rid = run_id()
    first = Peer(PeerConfig(run_id=rid, identity_path=str(keys[0])), avg)
    rest = [Peer(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs), identity_path=str(k)), avg)
            for k in keys[1:]]
    restarted = None
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            old = pool.submit(first.average, torch.ones(64), step=5, weight=8.0, expected_peers=3, gather_time=60)
            wait_for("the first peer's ready record", lambda: rest[0].pending_round(5) and rest[1].pending_round(5), 20)
            first.runtime.kill()  # its ready record for step 5 lives on in the DHT
            with contextlib.suppress(Exception):
                old.result(30)
            restarted = Peer(PeerConfig(run_id=rid, initial_peers=tuple(rest[0].maddrs), identity_path=str(keys[0])),
                             avg)
            assert restarted.peer_id == first.peer_id
            runs = [pool.submit(p.average, torch.full((64,), 2.0), step=5, weight=8.0, expected_peers=3,
                                gather_time=4) for p in rest]
            outcomes = [sorted(r.result(60).peers) for r in runs]  # before: MatchmakingError "refused: ... -1"
        assert outcomes == [sorted(p.peer_id for p in rest)] * 2, outcomes
    finally:
        for p in [first, *rest, *([restarted] if restarted else [])]:
            p.close()


def test_a_follower_whose_matchmaking_ended_without_a_group_sends_no_joiner_on_to_its_leader(tmp_path):
    """The aggregator in the sync soak's stall at step 507: its leader refused its join, so its
    matchmaking for the step ended; yet for the rest of the step it sent every peer that asked it
    on to that leader, which they had passed over ("still follows ... which this peer passed
    over"): each waited until its deadline and failed the step. Now it answers that it has no
    group (``failed``, rule 5), and they pass it over."""
    from dedloc.averaging.bounds import WeightBounds
    from dedloc.averaging.matchmaking import Matchmaker
    from dedloc.averaging.wire import VERSION
    from dedloc.net.node import Node
    from dedloc.records import JoinProof, Member, ReadyRecord, join_statement

    lead_key, follow_key, ask_key = ordered_identities(tmp_path, 3)
    rid = run_id()
    avg = AveragingConfig(matchmaking_time=1, averaging_timeout=20, probe_interval=0)

    async def main() -> None:
        lead = await Node.create(PeerConfig(run_id=rid, identity_path=str(lead_key)))
        boot = tuple(await lead.visible_maddrs())
        follow = await Node.create(PeerConfig(run_id=rid, initial_peers=boot, identity_path=str(follow_key)))
        ask = await Node.create(PeerConfig(run_id=rid, initial_peers=boot, identity_path=str(ask_key)))
        leader, follower, asker = (Matchmaker(n, avg, 1.0) for n in (lead, follow, ask))
        fid, aid = follow.peer_id.to_base58(), ask.peer_id.to_base58()
        try:
            for m in (leader, follower, asker):
                await m.start()
            led = asyncio.create_task(leader.form_group(3, 8.0, expected_peers=2, gather_time=2,
                                                        bounds=WeightBounds({fid: 10.0})))
            with pytest.raises(MatchmakingError, match="is above what .* could plausibly have computed"):
                await follower.form_group(3, 500.0, expected_peers=2)
            with contextlib.suppress(MatchmakingError):
                await led
            statement = join_statement(rid, 3, fid, aid, asker.incarnation, True)
            request = {"v": VERSION, "step": 3, **ReadyRecord(Member(aid, 8.0, 1.0)).to_wire(), "g": 0.0, "t": 20.0,
                       "j": JoinProof(asker.incarnation, ask.sign(statement), True).to_wire()}
            asker._newest = 3
            answer = await asker._ask(3, fid, request, asyncio.get_running_loop().time() + 10)
            assert answer == JoinAnswer.round_failed(), answer  # before: redirected to the leader
        finally:
            for n in (ask, follow, lead):
                await n.shutdown()

    asyncio.run(main())


def test_an_aggregator_leading_one_trainer_beside_trainers_still_in_the_last_round_declines_the_step(tmp_path):
    """The delayed soak's fork at step 652: an aggregator-only leader (the smallest id) and one
    trainer took the step while the other trainers, at it by their progress records, were still in
    the round of 651 and not ready yet; they missed it (its record counted the aggregator as a
    contributor) and the run forked. Now such a group of one contributor declines the step (rule 14),
    and so does the trainer leading alone: nobody takes it, no record closes it."""
    avg = AveragingConfig(matchmaking_time=2, averaging_timeout=20, probe_interval=0)
    keys = ordered_identities(tmp_path, 3)
    rid = run_id()
    aggregator = Peer(PeerConfig(run_id=rid, identity_path=str(keys[0])),
                      AveragingConfig(matchmaking_time=2, averaging_timeout=20, probe_interval=0, aggregator_only=True))
    boot = tuple(aggregator.maddrs)
    trainer, busy = (Peer(PeerConfig(run_id=rid, initial_peers=boot, identity_path=str(k)), avg) for k in keys[1:])
    try:
        busy.publish_progress(3, 40, 10.0)  # at step 3, still in the round of step 2: not ready
        wait_for("the busy trainer's progress record", lambda: any(
            r.peer_id == busy.peer_id for r in trainer.collaboration().trainers_at(3)), 20)
        with cf.ThreadPoolExecutor(2) as pool:
            agg = pool.submit(aggregator.average, torch.zeros(64), step=3, weight=0.0, expected_peers=2)
            mine = pool.submit(trainer.average, torch.ones(64), step=3, weight=8.0, expected_peers=2)
            with pytest.raises(MatchmakingError):  # before: a group of the aggregator and this trainer
                mine.result(60)
            with pytest.raises(MatchmakingError, match="group of one contributor"):
                agg.result(60)
        assert trainer.closed_round(3) == {}
    finally:
        for p in (trainer, busy, aggregator):
            p.close()


def test_a_leader_starts_its_round_while_its_closed_record_is_still_being_stored(tmp_path):
    """The soaks' longest stalls (sync, step 177: 23.6 s; delayed, step 76: 32.9 s): a leader answered
    its joiners, then stored its closed record before starting its own round. The store reached a
    DHT node frozen whole and waited for it, so the leader began its round 6-8 s after its members,
    whose aggregators refused its contributions as late; the round failed for everyone. Now the
    record is stored in the background while the round runs. Here the store waits until released,
    as on a frozen replica (a real freeze cannot be timed to hit the store first: the DHT blacklists
    a silent node at its first timeout, whichever request that is): the leader has its group at
    once, the record is published once the store goes through, and one still under way when the
    matchmaker closes is cancelled."""
    from dedloc.averaging.matchmaking import Matchmaker
    from dedloc.net.node import Node

    lead_key, join_key = ordered_identities(tmp_path)
    rid = run_id()
    avg = AveragingConfig(matchmaking_time=1, averaging_timeout=20, probe_interval=0)

    async def main() -> None:
        lead = await Node.create(PeerConfig(run_id=rid, identity_path=str(lead_key)))
        join = await Node.create(PeerConfig(run_id=rid, initial_peers=tuple(await lead.visible_maddrs()),
                                            identity_path=str(join_key)))
        release, pending = asyncio.Event(), []
        real_store = lead.store

        async def store(key: str, subkey: str, value, ttl: float) -> bool:
            if key.startswith(lead.key("closed", "")):  # a replica frozen whole: the store waits on it
                pending.append(key)
                await release.wait()
            return await real_store(key, subkey, value, ttl)

        lead.store = store
        leader, joiner = Matchmaker(lead, avg, 1.0), Matchmaker(join, avg, 1.0)
        me = lead.peer_id.to_base58()
        try:
            await leader.start()
            await joiner.start()
            # before: the leader's form_group returned only once the store went through (here: never)
            groups = await asyncio.wait_for(asyncio.gather(leader.form_group(0, 8.0, expected_peers=2),
                                                           joiner.form_group(0, 8.0, expected_peers=2)), 30)
            assert groups[0].round_id == groups[1].round_id and len(groups[0].members) == 2
            assert pending == [lead.key("closed", 0)] and await joiner.closed_round(0) == {}
            release.set()
            deadline = time.monotonic() + 20
            while me not in await joiner.closed_round(0):
                assert time.monotonic() < deadline, "the closed record was never published"
                await asyncio.sleep(0.05)
            assert sorted(await joiner.closed_round(0)) == [me]
            release.clear()
            await asyncio.wait_for(asyncio.gather(leader.form_group(1, 8.0, expected_peers=2),
                                                  joiner.form_group(1, 8.0, expected_peers=2)), 30)
            assert len(pending) == 2 and len(leader._stores) == 1
            await asyncio.wait_for(leader.close(), 5)  # the store still under way is cancelled, not left behind
            assert not leader._stores
        finally:
            await join.shutdown()
            await lead.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("leaves", ["handing its step on", "at once"])
def test_a_step_only_a_leaving_trainer_could_serve_is_handed_on_or_taken_again(leaves):
    """A CI soak's lost step: the aggregator, a client and one trainer took step 9, and the trainer
    restarted at once. Nobody left could serve that step, and the client's copy made it taken for
    the other trainer: it could neither take the step again nor download it, while the client
    waited for a trainer to reach its step (76 s, until the soak killed the client). Now a trainer
    that leaves holding a step that no other peer serving its state holds serves it until one does:
    here the other trainer, away while the first one and a client take step 0, misses that round
    and downloads its result. One that leaves at once (hand_on_timeout 0, as a kill -9 does) leaves
    a step that only the client holds: the client's fingerprint no longer counts (no trainer
    publishes it), the other trainer takes the step again, and the client steps back to it."""
    torch.set_num_threads(1)
    rid = run_id()
    t = Peer(PeerConfig(run_id=rid), AVG)
    c = Peer(PeerConfig(run_id=rid, initial_peers=tuple(t.maddrs), client_mode=True), AVG)
    u = Peer(PeerConfig(run_id=rid, initial_peers=tuple(t.maddrs)), AVG)
    cfg = OptimizerConfig(target_batch_size=32, state_timeout=30)
    leaving = Trainer(0, t, OptimizerConfig(target_batch_size=32, state_timeout=30,
                                            hand_on_timeout=30 if leaves == "handing its step on" else 0),
                      8, delay=0.05, stop_at=1)

    def until_step_0_is_taken(opt):  # a trainer away (a busy laptop) while step 0 is taken without it
        deadline = time.monotonic() + 60
        while 1 not in leaving.params and leaving.is_alive() and time.monotonic() < deadline:
            threading.Event().wait(0.05)

    client = Trainer(1, c, cfg, 8, delay=0.05, steps=3)
    away = Trainer(2, u, cfg, 8, delay=0.05, steps=3, gate=until_step_0_is_taken)
    try:
        for tr in (leaving, client, away):
            tr.start()
        join_all([leaving, client, away], timeout=200)
        assert leaving.opt.history[0].group_size == 2 and 2 not in leaving.params
        assert max(away.params) == max(client.params) == 3
        # (a peer's params[s] are the first it held at step s: the client's fork, when it stepped back)
        for step in range(1 if leaves == "handing its step on" else 2, 4):
            assert torch.equal(away.params[step], client.params[step]), f"the peers differ after step {step}"
        if leaves == "at once":
            assert client.opt.resyncs >= 1, "the client never stepped back from the step nobody could serve"
        else:  # the step the leaving trainer took is the one the others went on from: no step taken twice
            assert torch.equal(away.params[1], leaving.params[1]), "the step was taken again without it"
            assert client.opt.resyncs == 0
    finally:
        for p in (t, c, u):
            p.close()


@pytest.mark.parametrize("away", ["shorter than their records live", "longer than their records live"])
def test_two_trainers_stopped_at_a_step_do_not_take_it_again_beside_the_one_that_went_on(make_peers, away):
    """The CI chaos soak's fork (steps 24-26, and 19-20 when reproduced): while two trainers' training
    loops were stopped (SIGSTOP) holding samples for a step, a third took that step alone (it
    declined once, then closed); back, the two took it again together, and the third, outvoted,
    stepped back. Now a lone lead waits while a trainer at its step publishes nothing (until it
    comes back, or its record lapses), keeping its gradients; and a peer back from longer than its
    record lives downloads the run's state when the run went past it. Either way each step is
    taken once: every peer that holds a step holds the same parameters, and none steps back."""
    torch.set_num_threads(1)
    ttl = 10.0
    a, b, c = make_peers(3, averaging=AveragingConfig(matchmaking_time=1, averaging_timeout=10, probe_interval=0),
                         progress_ttl=ttl)
    cfg = OptimizerConfig(target_batch_size=48, state_timeout=60)
    released = threading.Event()
    stopped: set[int] = set()
    shorter = away.startswith("shorter")

    def stopped_at_step_2(opt):  # the training process stopped, its peer still up (chaos's stop_trainer)
        if opt.global_step == 2 and opt.acc.samples >= 8 and id(opt) not in stopped:
            stopped.add(id(opt))
            t0 = time.monotonic()
            while time.monotonic() - t0 < (0.6 * ttl if shorter else 1.3 * ttl) or \
                    (not shorter and lone.opt.applied_step < 3 and time.monotonic() - t0 < 60):
                threading.Event().wait(0.05)
            released.set()

    def waits_at_step_4(opt):  # the lone one goes no further than step 4 before they are back
        if opt.global_step >= 4:
            released.wait(60)

    lone = Trainer(0, a, cfg, 4, delay=0.05, steps=6, gate=waits_at_step_4)
    others = [Trainer(i, p, cfg, 4, delay=0.05, steps=6, gate=stopped_at_step_2) for i, p in ((1, b), (2, c))]
    for tr in (lone, *others):
        tr.start()
    join_all([lone, *others], timeout=240)
    assert len(stopped) == 2
    for step in range(1, 7):
        held = [(t.index, t.params[step]) for t in (lone, *others) if step in t.params]
        assert all(torch.equal(p, held[0][1]) for _, p in held), \
            f"step {step} was taken twice: trainers {[i for i, _ in held]} hold different parameters"
    assert lone.opt.resyncs == 0, "the trainer that went on was outvoted and stepped back"
    round_2 = next(r for r in lone.opt.history if r.step == 2)
    if shorter:  # it waited for them, and the step was taken by the three together
        assert round_2.group_size == 3, round_2
    else:  # their records lapsed: it went on alone, and they downloaded its state when back
        assert round_2.group_size == 1 and all(t.opt.resyncs >= 1 and 3 not in t.params for t in others)
