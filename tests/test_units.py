"""Pure unit tests: wire format, group maths, records, estimates, config validation."""

from dataclasses import replace
import asyncio
import contextlib
import math

import pytest
import torch

from dedloc.averaging.accumulator import PartAccumulator
from dedloc.averaging.group import Group, Member, split_into_subgroups
from dedloc.averaging import match_rules
from dedloc.averaging.join_answer import Answer, JoinAnswer
from dedloc.averaging.ring import ring_order
from dedloc.averaging.wire import (HEADER, VERSION, Kind, pack_header, read_header, read_payload_into,
                                   unpack_header)
from dedloc.config import AveragingConfig, PeerConfig, from_dict
from dedloc.errors import AveragingError, ConfigError, ProtocolError
from dedloc.planning.estimate import RateEstimate
from dedloc.planning.probe import concurrent_rate
from dedloc.records import CapabilityRecord, CollaborationView, ProgressRecord, Role, HISTORY

RID = bytes(range(16))


def feed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_header_roundtrip_and_rejections():
    h = unpack_header(pack_header(Kind.CONTRIB, RID, 3, 2.5, 10, torch.float16))
    assert (h.kind, h.round_id, h.part, h.weight, h.numel, h.dtype, h.nbytes) == \
        (Kind.CONTRIB, RID, 3, 2.5, 10, torch.float16, 20)
    raw = bytearray(pack_header(Kind.CONTRIB, RID))
    with pytest.raises(ProtocolError, match="bad magic"):
        unpack_header(b"XXXX" + bytes(raw[4:]))
    raw[4:6] = (99).to_bytes(2, "little")
    with pytest.raises(ProtocolError, match=f"version mismatch: ours is {VERSION}, theirs is 99"):
        unpack_header(bytes(raw))
    bad_kind = HEADER.pack(b"DDLC", VERSION, 42, 1, RID, 0, 0.0, 0)
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        unpack_header(bad_kind)
    for w in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ProtocolError, match="invalid weight"):
            unpack_header(HEADER.pack(b"DDLC", VERSION, 1, 1, RID, 0, w, 0))


def test_payload_size_and_dtype_checked_before_reading():
    async def go():
        x = torch.arange(8, dtype=torch.float32)
        data = pack_header(Kind.CONTRIB, RID, 0, 1.0, 8, torch.float32) + x.numpy().tobytes()
        reader = feed(data)
        out = torch.empty(8)
        await read_payload_into(reader, None, await read_header(reader), out)
        assert torch.equal(out, x)
        reader = feed(data)
        with pytest.raises(ProtocolError, match="size mismatch: expected 4 elements, got 8"):
            await read_payload_into(reader, None, await read_header(reader), torch.empty(4))
        reader = feed(data)
        with pytest.raises(ProtocolError, match="dtype mismatch"):
            await read_payload_into(reader, None, await read_header(reader), torch.empty(8, dtype=torch.float16))
        with pytest.raises(ConnectionError, match="header"):
            await read_header(feed(data[:10]))

    asyncio.run(go())


def members(*spec):
    return tuple(Member(f"p{i}", w, s, c) for i, (w, s, c) in enumerate(spec))


def test_part_bounds_follow_shares_and_cover_the_vector():
    g = Group(RID, 0, members((1, 1, False), (1, 3, False), (1, 0, True), (0, 4, False)))
    b = g.part_bounds(80)
    assert b == [(0, 10), (10, 40), (40, 40), (40, 80)]
    assert g.aggregators == [0, 1, 3]
    assert [g.backup(j) for j in (0, 1, 3)] == [1, 3, 0] and g.backup(2) is None
    for n in (1, 2, 7, 1001):
        bounds = g.part_bounds(n)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    with pytest.raises(ProtocolError, match="no aggregator"):
        Group(RID, 0, members((1, 0, True))).part_bounds(10)


def test_group_wire_validation():
    g = Group(RID, 5, members((1, 1, False), (2, 1, True)), (), "ring", "float16")
    assert Group.from_wire(g.to_wire()) == g
    bad = g.to_wire()
    bad["members"][0][1] = float("nan")
    with pytest.raises(ProtocolError):
        Group.from_wire(bad)
    bad = g.to_wire()
    bad["members"] = list(reversed(bad["members"]))
    with pytest.raises(ProtocolError, match="sorted"):
        Group.from_wire(bad)
    bad = g.to_wire()
    bad["strategy"] = "gossip"
    with pytest.raises(ProtocolError):
        Group.from_wire(bad)
    with pytest.raises(ProtocolError):
        Group.from_wire({"round_id": 1})


def test_subgroups_bound_size_and_each_has_an_aggregator():
    ms = tuple(Member(f"p{i:03d}", 1, 0 if i % 3 == 0 else 1, i % 3 == 0) for i in range(200))
    subs = split_into_subgroups(ms, 16)
    assert sorted(i for s in subs for i in s) == list(range(200))
    assert max(len(s) for s in subs) <= 16 and len(subs) == math.ceil(200 / 16)
    for s in subs:
        assert any(ms[i].share > 0 for i in s)
    g = Group(RID, 0, ms, subs)
    top = g.top_group({g.representative(k): 1.0 for k in range(len(subs))})
    assert len(top.members) == len(subs) and top.round_id != g.round_id
    assert split_into_subgroups(ms[:10], 16) == ()


def test_ring_order_never_puts_two_clients_side_by_side():
    g = Group(RID, 0, members((1, 1, False), (1, 0, True), (1, 1, False), (1, 0, True)))
    order = ring_order(g)
    assert sorted(order) == [0, 1, 2, 3]
    for a, b in zip(order, order[1:] + order[:1]):
        assert not (g.members[a].client and g.members[b].client)
    with pytest.raises(AveragingError, match="ring needs"):
        ring_order(Group(RID, 0, members((1, 1, False), (1, 0, True), (1, 0, True))))


def test_accumulator_counts_each_sender_once():
    async def go():
        acc = PartAccumulator({0, 1, 2}, 3)
        assert acc.add(0, 1.0, torch.ones(3))
        assert not acc.add(0, 1.0, torch.ones(3))
        acc.reject(1, "bad")
        assert not acc.add(1, 5.0, torch.ones(3))
        await acc.wait(asyncio.get_running_loop().time() + 0.05)
        out = acc.finish()
        assert torch.equal(out, torch.ones(3)) and acc.rejected == {1: "bad", 2: "timed out"}
        assert not acc.add(2, 1.0, torch.ones(3))
        with pytest.raises(AveragingError):
            PartAccumulator({0}, 1).finish()

    asyncio.run(go())


def test_records_view_and_validation():
    now = 1000.0
    recs = [ProgressRecord("a", 3, 100, 50.0, Role.TRAINER, 1e6, now),
            ProgressRecord("b", 3, 60, 30.0, Role.CLIENT, 0, now),
            ProgressRecord("c", 2, 500, 10.0, Role.TRAINER, 0, now),
            ProgressRecord("d", 3, 0, 0.0, Role.AGGREGATOR, 0, now)]
    view = CollaborationView.build(recs, now)
    assert view.global_step == 3 and view.samples == 160 and view.samples_per_second == 80.0
    assert view.eta(320) == pytest.approx(2.0)
    assert view.eta(100) == 0.0
    assert view.by_role() == {"trainer": 2, "client": 1, "aggregator": 1}
    # a client ahead of every reachable trainer cannot hand its state on: it does not lead...
    ahead = CollaborationView.build(recs + [ProgressRecord("e", 9, 8, 5.0, Role.CLIENT, 0, now)], now)
    assert ahead.global_step == 3 and ahead.samples == 160
    # ...unless no reachable trainer is alive (then clients and backbones count, aggregators never)
    alone = CollaborationView.build([r for r in ahead.peers if r.role != Role.TRAINER and r.peer_id != "b"], now)
    assert alone.global_step == 9
    # still, one claim is not the run's step: two of the clients must have reached it
    assert CollaborationView.build([r for r in ahead.peers if r.role != Role.TRAINER], now).global_step == 3
    assert ProgressRecord.from_wire("a", recs[0].to_wire()) == recs[0]
    for bad in ({"step": -1, "samples": 0, "samples_per_second": 0, "role": "trainer"},
                {"step": 1, "samples": 0, "samples_per_second": float("nan"), "role": "trainer"},
                {"step": 1, "samples": 0, "samples_per_second": 1, "role": "king"}, "junk", None):
        assert ProgressRecord.from_wire("x", bad) is None


def test_a_client_whose_record_lags_the_round_it_finished_is_expected_at_the_next():
    """In CI a leader read the view at step 1 before the client that had finished step 0 with it
    published step 1: it expected 2 peers, closed without the client, and the client resynced. The
    members of the last round are expected too (records.py ``expected_at``)."""
    v = CollaborationView.build((ProgressRecord("a", 1, 40, 1.0, Role.TRAINER), ProgressRecord("b", 1, 30, 1.0, Role.TRAINER),
                                 ProgressRecord("c", 0, 0, 1.0, Role.CLIENT),
                                 ProgressRecord("agg", 0, 0, 0.0, Role.AGGREGATOR),
                                 ProgressRecord("s", 0, 0, 1.0, Role.TRAINER, syncing=True),
                                 ProgressRecord("far", 5, 0, 1.0, Role.TRAINER)), 1000.0)
    assert v.expected_at(1, "a") == 2
    assert v.expected_at(1, "a", ("a", "b", "c", "agg")) == 3  # the client; an aggregator counts apart
    assert v.expected_at(1, "a", ("a", "b", "c", "s", "far", "gone")) == 3  # not the resyncing, the ahead, the left
    assert v.expected_at(1, "new") == 3  # this peer, before its own record shows


def test_one_members_far_step_is_not_the_runs():
    """At b122246 a member publishing step +1000 made it the global step: every peer downloaded its
    weights. The run's step is one that two training peers reached (records.py ``attested``)."""
    now = 1000.0

    def view(*recs):
        return CollaborationView.build(recs, now)

    t1, t2 = ProgressRecord("t1", 51, 0, 1.0, Role.TRAINER), ProgressRecord("t2", 51, 0, 1.0, Role.TRAINER)
    backbone = ProgressRecord("bb", 40, 0, 0.0, Role.BACKBONE)
    for far in (ProgressRecord("m", 1051, 0, 1.0, Role.TRAINER), ProgressRecord("m", 1051, 0, 1.0, Role.CLIENT),
                ProgressRecord("m", 1051, 0, 1.0, Role.TRAINER, syncing=True)):
        assert view(t1, t2, backbone, far).global_step == 51
        assert view(t1, backbone, far).global_step == 51  # one honest trainer beside it is enough
    assert view(t1, backbone).global_step == 51  # a lone trainer is the run
    assert view(t1, ProgressRecord("t2", 52, 0, 1.0, Role.TRAINER)).global_step == 51  # until a second follows
    assert view(ProgressRecord("t1", 52, 0, 1.0, Role.TRAINER), ProgressRecord("c", 52, 0, 1.0, Role.CLIENT),
                t2).global_step == 52  # a client that took the step with a trainer attests it
    assert view(t1, t2, ProgressRecord("bb", 60, 0, 0.0, Role.BACKBONE)).global_step == 60  # a backbone's checkpoint
    # beside a backbone, a lone member's far step is not the run's: the backbone vouches for HISTORY steps
    alone = ProgressRecord("m", 1051, 0, 1.0, Role.TRAINER)
    assert view(alone, backbone).global_step == 40 and view(alone).global_step == 1051
    assert view(ProgressRecord("t1", 40 + HISTORY - 1, 0, 1.0, Role.TRAINER), backbone).global_step == 40 + HISTORY - 1
    # nor does its fingerprint vote: every step before it looked taken to a lone honest trainer
    far = ProgressRecord("m", 1051, 0, 1.0, Role.TRAINER, fingerprint="1051:ee")
    beside = view(ProgressRecord("t1", 8, 0, 1.0, Role.TRAINER, fingerprint="8:aa"), far, backbone)
    assert not beside.votes(far) and not beside.took(8, exclude="t1") and beside.consensus_fingerprint(1051) is None


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="run_id"):
        PeerConfig(run_id="bad id!").validate()
    for name in ("\x1b[2J", "x" * 33, "tab\tname ", ""):
        with pytest.raises(ConfigError, match="name") if name else contextlib.nullcontext():
            PeerConfig(name=name).validate()
    assert PeerConfig(name="Rahim's RTX 3060").validate().name == "Rahim's RTX 3060"
    with pytest.raises(ConfigError, match=r"initial_peers 'localhost:1234' is not a multiaddr: .* such as /ip4/"):
        PeerConfig(initial_peers=("localhost:1234",)).validate()
    with pytest.raises(ConfigError, match="multiaddr"):
        PeerConfig(host_maddrs=("0.0.0.0:1234",)).validate()
    with pytest.raises(ConfigError, match="strategy"):
        AveragingConfig(strategy="gossip").validate()
    with pytest.raises(ConfigError, match="max_group_size"):
        AveragingConfig(max_group_size=1).validate()
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(AveragingConfig, {"timeout": 3})
    assert from_dict(PeerConfig, {"initial_peers": ["/ip4/1.2.3.4/tcp/1"]}).initial_peers == ("/ip4/1.2.3.4/tcp/1",)
    with pytest.raises(ConfigError, match="planner"):
        AveragingConfig(planner="magic").validate()
    with pytest.raises(ConfigError, match="upload_mbps"):
        AveragingConfig(upload_mbps=0).validate()
    with pytest.raises(ConfigError, match="probe_mb"):
        AveragingConfig(probe_mb=1000).validate()
    with pytest.raises(ConfigError, match="aggregator_only"):
        AveragingConfig(aggregator_only=True, share=0).validate()


def test_a_trainer_left_on_a_shared_default_run_id_or_an_open_run_is_warned():
    from dedloc.roles.trainer import on_defaults

    peer = "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWJX6ZnqhDUdWPKNYsNhKGWD8JYFE9hWNoqZFWGRuhp3UH"
    said = on_defaults(PeerConfig(initial_peers=(peer,)))
    assert len(said) == 2 and "--run-id is the default 'dedloc'" in said[0] and "an open run" in said[1]
    assert on_defaults(PeerConfig(run_id="bn", initial_peers=(peer,), owner="k")) == []
    assert on_defaults(PeerConfig(run_id="bn")) == []  # starting a run alone: the no-initial-peers line says it
    assert on_defaults(PeerConfig(initial_peers=(peer.replace("1.2.3.4", "127.0.0.1"),))) == []  # this machine only


def test_rate_estimate_takes_a_high_quantile_of_recent_lower_bounds():
    est = RateEstimate(window=4)
    assert est.value(now=0) == 0.0
    for t, rate in enumerate([10e6, 2e6, 11e6, 9e6]):  # one slow far end among good measurements
        est.observe(rate, 1.0, now=t)
    assert est.value(now=4) == 11e6  # the 0.75 quantile of 4: the slow one does not count
    est.observe(100, 1e-6, now=5)  # tiny transfers say nothing about bandwidth
    assert est.value(now=5) == 11e6
    for t in range(6, 10):  # a lasting drop shows once the window has seen it
        est.observe(1e6, 1.0, now=t)
    assert est.value(now=10) == 1e6
    assert est.value(now=10 + est.max_age + 1) == 0.0  # old observations are forgotten
    assert RateEstimate(override=5e6).value() == 5e6


def test_passive_rounds_raise_the_estimate_but_cannot_talk_it_down():
    est = RateEstimate(window=4)
    for t in range(4):
        est.observe(10e6, 1.0, now=t)  # probes: 10 MB/s
    for t in range(4, 12):  # rounds that did not load the link fully
        est.observe(3e6, 1.0, now=t, passive=True)
    assert est.value(now=12) == 10e6
    for t in range(12, 16):  # rounds that carried more than the probes saw
        est.observe(12e6, 1.0, now=t, passive=True)
    assert est.value(now=16) == 12e6
    for t in range(16, 20):  # a lasting drop, seen by probes and rounds alike
        est.observe(1e6, 1.0, now=t)
        est.observe(1e6, 1.0, now=t, passive=True)
    assert est.value(now=20) == 1e6


def test_capability_records_are_validated():
    rec = CapabilityRecord("a", 1e6, 2e6, {"b": 3e5}, client=True, samples_per_second=7.0, time=1.0)
    assert CapabilityRecord.from_wire("a", rec.to_wire()) == rec
    good = rec.to_wire()
    for bad in ({**good, "u": -1}, {**good, "d": float("inf")}, {**good, "p": {"b": float("nan")}},
                {**good, "p": {f"p{i}": 1.0 for i in range(100)}}, {**good, "p": "junk"}, {"u": 1}, "junk", None):
        assert CapabilityRecord.from_wire("x", bad) is None


def test_concurrent_rate_counts_only_the_window_where_all_streams_ran():
    fast = [(0.0, 0), (0.1, 1_000_000), (0.2, 2_000_000)]  # 10 MB/s, done at 0.2 s
    slow = [(0.0, 0), (1.0, 1_000_000), (2.0, 2_000_000)]  # 1 MB/s, done at 2 s
    assert concurrent_rate([fast, slow]) == pytest.approx(11e6)
    assert concurrent_rate([[(0.0, 0), (0.01, 10)], slow]) is None  # overlap too short to say anything


def test_aggregator_only_members_never_represent_a_subgroup():
    ms = tuple(Member(f"p{i}", 0.0 if i % 2 else 1.0, 1.0, False, fetch=not i % 2) for i in range(6))
    group = Group(bytes(16), 0, ms, split_into_subgroups(ms, 2))
    for k in range(len(group.subgroups)):
        assert group.members[group.representative(k)].fetch
    assert Group.from_wire(group.to_wire()) == group


def test_all_finite_finds_any_nan_or_inf():
    from dedloc.numerics import all_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(10_001).to(dtype)
        assert all_finite(x)
        for pos in (0, 5_000, 10_000):
            for bad in (math.nan, math.inf, -math.inf):
                y = x.clone()
                y[pos] = bad
                assert not all_finite(y), (dtype, pos, bad)
    assert all_finite(torch.empty(0))
    assert all_finite(torch.full((3,), 3e38)), "large finite values are finite (a sum would overflow)"


def test_buffer_pool_reuses_and_bounds_idle_memory():
    from dedloc.averaging.buffers import BufferPool

    pool = BufferPool(max_idle_bytes=3 * 400)
    a = pool.take(100)
    a.fill_(7)
    pool.give(a)
    b = pool.take(100, zero=True)
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, torch.zeros(100))
    assert pool.take(100).data_ptr() != b.data_ptr()  # b is taken: a new one
    pool.give(b[:50])  # a view is never pooled (its base may still be in use)
    assert pool.take(50).data_ptr() != b.data_ptr()
    for t in [torch.empty(100) for _ in range(5)]:
        pool.give(t)
    assert pool._idle_bytes <= 3 * 400
    assert pool.take(100, dtype=torch.float16).dtype == torch.float16


# ---- lineage: which history the collaboration took ---------------------------------------------------------
def _view(*fps):
    from dedloc.records import CollaborationView, ProgressRecord, Role
    return CollaborationView.build([ProgressRecord(f"peer{i}", int(fp.partition(":")[0] or 0), 0, 0.0, Role.TRAINER,
                                                   fingerprint=fp) for i, fp in enumerate(fps)], now=0.0)


def test_lineage_votes_count_only_steps_the_lineage_holds():
    from dedloc.state import lineage
    ours = {}
    for fp in ("3:a", "4:b", "5:c"):
        ours = lineage.extend(ours, fp)
    v = lineage.votes(ours, _view("4:b", "5:c", "4:x", "9:z", ""))
    assert v.agree == ("peer0", "peer1") and v.disagree == ("peer2",)
    assert not v.outvoted()
    assert lineage.first_conflict(ours, _view("4:x", "3:y")) == 3
    # a newcomer that trained alone from an old checkpoint: the others, back, outvote it
    fork = lineage.extend(lineage.extend({3: "3:a"}, "4:f"), "5:g")
    assert lineage.votes(fork, _view("4:b", "4:b", "5:g"), exclude="peer2").outvoted(own="peer2")
    # a tie goes to the side whose smallest voting peer id is smaller, on both sides alike
    tie = lineage.votes({4: "4:b"}, _view("4:b", "4:x"))
    assert tie.outvoted() is False and lineage.votes({4: "4:x"}, _view("4:b", "4:x")).outvoted() is True


def test_a_clients_fingerprint_counts_only_while_a_trainer_holds_the_same_parameters():
    """A state that only clients hold can be downloaded from nobody: their fingerprints neither make
    a step taken (rule 10) nor outvote a trainer's history, unless no trainer is alive."""
    from dedloc.state import lineage

    def rec(peer, role, fp, syncing=False):
        return ProgressRecord(peer, 1, 0, 0.0, role, fingerprint=fp, syncing=syncing)

    alone = CollaborationView.build([rec("c1", Role.CLIENT, "1:own"), rec("t1", Role.TRAINER, "0:a")])
    assert not alone.took(0, exclude="t1") and lineage.fingerprints(alone) == {"t1": "0:a"}
    assert alone.consensus_fingerprint(1) is None
    backed = CollaborationView.build([rec("c1", Role.CLIENT, "1:b"), rec("t2", Role.TRAINER, "1:b"),
                                      rec("t1", Role.TRAINER, "0:a")])
    assert backed.took(0, exclude="t1") and lineage.fingerprints(backed)["c1"] == "1:b"
    # a trainer that publishes it while resyncing holds no state to serve yet
    syncing = CollaborationView.build([rec("c1", Role.CLIENT, "1:b"), rec("t2", Role.TRAINER, "1:b", syncing=True)])
    assert not syncing.votes(syncing.peers[0])
    # with no trainer alive, the clients are the collaboration
    clients = CollaborationView.build([rec("c1", Role.CLIENT, "1:x"), rec("c2", Role.CLIENT, "1:x")])
    assert clients.consensus_fingerprint(1) == "1:x" and clients.took(0)
    # the client stepped back: a trainer's history is not outvoted by an unbacked client's
    forked = CollaborationView.build([rec("a-client", Role.CLIENT, "1:own"), rec("t1", Role.TRAINER, "1:t")])
    assert not lineage.votes({1: "1:t"}, forked).outvoted(own="t1")
    assert forked.consensus_fingerprint(1) == "1:t"


def test_lineage_keeps_the_newest_steps_and_drops_a_rewritten_future():
    from dedloc.state import lineage
    ours = {}
    for s in range(lineage.KEEP + 10):
        ours = lineage.extend(ours, f"{s}:h{s}")
    assert len(ours) == lineage.KEEP and min(ours) == 10
    again = lineage.extend(ours, "20:new")  # a state of step 20 replaces everything after it
    assert max(again) == 20 and again[20] == "20:new" and again[19] == "19:h19"
    assert lineage.extend(ours, "garbage") == ours and lineage.parse("x:1") is None
    # as a state header carries it: a list of "t:h", at most KEEP, each well formed
    assert lineage.from_list(["3:a", "4:b"]) == {3: "3:a", 4: "4:b"} and lineage.from_list([]) == {}
    assert lineage.from_list(["3:a", 4]) is None and lineage.from_list("3:a") is None
    assert lineage.from_list([f"{s}:h" for s in range(lineage.KEEP + 1)]) is None


def test_the_global_step_is_led_by_peers_that_hold_the_state():
    """An aggregator-only peer's record names the next round it serves; after a round that failed
    for the trainers it is 'ahead' at a step nobody holds, and must not lead the global step."""
    now = 0.0
    view = CollaborationView.build([ProgressRecord("t1", 320, 8, 1.0, Role.TRAINER, time=now),
                                    ProgressRecord("agg", 321, 0, 0.0, Role.AGGREGATOR, time=now),
                                    ProgressRecord("bb", 300, 0, 0.0, Role.BACKBONE, time=now)], now=now)
    assert view.global_step == 320 and [r.peer_id for r in view.current] == ["t1"]
    assert CollaborationView.build([ProgressRecord("agg", 7, 0, 0.0, Role.AGGREGATOR)]).global_step == 0


def test_a_client_past_the_only_trainer_is_not_the_run_while_that_trainer_resyncs():
    """In CI (issue 38's first try) a trainer and a client took a step and the trainer left at once;
    the other trainer, resyncing, left the client alone 'settled': its step became the run's, which
    nobody could serve, and both waited forever. A resyncing trainer still serves what it holds."""
    trainer = ProgressRecord("u", 0, 0, 1.0, Role.TRAINER, syncing=True)
    client = ProgressRecord("c", 1, 0, 1.0, Role.CLIENT)
    assert CollaborationView.build([trainer, client], now=0.0).global_step == 0
    assert CollaborationView.build([replace(trainer, syncing=False), client], now=0.0).global_step == 0
    # a resyncing trainer behind settled peers still does not hold the run back
    ahead = [ProgressRecord("t1", 9, 0, 1.0, Role.TRAINER), ProgressRecord("t2", 9, 0, 1.0, Role.TRAINER)]
    assert CollaborationView.build([trainer, client, *ahead], now=0.0).global_step == 9
    assert CollaborationView.build([trainer, ahead[0]], now=0.0).global_step == 9


def test_the_leaders_round_timeout_travels_with_the_group():
    """Members with other averaging_timeouts once gave up at 20 s on a round that an aggregator with
    60 s still served for 57 s: the leader's deadline is the round's, for every member."""
    g = Group(bytes(16), 3, (Member("a", 1.0, 1.0), Member("b", 2.0, 1.0)), timeout=20.0)
    assert Group.from_wire(g.to_wire()).timeout == 20.0
    older = g.to_wire()
    older.pop("timeout")  # a leader from before: each member keeps its own
    assert Group.from_wire(older).timeout is None
    for bad in (0, -1.0, 1e9, "soon"):
        wire = g.to_wire()
        wire["timeout"] = bad
        with pytest.raises(ProtocolError, match="malformed group"):
            Group.from_wire(wire)


def test_reachability_rules_without_a_prober():
    """The verdicts that need no dial-back, and what a dial-back request may make a prober dial."""
    from hivemind.utils.multiaddr import Multiaddr

    from dedloc.net.reachability import MAX_PORTS, observed_ip, probe, tcp_ports

    loopback = [Multiaddr("/ip4/127.0.0.1/tcp/4001"), Multiaddr("/ip4/127.0.0.1/udp/4001/quic-v1")]
    assert asyncio.run(probe(None, "r", [], loopback)).public  # the first peer starts the run
    local = asyncio.run(probe(None, "r", ["someone"], loopback))
    assert local.public and "loopback" in local.how  # a local run (the demo, the tests)
    lan_quic_only = asyncio.run(probe(None, "r", ["someone"], [Multiaddr("/ip4/192.168.1.2/udp/4001/quic-v1")]))
    assert not lan_quic_only.public and "no TCP" in lan_quic_only.how
    many = [Multiaddr(f"/ip4/10.0.0.1/tcp/{p}") for p in range(5000, 5010)]
    assert tcp_ports(many + [Multiaddr("/ip4/1.2.3.4/tcp/7/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
                                       "/p2p-circuit")]) == list(range(5000, 5000 + MAX_PORTS))
    assert observed_ip(Multiaddr("/ip4/100.200.0.100/udp/4001/quic-v1")) == "100.200.0.100"
    assert observed_ip(Multiaddr("/ip4/100.200.0.10/tcp/1/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
                                 "/p2p-circuit")) is None  # a relayed stream: nobody to dial


def test_listen_default_follows_the_initial_peers():
    """Loopback while every initial peer is on this machine; every interface, TCP and QUIC, otherwise."""
    assert PeerConfig().listen_maddrs() == ("/ip4/127.0.0.1/tcp/0",)
    assert PeerConfig(initial_peers=("/ip4/127.0.0.1/tcp/5/p2p/x",)).listen_maddrs() == ("/ip4/127.0.0.1/tcp/0",)
    far = PeerConfig(initial_peers=("/ip4/1.2.3.4/tcp/31337/p2p/x",)).listen_maddrs()
    assert "/ip4/0.0.0.0/tcp/0" in far and "/ip4/0.0.0.0/udp/0/quic-v1" in far
    assert PeerConfig(host_maddrs=("/ip4/0.0.0.0/tcp/9",)).listen_maddrs() == ("/ip4/0.0.0.0/tcp/9",)
    with pytest.raises(ConfigError, match="reachability"):
        PeerConfig(reachability="maybe").validate()
    with pytest.raises(ConfigError, match="relay_service"):
        PeerConfig(client_mode=True, relay_service=True).validate()


def test_a_private_member_aggregates_only_over_direct_paths():
    """The planner lets a NAT'd member aggregate only when its record lists every other member as
    a direct connection; a malformed or oversized list of direct peers drops the record."""
    from dedloc.planning.planner import Planner

    members = (Member("a", 1.0, 1.0), Member("b", 1.0, 1.0, private=True), Member("c", 1.0, 1.0))
    assert Planner._direct_to_all(members[1], CapabilityRecord("b", direct=("a", "c")), members)
    assert not Planner._direct_to_all(members[1], CapabilityRecord("b", direct=("a",)), members)
    assert not Planner._direct_to_all(members[1], None, members)
    wire = CapabilityRecord("b", 1.0, 1.0, private=True, direct=("a", "c")).to_wire()
    assert CapabilityRecord.from_wire("b", wire).direct == ("a", "c")
    for bad in ("a", [1, 2], ["x"] * 257):
        assert CapabilityRecord.from_wire("b", {**wire, "x": bad}) is None
    g = Group(bytes(16), 0, members)
    back = Group.from_wire(g.to_wire())
    assert [m.private for m in back.members] == [False, True, False] and not back.members[1].reachable
    # in a ring no two NAT'd members are neighbours (neither could dial the other); too many is an error
    four = tuple(Member(p, 1.0, 1.0, private=p in "bd") for p in "abcd")
    order = ring_order(Group(bytes(16), 0, four))
    assert all(four[order[k]].reachable or four[order[(k + 1) % 4]].reachable for k in range(4)), order
    with pytest.raises(AveragingError, match="ring needs"):
        ring_order(Group(bytes(16), 0, tuple(Member(p, 1.0, 1.0, private=p != "a") for p in "abc")))


def test_per_peer_warnings_warn_once_per_interval_per_peer(caplog):
    import logging

    from dedloc.logs import PerPeerWarnings

    log = logging.getLogger("dedloc.test.perpeer")
    log.propagate = True
    warnings = PerPeerWarnings(log, interval=3600, capacity=2)
    with caplog.at_level(logging.DEBUG, logger="dedloc.test.perpeer"):
        for _ in range(100):
            warnings.warn("peerA", "bad request from peerA")
        warnings.warn("peerB", "bad request from peerB")
        warnings.warn("peerC", "bad request from peerC")  # forgets peerA (capacity 2)
        warnings.warn("peerA", "bad request from peerA")
    name = {logging.WARNING: "WARNING", logging.DEBUG: "DEBUG"}  # hivemind renames WARNING to WARN
    levels = [(name.get(r.levelno), r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels.count(("WARNING", "bad request from peerA")) == 2  # once, and again once forgotten
    assert levels.count(("DEBUG", "bad request from peerA")) == 99
    assert ("WARNING", "bad request from peerB") in levels and ("WARNING", "bad request from peerC") in levels


def test_once_per_step_logs_an_event_at_info_once_per_step_until_forgotten(caplog):
    import logging

    from dedloc.logs import OncePerStep

    log = logging.getLogger("dedloc.test.oncepersstep")
    log.propagate = True
    noted = OncePerStep(log, keep=2)
    with caplog.at_level(logging.DEBUG, logger="dedloc.test.oncepersstep"):
        for step in (1, 1, 1, 2, 2):
            noted.log(step, "held", f"held at {step}")
        noted.log(2, "other", "another event at 2")
        noted.forget(2, "held")  # the condition ended: news again
        noted.log(2, "held", "held at 2")
        noted.log(3, "held", "held at 3")  # keep=2: step 1 is forgotten
        noted.log(1, "held", "held at 1")
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == ["held at 1", "held at 2", "another event at 2", "held at 2", "held at 3", "held at 1"]
    assert debug == ["held at 1", "held at 1", "held at 2"]
    assert noted.seen(3, "held") and not noted.seen(3, "other")


def test_claim_bounds_count_implausible_samples_at_their_bound_and_bound_weights():
    from dedloc.optim.claims import NEW_SPEED, SLACK, UNSEEN, ClaimBounds
    from dedloc.records import CollaborationView, ProgressRecord, Role

    def view(step, *recs):
        return CollaborationView.build([ProgressRecord(p, step, n, sps, Role.TRAINER) for p, n, sps in recs])

    claims = ClaimBounds(target_batch_size=100)
    # step 0: joined into it, not seen begin: each peer counts at most UNSEEN target batches
    v = claims.observe(view(0, ("a", 30, 10.0), ("b", 10**9, 10.0)), now=0.0)
    assert [r.samples for r in v.peers] == [30, UNSEEN * 100]
    # last seen at step 0 at t=100, at step 1 at t=103: the step began at the earliest at t=100;
    # at t=110, each may claim SLACK * 10/s * 10 s + a fair share (50)
    claims.observe(view(0, ("a", 90, 10.0), ("b", 10, 10.0)), now=100.0)
    claims.observe(view(1, ("a", 0, 10.0), ("b", 0, 10.0)), now=103.0)
    v = claims.observe(view(1, ("a", 90, 10.0), ("b", 10**9, 10**9)), now=110.0)
    # b's new speed counts only up to NEW_SPEED times the fastest published before the step
    bound_a, bound_b = SLACK * 10.0 * 10 + 50, SLACK * NEW_SPEED * 10.0 * 10 + 50
    assert [r.samples for r in v.peers] == [90, int(bound_b)]
    w = claims.weights(1, v, now=110.0)
    assert w.of("a") == bound_a and w.of("b") == bound_b
    assert w.of("c") == bound_b  # a newcomer, the same
    assert w.excess("b", 10**9) and w.excess("a", 90) is None
    # at b122246 the speed b published (1e9/s) was committed for the next step as its own: every step
    # then closed on its claim. It is committed at most NEW_SPEED times the fastest other peer's
    claims.observe(view(2, ("a", 0, 10.0), ("b", 0, 10**9)), now=111.0)
    v = claims.observe(view(2, ("a", 5, 10.0), ("b", 10**9, 10**9)), now=116.0)
    assert v.peers[1].samples == int(SLACK * NEW_SPEED * 10.0 * 6 + 50)
    # a step this peer resynced into (2 -> 5): it did not see it begin; UNSEEN target batches
    v = claims.observe(view(5, ("a", 10**6, 10.0)), now=117.0)
    assert v.peers[0].samples == UNSEEN * 100


def test_ready_and_closed_records_round_trip_and_refuse_malformed_ones():
    from dedloc.records import MAX_WEIGHT, ClosedRecord, Member, ReadyRecord

    rec = ReadyRecord(Member("p", 16.0, 1.0), numel=1000)
    assert ReadyRecord.from_wire("p", rec.to_wire()) == rec
    assert ReadyRecord.from_wire("p", {"w": 1.0, "s": 3.0, "c": True}).member.share == 0.0  # a client aggregates nothing
    for bad in ({"w": MAX_WEIGHT * 2, "s": 1.0, "c": False}, {"w": 1.0, "s": -1.0, "c": False},
                {"w": 1.0, "s": 1.0, "c": False, "f": False}, {"w": "x"}, [1, 2], None):
        assert ReadyRecord.from_wire("p", bad) is None, bad
    assert ReadyRecord.from_wire("p", {"w": 1.0, "s": 1.0, "c": False, "n": -5}).numel == 0
    assert ClosedRecord.from_wire("l", ClosedRecord("l", ("a", "l")).to_wire()) == ClosedRecord("l", ("a", "l"))
    assert ClosedRecord.from_wire("l", ClosedRecord("l", None).to_wire()) == ClosedRecord("l", None)
    # a member's record closing a group without its own leader (an empty one made every peer miss the step)
    for bad in ("x", [1], {"failed": 1}, ["a"] * 5000, [], ["a", "b"], {"members": [], "until": 5.0}):
        assert ClosedRecord.from_wire("l", bad) is None, bad


def test_a_closed_record_counts_only_the_members_whose_signed_join_it_holds():
    """Stop 46: a member's record of a group of one took every step; naming honest peers it never
    led would make it a group of two (matchmaking rule 13). A member is counted only with its
    signature over (run, step, leader, its process), made by the key inside its peer id."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from dedloc.auth.identity import peer_id_of
    from dedloc.records import ClosedRecord, JoinProof, join_statement

    keys = [ed25519.Ed25519PrivateKey.generate() for _ in range(3)]
    leader, a, b = (peer_id_of(k.public_key()) for k in keys)

    def proof(key, member, step=7, lead=leader, run="r", inc="i1", contributes=True):
        return JoinProof(inc, key.sign(join_statement(run, step, lead, member, inc, contributes)), contributes)

    record = ClosedRecord(leader, (leader, a, b), 5.0, tuple(sorted([(a, proof(keys[1], a)), (b, proof(keys[2], b))],
                                                                    key=lambda mp: mp[0])))  # (read back sorted)
    wire = ClosedRecord.from_wire(leader, record.to_wire())
    assert wire == record and wire.signed("r", 7) == {leader, a, b} and wire.contributors("r", 7) == 3
    assert wire.proof("r", 7, a).incarnation == "i1"
    assert record.signed("r", 8) == {leader} and record.signed("other run", 7) == {leader}  # replayed elsewhere
    forged = (
        ((a, proof(keys[2], a)),),  # signed by another member's key
        ((a, proof(keys[1], a, lead=b)),),  # its join of another leader
        ((a, JoinProof("i2", proof(keys[1], a).signature)),),  # another process's claim on its signature
        ((a, JoinProof("i1", proof(keys[1], a, contributes=False).signature, True)),),  # claimed to contribute
        ((b, proof(keys[2], b)),),  # a valid proof of a member the record does not list
    )
    for proofs in forged:
        assert ClosedRecord(leader, (leader, a), None, proofs).signed("r", 7) == {leader}, proofs
    assert ClosedRecord(leader, (leader, a, b)).signed("r", 7) == {leader}  # names without proofs
    # an aggregator-only member (no samples) joined: proven, but the group has one contributor
    with_aggregator = ClosedRecord(leader, (leader, a), None, ((a, proof(keys[1], a, contributes=False)),))
    assert with_aggregator.signed("r", 7) == {leader, a} and with_aggregator.contributors("r", 7) == 1
    for bad in ({"members": [leader], "sigs": {a: ["i", b"x" * 65, True]}}, {"members": [leader], "sigs": {a: "nope"}},
                {"members": [leader], "sigs": {a: ["i" * 40, b"x" * 64, True]}},
                {"members": [leader], "sigs": {a: ["i", b"x" * 64, 1]}}):
        assert ClosedRecord.from_wire(leader, bad).proofs == (), bad


def test_dedloc_debug_names_the_loggers_that_log_at_debug():
    import os
    import subprocess
    import sys

    code = ("import logging; from dedloc.logs import configure; configure('INFO'); "
            "logging.getLogger('dedloc.averaging.matchmaking').debug('one layer in detail'); "
            "logging.getLogger('dedloc.optim.optimizer').debug('another layer quiet')")
    env = {**os.environ, "DEDLOC_DEBUG": " dedloc.averaging.matchmaking,,"}
    env.pop("DEDLOC_LOG_LEVEL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "one layer in detail" in out.stderr and "another layer quiet" not in out.stderr


def test_framed_parts_that_concatenate_alike_give_different_bytes():
    from dedloc.framing import framed

    assert framed("ab", "c") != framed("a", "bc")
    assert framed(b"x", "y") == b"\0\0\0\1x\0\0\0\1y"
    assert framed("é", width=2) == b"\0\2" + "é".encode()


def test_a_service_whose_method_differs_from_its_declaration_fails_at_its_class_statement():
    from abc import abstractmethod

    from dedloc.net.runtime import RemoteAPI
    from dedloc.peer_api import PeerAPI
    from dedloc.service import PeerService

    assert "pending_round" in PeerService.declared and "shutdown" not in PeerService.declared

    class API(RemoteAPI, api=True):
        @abstractmethod
        async def read(self, step: int, timeout: float = 1.0) -> int:
            """."""

    with pytest.raises(TypeError, match=r"Renamed does not implement API.read"):
        class Renamed(API):
            async def reads(self, step: int, timeout: float = 1.0) -> int:
                return step
    with pytest.raises(TypeError, match=r"Reordered.read\(self, timeout: float = 1.0, step: int = 0\) -> int differs from its "
                                          r"declaration API.read\(self, step: int, timeout: float = 1.0\)"):
        class Reordered(API):
            async def read(self, timeout: float = 1.0, step: int = 0) -> int:
                return step
    with pytest.raises(TypeError, match=r"Partial does not implement PeerAPI.pending_round"):
        class Partial(PeerService):  # the service as it was, its method named as the training side once called it
            pending_round = PeerAPI.pending_round  # (the declaration's abstract method: not implemented)

            async def pending_numel(self, step: int) -> int:
                return 0

    class Fits(API):
        async def read(self, step: int, timeout: float = 1.0) -> int:
            return step

    assert Fits.declared == frozenset({"read"})


def test_an_owners_tasks_end_with_it_and_a_failure_is_logged_by_owner(caplog):
    from dedloc.tasks import Tasks

    async def main():
        tasks, started = Tasks("the test's owner"), asyncio.Event()

        async def forever():
            started.set()
            await asyncio.Event().wait()

        async def fails():
            raise ValueError("boom")

        loop = tasks.spawn(forever(), name="loop")
        tasks.spawn(fails(), name="failing")
        await started.wait()
        await asyncio.sleep(0)  # the failing one has ended
        assert len(tasks) == 1
        await tasks.close()
        return loop

    with caplog.at_level("WARNING", logger="dedloc.tasks"):
        loop = asyncio.run(main())
    assert loop.cancelled()
    assert "the test's owner: background task failing failed: ValueError: boom" in caplog.text


# ---- the optimizer's step rules (optim/step_rules.py), on made-up records ------------------------
def test_a_volunteer_whose_recipe_is_not_the_runs_is_told_before_it_downloads():
    """A volunteer who forgot `--recipe albert-mlm` downloaded the whole state before "the state does
    not fit this model" (issue 41). Every training peer publishes its run-wide settings' hash; the run's
    is the one most others publish, and a tie goes against the joining peer."""
    def view(*hashes, roles=None):
        return CollaborationView.build([ProgressRecord(f"p{i}", 5, 0, 1.0, (roles or {}).get(i, Role.TRAINER), run_hash=h)
                                        for i, h in enumerate(hashes)], 1000.0)

    assert view("aa", "aa").settings_mismatch("new", "bb") == ("aa", ("p0", "p1"))
    assert view("aa", "aa").settings_mismatch("new", "aa") is None
    assert view("aa", "aa", "bb").settings_mismatch("new", "aa") is None  # a peer that got in wrong is outvoted
    assert view("aa", "bb").settings_mismatch("new", "aa") == ("bb", ("p1",))  # a tie: the newcomer yields
    assert view("aa").settings_mismatch("p0", "bb") is None  # its own record is not the run's
    assert view("", "").settings_mismatch("new", "aa") is None  # peers that publish none (the Python API, old versions)
    # backbones and aggregators train nothing: their records say nothing of the settings
    assert view("aa", "aa", roles={0: Role.BACKBONE, 1: Role.AGGREGATOR}).settings_mismatch("new", "bb") is None
    assert view("aa", roles={0: Role.CLIENT}).settings_mismatch("new", "bb") == ("aa", ("p0",))
    wire = ProgressRecord("x", 1, 0, 1.0, Role.TRAINER, run_hash="aa").to_wire()
    assert ProgressRecord.from_wire("x", wire).run_hash == "aa"
    for bad in ({"run_hash": "a" * 65}, {"run_hash": ["aa"]}, {"run_hash": None}, {"run_hash": "\x1b[2J"}):
        assert ProgressRecord.from_wire("x", {**wire, **bad}) is None
    with pytest.raises(ConfigError, match="run_hash"):
        from dedloc.config import OptimizerConfig
        OptimizerConfig(run_hash="a\n").validate()


def test_a_joining_optimizer_with_other_settings_is_refused_before_it_downloads_and_leaves_no_record():
    from dedloc.config import OptimizerConfig
    from dedloc.errors import SettingsMismatch
    from dedloc.optim import CollaborativeOptimizer
    from dedloc.testing.fake_peer import FakeRun

    run = FakeRun()
    try:
        def member(run_hash: str):
            model = torch.nn.Linear(2, 1)
            return model, CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), run.peer(),
                                                 OptimizerConfig(target_batch_size=4, run_hash=run_hash))
        model, first = member("aa")
        for _ in range(2):  # the run takes steps: a newcomer would download its state
            model(torch.ones(4, 2)).sum().backward()
            first.step(4)
        assert first.global_step == 2
        with pytest.raises(SettingsMismatch, match=f"hash bb\\) are not the run's \\(hash aa, published by {first.peer.peer_id}"):
            member("bb")
        assert set(run.records) == {first.peer.peer_id}  # it left: its step-0 record is not the run's
        _, second = member("aa")  # the run's settings join as ever
        assert second.peer.peer_id in run.records
    finally:
        run.close()


def test_a_peer_whose_first_view_missed_the_run_is_still_refused_before_its_first_download():
    """In CI the refused volunteer's first view could come before the DHT held the run's records: it
    passed the check alone and would have downloaded the run's state at its first resync. Until a
    peer has met the run (a download, a round with another), every download is checked first."""
    import time as clock

    from dedloc.config import OptimizerConfig
    from dedloc.errors import SettingsMismatch
    from dedloc.optim import CollaborativeOptimizer
    from dedloc.testing.fake_peer import FakeRun

    run = FakeRun()
    try:
        model = torch.nn.Linear(2, 1)
        late = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), run.peer(),
                                      OptimizerConfig(target_batch_size=64, run_hash="bb"))
        assert late.global_step == 0  # alone: nothing to check against
        for peer in ("t1", "t2"):  # the run's records arrive: two trainers at step 5 with other settings
            run.records[peer] = ProgressRecord(peer, 5, 0, 1.0, Role.TRAINER, time=clock.time(),
                                               fingerprint="5:aa", run_hash="aa")
        with pytest.raises(SettingsMismatch, match="published by t1, t2"):
            for _ in range(20):
                model(torch.ones(4, 2)).sum().backward()
                late.step(4)
        assert late.resyncs == 0 and late.applied_step == 0  # nothing downloaded
    finally:
        run.close()


def _rec(peer: str, step: int, role: Role = Role.TRAINER, applied: int | None = None, t: float = 1000.0,
         syncing: bool = False) -> ProgressRecord:
    return ProgressRecord(peer, step, 8, 4.0, role, 0.0, t, fingerprint="" if applied is None else f"{applied}:h{applied}",
                          syncing=syncing)


def _progress_view(*records: ProgressRecord) -> CollaborationView:
    return CollaborationView.build(list(records), 1000.0)


def test_step_rule_a_backbone_past_the_step_means_the_run_took_it():
    from dedloc.optim.step_rules import checkpointed_past

    assert checkpointed_past(_progress_view(_rec("me", 5), _rec("bb", 6, Role.BACKBONE)), 5) == \
        "a backbone holds step 6, so the run took step 5 already"
    assert checkpointed_past(_progress_view(_rec("me", 5), _rec("bb", 5, Role.BACKBONE), _rec("t", 9)), 5) == ""


@pytest.mark.parametrize("client, catching_up, others, expect", [
    (True, False, [_rec("t", 4)], "a client-mode peer"),  # ahead of the only trainer: held
    (False, True, [_rec("t", 4)], "a peer still catching up"),
    (False, False, [_rec("t", 4)], None),  # a trainer that serves its state leads
    (True, False, [_rec("t", 5)], None),  # another reachable trainer is at the step
    (True, False, [_rec("c", 4, Role.CLIENT)], None),  # no other server of state at all: nobody to wait for
    (True, False, [_rec("bb", 4, Role.BACKBONE)], None),  # no other trainer alive: the clients are the run
])
def test_step_rule_held_back_alone(client, catching_up, others, expect):
    from dedloc.optim.step_rules import held_back_alone

    why = held_back_alone(_progress_view(_rec("me", 5, Role.CLIENT if client else Role.TRAINER), *others), "me", 5, client,
                          catching_up)
    assert (why is None) == (expect is None) and (expect is None or expect in why), why


def _windows():
    from dedloc.optim.step_rules import Windows

    return Windows(matchmaking_time=5.0, averaging_timeout=20.0, state_timeout=120.0)  # a round: 40 s


@pytest.mark.parametrize("records, waited, expect", [
    ([_rec("t", 7, applied=7)], 0.0, "a peer holds its update"),
    ([_rec("t", 6, applied=6, t=1001.0)], 5.0, "another training peer is still accumulating for it"),
    ([_rec("t", 6, applied=6, t=1001.0)], 41.0, None),  # past a round's length: frozen, or waiting on us
    ([_rec("t", 6, applied=6, syncing=True, t=1001.0)], 5.0, "may not have published it yet"),  # resyncing: not at it
    ([_rec("t", 7, applied=6, t=1001.0)], 19.0, "may not have published it yet"),  # < 2 * 5 + 10 s
    ([_rec("t", 7, applied=6, t=1000.0)], 25.0, "no record from another peer since the catch-up started"),
    ([_rec("t", 7, applied=6, t=1000.0)], 121.0, None),  # stale, but state_timeout has passed
    ([_rec("t", 7, applied=6, t=1001.0)], 25.0, None),  # fresh news, nobody holds it: lost by all
    ([_rec("c", 7, Role.CLIENT, applied=7, t=1001.0)], 25.0, None),  # a client's copy cannot be downloaded
])
def test_step_rule_skip_waits(records, waited, expect):
    from dedloc.optim.step_rules import skip_waits

    why = skip_waits(_progress_view(_rec("me", 7, applied=6), *records), "me", 7, waited, {"t": 1000.0, "c": 1000.0},
                     _windows())
    assert (why is None) == (expect is None) and (expect is None or expect in why), why


def test_step_rule_round_may_finish_and_skip_published():
    from dedloc.optim.step_rules import round_may_finish, skip_published

    assert round_may_finish(1010.0, 1000.0) and not round_may_finish(1000.0, 1000.0) and not round_may_finish(None, 0)
    view = _progress_view(_rec("me", 7, applied=6), ProgressRecord("t", 7, 0, 1.0, Role.TRAINER, 0.0, 1000.0, fingerprint="7:h6"))
    assert skip_published(view, "me", 7, "6:h6")  # same parameters, one step on: it skipped step 6
    assert not skip_published(view, "me", 7, "6:other")


@pytest.mark.parametrize("records, catchup_step, waited, expect", [
    ([_rec("t", 8, applied=7)], 8, 1.0, True),  # the others are at 8 holding 7: in the round of 7
    ([_rec("t", 8, applied=8)], 8, 1.0, False),  # one shows 8 applied: the round of 7 is over
    ([_rec("t", 8, applied=7)], 7, 1.0, False),  # catching up on another step
    ([_rec("t", 8, applied=7)], None, 1.0, False),  # not catching up
    ([_rec("t", 8, applied=7)], 8, 40.0, False),  # a round's length has passed
    ([_rec("t", 8, applied=6)], 8, 1.0, False),  # nobody at the step holds the step before
])
def test_step_rule_others_in_missed_round(records, catchup_step, waited, expect):
    from dedloc.optim.step_rules import others_in_missed_round

    assert others_in_missed_round(_progress_view(_rec("me", 8, applied=7), *records), "me", 8, catchup_step, waited,
                                  _windows()) is expect


@pytest.mark.parametrize("others, target, facts, expect", [
    ([_rec("t", 7), _rec("u", 7)], 8, {}, ("resync", "ahead")),  # the run is two steps past this peer
    ([_rec("bb", 6, Role.BACKBONE)], 8, {}, ("resync", "checkpointed")),
    ([_rec("t", 5)], 8, {"disagreement": "a fork"}, ("resync", "disagrees")),
    ([_rec("t", 4)], 64, {}, ("accumulate", "below target")),  # 8 of 64 samples: compute on
    ([_rec("t", 6), _rec("u", 6)], 64, {}, ("round", "due")),  # below target, but the run took the step: join
    ([_rec("t", 4)], 8, {"client": True}, ("hold", "held back alone")),
    ([_rec("t", 5)], 8, {"missed": True}, ("hold", "missed round")),
    ([_rec("t", 5)], 16, {}, ("round", "due")),
])
def test_step_rule_at_the_step_boundary(others, target, facts, expect):
    from dedloc.optim.step_rules import at_boundary

    asked = []

    def missed() -> bool:
        asked.append(True)
        return facts.get("missed", False)

    role = Role.CLIENT if facts.get("client") else Role.TRAINER
    decision = at_boundary(_progress_view(_rec("me", 5, role, applied=5), *others), "me", 5, target,
                           disagreement=facts.get("disagreement"), client=facts.get("client", False),
                           catching_up=False, missed_round_runs=missed)
    assert (decision.action.value, decision.rule) == expect, decision
    # the one fact that may read the DHT is gathered only when every rule before it let the round go
    assert bool(asked) == (decision.rule in ("missed round", "due")), asked


# ---- matchmaking's rules (averaging/match_rules.py), on made-up records ---------------------------
def _signed_group(step: int = 7, run: str = "r"):
    """Four identities (leader, a, b, me), and a helper building ``closed`` records of the leader's
    with the listed members' signed joins."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from dedloc.auth.identity import peer_id_of
    from dedloc.records import ClosedRecord, JoinProof, join_statement

    keys = [ed25519.Ed25519PrivateKey.generate() for _ in range(4)]
    ids = [peer_id_of(k.public_key()) for k in keys]
    leader = ids[0]

    def record(*joined: int, listed: tuple[int, ...] = (), inc: str = "i1"):
        proofs = tuple(sorted((ids[i], JoinProof(inc, keys[i].sign(join_statement(run, step, leader, ids[i], inc, True)),
                                                 True)) for i in joined))
        return ClosedRecord(leader, tuple(ids[i] for i in (0, *joined, *listed)), 5.0, proofs)

    return ids, record


def _ready(*entries: tuple[str, float, bool]) -> dict:
    from dedloc.records import Member

    return {p: Member(p, w, 0.0 if client else 1.0, client) for p, w, client in entries}


def test_match_rule_whose_group_closes_a_step_for_whom():
    from dedloc.averaging.match_rules import Asker, closes_for

    (leader, a, b, me), record = _signed_group()
    asker = Asker("r", me, "mine", client=False)
    # two provable contributors: it closes the step for every peer it left out
    assert closes_for(asker, 7, record(1), None)[0] == f"the round led by {leader} closed without this peer"
    # a group of one contributor (others named without their signed joins): not before the gather...
    assert closes_for(asker, 7, record(listed=(1, 2)), None) == (None, set())
    # ...nor while another contributing peer is ready to take the step with this one...
    assert closes_for(asker, 7, record(), _ready((me, 8, False), (b, 8, False))) == (None, {b})
    # ...but when nobody else is (a client beside clients only would take it alone: nobody to take it with)
    assert "a group of one, and no other peer is at the step" in closes_for(asker, 7, record(), _ready((me, 8, False)))[0]
    client = Asker("r", me, "mine", client=True)
    assert closes_for(client, 7, record(), _ready((me, 8, True), (b, 8, True)))[0] is not None
    assert closes_for(asker, 7, record(), _ready((me, 8, False), (b, 0, False)))[0] is not None  # b brings no samples
    # a record that lists this peer closes nothing for it, unless it holds another process's join of it
    (leader, a, b, me), record = _signed_group()
    mine = Asker("r", b, "i1", client=False)
    assert closes_for(mine, 7, record(1, 2), None) == (None, set())
    restarted = Asker("r", b, "i2", client=False)
    assert closes_for(restarted, 7, record(1, 2), None)[0] == \
        f"the round led by {leader} closed with an earlier process of this peer"


def test_match_rule_leaders_outranking_and_the_lone_lead():
    from dedloc.averaging.match_rules import Asker, declines_lone_lead, leaders, never_joined, outranked_by, silent_since
    from dedloc.records import ClosedRecord, Member

    ready = {"p3": Member("p3", 8, 1.0), "p1": Member("p1", 8, 0.0, client=True), "p2": Member("p2", 8, 1.0),
             "p0": Member("p0", 8, 1.0, private=True)}
    assert leaders(ready) == ["p2", "p3"] and leaders(ready, {"p2"}) == ["p3"]  # no client, no NAT'd peer leads
    # rule 9: between two groups of one, the smaller leader id wins; a larger group wins over one
    (leader, a, b, me), record = _signed_group()
    asker = Asker("r", me, "mine", client=False)
    assert outranked_by(asker, 7, {leader: record()}) == (leader if leader < me else None)
    assert outranked_by(asker, 7, {leader: record(1)}) == leader
    assert outranked_by(asker, 7, {leader: record(listed=(3,))}) is None  # it lists this peer
    assert outranked_by(asker, 7, {}) is None
    assert isinstance(record(), ClosedRecord)
    # rule 14: the only contributor declines once while others are at the step
    me_m, agg = Member("me", 8, 1.0), Member("agg", 0, 1.0, fetch=False)
    assert never_joined(ready, {"me": me_m}, {"p2"}) == {"p0", "p1", "p3"}
    assert declines_lone_lead({"me": me_m, "agg": agg}, True, None, {})  # an aggregator does not make two
    assert declines_lone_lead({"agg": agg, "me": me_m}, True, None, {})  # whoever leads (an aggregator-only leader)
    assert not declines_lone_lead({"me": me_m}, True, {}, {})  # the second time it closes
    assert not declines_lone_lead({"me": me_m}, False, None, {})  # nobody else at the step
    assert not declines_lone_lead({"me": me_m, "p3": ready["p3"]}, True, None, {})  # two contributors
    assert not declines_lone_lead({"agg": agg}, True, None, {})  # no contributor: rule 4's
    # ... and again while a trainer at the step at the first decline has published nothing since
    # (frozen or dead: it waits for it to come back or for its record to lapse)
    then = {"p2": 100.0, "p3": 200.0}
    assert declines_lone_lead({"me": me_m}, True, then, {"p2": 100.0, "p3": 201.0})  # p2 silent
    assert silent_since(then, {"p2": 100.0, "p3": 201.0}) == ["p2"]
    assert not declines_lone_lead({"me": me_m}, True, then, {"p2": 101.0, "p3": 201.0})  # both alive: it closes
    assert not declines_lone_lead({"me": me_m}, True, then, {"p3": 201.0})  # p2's record lapsed (or it left)
    assert not declines_lone_lead({"me": me_m}, False, then, {})  # nobody at the step any more


@pytest.mark.parametrize("ready, matchmaking_time, period", [
    (1, 3.0, 0.05), (8, 3.0, 0.05),  # a small run reads as often as it always did
    (16, 3.0, 0.1), (100, 3.0, 0.625),  # beyond 8, the whole set is read 160 times a second at most
    (1000, 3.0, 0.75), (1000, 0.1, 0.05),  # at most a quarter of matchmaking_time, never below the floor
])
def test_match_rule_the_ready_records_are_read_less_often_the_more_peers_are_ready(ready, matchmaking_time, period):
    assert match_rules.poll_period(ready, matchmaking_time) == pytest.approx(period)


@pytest.mark.parametrize("answer", [
    JoinAnswer.joined({"step": 3}), JoinAnswer.redirected("Qm-leader"), JoinAnswer.missed(),
    JoinAnswer.missed(True, {"members": ["a", "b"]}), JoinAnswer.missed(False), JoinAnswer.round_failed(),
    JoinAnswer.cannot_lead("not matchmaking for step 3"), JoinAnswer.refused("weight above the bound"),
])
def test_match_rule_a_join_answer_is_one_of_a_closed_set_and_reads_back_as_sent(answer):
    assert JoinAnswer.from_wire(answer.to_wire()) == answer


@pytest.mark.parametrize("wire, kind", [
    ({"missed": True}, Answer.MISSED),  # a leader with no lead for the step says nothing about held
    ({"missed": True, "held": False, "closed": {"members": []}}, Answer.NOT_HELD),
    ({"redirect": 7}, Answer.REFUSED), ({}, Answer.REFUSED), ([1, 2], Answer.REFUSED), (None, Answer.REFUSED),
    ({"error": "no", "pass": 1}, Answer.REFUSED),
])
def test_a_join_answer_reads_as_its_kind_and_a_malformed_one_as_refused(wire, kind):
    assert JoinAnswer.from_wire(wire).kind is kind


def test_an_aggregator_led_group_of_one_trainer_closes_the_step_for_nobody_else():
    """The delayed soak's fork at step 652: an aggregator-only leader's closed record of itself and one
    trainer counted its leader as a contributor (a group of two), so it closed the step for the seven
    trainers still in the round of 651; they missed it, the trainer went on alone. A record now says
    whether its leader brought samples, and such a group is a group of one contributor."""
    from dedloc.averaging.match_rules import Asker, closes_for
    from dedloc.records import ClosedRecord

    (leader, a, b, me), record = _signed_group()
    led_by_aggregator = record(1)
    assert led_by_aggregator.contributors("r", 7) == 2
    led_by_aggregator = ClosedRecord(leader, led_by_aggregator.members, 5.0, led_by_aggregator.proofs,
                                     leader_contributes=False)
    back = ClosedRecord.from_wire(leader, led_by_aggregator.to_wire())
    assert back == led_by_aggregator and back.contributors("r", 7) == 1
    assert ClosedRecord.from_wire(leader, record(1).to_wire()).leader_contributes  # absent: the leader contributes
    asker = Asker("r", me, "mine", client=False)
    assert closes_for(asker, 7, back, _ready((me, 8, False), (b, 8, False))) == (None, {b})


def test_a_cooldown_holds_for_its_seconds_then_is_forgotten():
    from dedloc.net.cooldowns import Cooldowns

    now = [100.0]
    c = Cooldowns(clock=lambda: now[0])
    c.start("p", 60.0)
    assert c.active("p") and not c.active("q")
    now[0] = 159.9
    assert c.active("p")
    now[0] = 160.0
    assert not c.active("p") and not c._until  # forgotten once expired
    c.start("a", 1.0)
    now[0] = 200.0
    c.start("b", 1.0)  # starting one prunes the expired
    assert set(c._until) == {"b"}


def test_a_backbone_refused_as_a_fork_no_longer_sets_the_resync_target():
    """The partition soak's five StateErrors: after a heal, a backbone held a checkpoint of the
    outvoted history, past the kept one's newest step. Refused as a fork it stayed in the view (it
    publishes no fingerprint, by which refused donors were remembered), and a backbone's step is the
    run's: every resync targeted it and refused every donor there for 120 s. Now a refused backbone
    is remembered by its step and left out until it publishes another."""
    from dedloc.errors import ForkError
    from dedloc.optim.progress import Progress
    from dedloc.testing.fake_peer import FakePeer, FakeRun

    trainers = [ProgressRecord(f"t{i}", 329, 0, 1.0, Role.TRAINER, fingerprint=f"329:{i:02x}aa") for i in range(3)]
    backbone = ProgressRecord("bb", 336, 0, 0.0, Role.BACKBONE)
    view = CollaborationView.build([*trainers, backbone])
    assert view.global_step == 336
    progress = Progress(FakePeer(FakeRun(), "me"), 64)
    kept = progress.refused_forks(ForkError("rewrites step 329", peers=("bb",)), view)
    assert "bb" not in {r.peer_id for r in kept.peers} and kept.global_step == 329
    assert progress.without_forks(view).global_step == 329  # while it publishes that step
    moved = CollaborationView.build([*trainers, replace(backbone, step=340)])
    assert progress.without_forks(moved).global_step == 340  # another checkpoint: counted again


def test_the_progress_table_shows_peers_by_their_last_8_characters_and_marks_this_one():
    """Every peer id begins with 12D3KooW: the dashboard showed those characters for every peer, the
    trainer's table others, and neither which row was the reader's (issue 41)."""
    from rich.console import Console

    from dedloc.roles.progress import ProgressDisplay, StepEvent

    me, other = "12D3KooW" + "A" * 36 + "aaaaaaaa", "12D3KooW" + "B" * 36 + "bbbbbbbb"
    display = ProgressDisplay("t", me=me)
    display.view = CollaborationView.build([ProgressRecord(me, 1, 0, 0.0, Role.TRAINER),
                                            ProgressRecord(other, 1, 0, 0.0, Role.TRAINER, name="[red]Ana[/red]")])
    console = Console(record=True, width=120)
    console.print(display.render())
    text = console.export_text()
    assert "aaaaaaaa (you)" in text and "bbbbbbbb" in text and "bbbbbbbb (you)" not in text and "12D3KooW" not in text
    assert "[red]Ana[/red] (bbbbbbbb)" in text  # a chosen name (--name), shown as written: never markup
    display.add(StepEvent(0, 24.0, 8, 40.0, 100.0))  # the line a log file gets per global step
    assert display.line().startswith("global step 1: loss 3.000, 100 samples/s, batch 40, 2 peers, mine 8 (20%), "
                                     "checkpoint -, ")
    # a trainer's running total and share, and an ETA to --max-steps once the pace is known
    paced = ProgressDisplay("t", total_steps=10, me=me)
    paced.started -= 30.0  # (the display's clock: 30 s ago; three steps since)
    for step in range(3):
        paced.add(StepEvent(step, 8.0, 8, 32.0, 10.0))
    assert ", mine 24 (25%), " in paced.line() and paced.line().endswith(", eta 70 s")
