"""The collaborative optimizer against a single-process large-batch reference."""

import threading
import time

import pytest
import torch

from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.errors import RuntimeClosedError, StateError
from dedloc.optim import CollaborativeOptimizer, StepOutcome
from dedloc.peer import Peer
from dedloc.records import ProgressRecord, Role

from conftest import run_id

N, DIM = 4096, 8
AVG = AveragingConfig(matchmaking_time=2, averaging_timeout=20)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    y = torch.sin(x @ torch.randn(DIM, 1, generator=g)) + 0.1 * torch.randn(N, 1, generator=g)
    return x, y


def make_model():
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)  # not the global RNG: trainers run in threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def make_opt(model, lr=0.1, momentum=0.9):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return opt, sched


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


class Trainer(threading.Thread):
    """One peer's ordinary training loop; logs which samples each global step consumed."""

    def __init__(self, index, peer, cfg, micro, delay=0.0, stop_at=None, steps=8, on_step=None, opt_kwargs=None,
                 gate=None):
        super().__init__(daemon=True)
        self.index, self.peer, self.cfg, self.micro, self.delay = index, peer, cfg, micro, delay
        self.stop_at, self.steps, self.on_step, self.gate = stop_at, steps, on_step, gate
        self.log = {}  # step -> [(ids, loss)] of the micro-batches that step consumed
        self.losses = {}  # step being accumulated at compute time -> [(n, loss)]
        self.params = {}  # applied step -> flat params
        self.error = None
        self.opt = None
        self.opt_kwargs = opt_kwargs or {}

    def run(self):
        try:
            x, y = data()
            model = make_model()
            opt, sched = make_opt(model, **self.opt_kwargs)
            self.opt = copt = CollaborativeOptimizer(opt, self.peer, self.cfg, scheduler=sched, model=model)
            self.params[copt.applied_step] = flat(model)
            order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + self.index))
            pos, pending = 0, []
            while copt.global_step < self.steps:
                if self.stop_at is not None and copt.global_step >= self.stop_at:
                    break
                if self.gate:
                    self.gate(copt)  # before each micro-batch
                ids = order[pos:pos + self.micro]
                pos = (pos + self.micro) % (N - self.micro)
                loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
                loss.backward()
                if self.delay:
                    threading.Event().wait(self.delay)  # a slower device
                pending.append((ids, loss.item()))
                self.losses.setdefault(copt.global_step, []).append((len(ids), loss.item()))
                outcome = copt.step(len(ids))
                if outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED) and not self.cfg.delay_updates:
                    self.log[copt.history[-1].step] = pending
                    pending = []
                elif outcome == StepOutcome.RESYNCED:
                    pending = []
                if copt.applied_step not in self.params:
                    self.params[copt.applied_step] = flat(model)
                    if self.on_step:
                        self.on_step(copt.applied_step)
            copt.close()
            self.params[copt.applied_step] = flat(model)
        except BaseException as e:  # surfaced by the test
            self.error = e


def together(n):
    """A Trainer gate: the first micro-batch of each of ``n`` trainers waits until all have joined,
    so no round closes before the others published their records (thread start-up order)."""
    barrier, passed = threading.Barrier(n), set()

    def gate(copt):
        if id(copt) not in passed:
            passed.add(id(copt))
            barrier.wait(30)
    return gate


def join_all(trainers, timeout=200):
    """Wait for trainer threads; fail if any of them hung or raised."""
    for t in trainers:
        t.join(timeout)
        assert not t.is_alive(), f"trainer {t.index} hung"
        assert t.error is None, f"trainer {t.index} failed: {t.error!r}"


def replay(logs, steps, clip):
    """Single-process large-batch training on exactly the logged samples; returns (losses, params)."""
    x, y = data()
    model = make_model()
    opt, sched = make_opt(model)
    losses = []
    for s in range(steps):
        ids = torch.cat([i for log in logs for i, _ in log.get(s, [])])
        loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat(model)


def start(n, rid):
    first = Peer(PeerConfig(run_id=rid), AVG)
    peers = [first] + [Peer(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs), client_mode=(i == 2)), AVG)
                       for i in range(1, n)]
    return peers


@pytest.mark.timeout(240)
def test_large_batch_equivalence_with_late_and_leaving_peers():
    torch.set_num_threads(1)
    steps, target = 10, 64
    cfg = OptimizerConfig(target_batch_size=target, clip_grad_norm=1.0)
    rid = run_id()
    peers = start(3, rid)  # the third peer's optimizer joins later
    late = peers[2]
    reached_two = threading.Event()
    try:
        a = Trainer(0, peers[0], cfg, micro=5, delay=0.01, steps=steps,
                    on_step=lambda s: reached_two.set() if s >= 2 else None)
        b = Trainer(1, peers[1], cfg, micro=8, delay=0.02, stop_at=5, steps=steps)
        a.start(), b.start()
        for _ in range(1200):
            if reached_two.wait(0.1) or a.error or b.error:
                break
        assert a.error is None and b.error is None, (a.error, b.error)
        assert reached_two.is_set(), "the collaboration did not reach step 2"
        c = Trainer(2, late, cfg, micro=13, delay=0.01, steps=steps)
        c.start()
        join_all((a, b, c))
    finally:
        for p in peers:
            p.close()

    trainers = (a, b, c)
    # the late peer downloaded the state at a step >= 2, then contributed
    # (a second resync when the round of the step it downloaded closed before it could join: CI's load)
    assert 1 <= c.opt.resyncs <= 2 and min(c.params) >= 2
    assert any(rec.local_samples > 0 for rec in c.opt.history)
    # the leaver stopped midway
    assert max(b.params) == 5 and max(a.params) == steps
    # identical parameters on all peers after every step they share
    for s in range(steps + 1):
        have = [t.params[s] for t in trainers if s in t.params]
        for other in have[1:]:
            assert torch.equal(have[0], other), f"peers differ after step {s}"
    # realised batch: exactly the logged samples, within [B, B + one micro-batch per peer, and one
    # more for a peer whose lone lead was declined while the others computed theirs: rule 14)
    for s in range(steps):
        consumed = sum(len(i) for t in trainers for i, _ in t.log.get(s, []))
        realised = {rec.batch for t in trainers for rec in t.opt.history if rec.step == s}
        assert realised == {float(consumed)}, (s, realised, consumed)
        assert target <= consumed < target + 2 * (5 + 8 + 13), (s, consumed)
    # a single process on exactly those samples gives the same losses and parameters
    losses, params = replay([t.log for t in trainers], steps, clip=1.0)
    for s in range(steps):
        items = [(len(i), l) for t in trainers for i, l in t.log.get(s, [])]
        collab_loss = sum(n * l for n, l in items) / sum(n for n, _ in items)
        assert collab_loss == pytest.approx(losses[s], rel=1e-5, abs=1e-6), s
    assert torch.allclose(a.params[steps], params, atol=1e-5, rtol=1e-5), (a.params[steps] - params).abs().max()


def curve(trainers, steps):
    out = []
    for s in range(steps):
        items = [x for t in trainers for x in t.losses.get(s, [])]
        out.append(sum(n * l for n, l in items) / sum(n for n, _ in items))
    return out


def run_collaboration(cfg, steps, micro=(5, 8, 13), delays=(0.0, 0.01, 0.02),
                      opt_kwargs=(("lr", 0.05), ("momentum", 0.0))):
    """One trainer per entry of ``micro``; ``opt_kwargs`` () for make_opt's defaults (as replay uses)."""
    peers = start(len(micro), run_id())
    try:
        trainers = [Trainer(i, p, cfg, micro=m, delay=d, steps=steps, opt_kwargs=dict(opt_kwargs))
                    for i, (p, m, d) in enumerate(zip(peers, micro, delays))]
        for t in trainers:
            t.start()
        join_all(trainers)
    finally:
        for p in peers:
            p.close()
    return trainers


@pytest.mark.timeout(240)
def test_delayed_updates_keep_peers_identical():
    torch.set_num_threads(1)
    steps = 12
    sync = run_collaboration(OptimizerConfig(target_batch_size=64), steps)
    delayed = run_collaboration(OptimizerConfig(target_batch_size=64, delay_updates=True), steps)
    # a peer that lost a round resyncs and skips the steps it missed; every step's parameters agree
    assert any(t.opt.resyncs == 0 for t in delayed)
    for s in range(steps + 1):
        have = [t.params[s] for t in delayed if s in t.params]
        assert len(have) >= 2 and all(torch.equal(have[0], p) for p in have[1:]), f"peers differ after step {s}"
    a, b = curve(sync, steps), curve(delayed, steps)
    print("sync", a, "delayed", b)
    tail = steps // 3
    late_a, late_b = sum(a[-tail:]) / tail, sum(b[-tail:]) / tail
    assert late_a < 0.8 * a[0] and late_b < 0.8 * b[0], "the loss did not fall"
    assert abs(late_a - late_b) < 0.15 * late_a, (a, b)


@pytest.mark.timeout(240)
def test_a_killed_peer_does_not_stall_the_others():
    torch.set_num_threads(1)
    steps = 8
    peers = start(3, run_id())
    killed = threading.Event()

    def kill_at_three(s):
        if s >= 3 and not killed.is_set():
            killed.set()
            peers[1].runtime.kill()  # its networking dies mid-run, as a crash would

    cfg = OptimizerConfig(target_batch_size=64)
    try:
        gate = together(3)  # all three are at step 0 before any round (threads start in any order)
        trainers = [Trainer(0, peers[0], cfg, micro=5, delay=0.01, steps=steps, on_step=kill_at_three, gate=gate),
                    Trainer(1, peers[1], cfg, micro=8, delay=0.01, steps=steps, gate=gate),
                    Trainer(2, peers[2], cfg, micro=6, delay=0.01, steps=steps, gate=gate)]
        for t in trainers:
            t.start()
        join_all([trainers[0], trainers[2]])
        trainers[1].join(60)
        assert not trainers[1].is_alive(), "the killed peer's training loop hung"
    finally:
        for p in peers:
            p.close()
    assert killed.is_set()
    assert isinstance(trainers[1].error, RuntimeClosedError), trainers[1].error
    survivors = (trainers[0], trainers[2])
    for s in range(steps + 1):
        have = [t.params[s] for t in survivors if s in t.params]
        assert len(have) == 2 and torch.equal(*have), f"survivors differ after step {s}"


@pytest.mark.timeout(240)
def test_a_peer_behind_a_finished_round_catches_up_and_keeps_its_gradients():
    """Delayed updates. A newcomer holds the state of step 1 while the others finish round 1
    without it (they pause after applying it). Its round-1 attempt misses; it downloads the state
    of step 2 in the background, keeps the gradients it computes meanwhile (on step 1's
    parameters, as the others' were while round 1 flew), and they all go into round 2."""
    torch.set_num_threads(1)
    steps, target = 4, 640  # rounds fly for ~1.3 s, far less than a step (~4 s): none starts early
    cfg = OptimizerConfig(target_batch_size=target, delay_updates=True)
    avg = AveragingConfig(matchmaking_time=1, averaging_timeout=20)
    rid = run_id()
    first = Peer(PeerConfig(run_id=rid), avg)
    peers = [first] + [Peer(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs)), avg) for _ in range(2)]
    paused = {s: [threading.Event(), threading.Event()] for s in (1, 2)}
    resume = {s: threading.Event() for s in (1, 2)}

    def pause(i):
        def at(s):  # called right after peer i applies the update that takes it to step s
            if s in resume:
                if s == 1:
                    trainers[i].opt.offer_state()  # what the newcomer downloads on joining
                paused[s][i].set()
                assert resume[s].wait(120), f"peer {i} was never resumed at step {s}"
        return at

    def newcomer_gate(opt):
        if not resume[1].is_set():  # joined at step 1: let the others finish round 1 without it
            resume[1].set()
            assert all(e.wait(120) for e in paused[2]), "the others did not reach step 2"
        elif opt.catchups and not resume[2].is_set():  # missed round 1 and is catching up
            resume[2].set()

    try:
        trainers = [Trainer(i, p, cfg, micro=8, delay=0.1, steps=steps, on_step=pause(i))
                    for i, p in enumerate(peers[:2])]
        for t in trainers:
            t.start()
        for e in paused[1]:
            for _ in range(1200):
                if e.wait(0.1) or any(t.error for t in trainers):
                    break
        assert all(t.error is None for t in trainers), [t.error for t in trainers]
        assert all(e.is_set() for e in paused[1]), "the first two peers did not reach step 1"
        newcomer = Trainer(2, peers[2], cfg, micro=8, delay=0.1, steps=steps, gate=newcomer_gate)
        trainers.append(newcomer)
        newcomer.start()
        join_all(trainers)
    finally:
        for e in resume.values():
            e.set()
        for p in peers:
            p.close()
    opt = newcomer.opt
    assert opt.resyncs == 1 and opt.catchups == 1, (opt.resyncs, opt.catchups)  # joining, then one catch-up
    assert 1 not in {rec.step for rec in opt.history}  # its round-1 attempt missed
    (joined,) = [rec for rec in opt.history if rec.step == 2]
    kept = sum(n for n, _ in newcomer.losses[2])
    assert joined.local_samples == kept > 8, (joined.local_samples, kept)  # nothing it computed was dropped
    assert {rec.group_size for t in trainers for rec in t.opt.history if rec.step == 2} == {3}
    for s in range(1, steps + 1):
        have = [t.params[s] for t in trainers if s in t.params]
        assert len(have) == 3, (s, len(have))
        assert all(torch.equal(have[0], p) for p in have[1:]), f"peers differ after step {s}"


@pytest.mark.timeout(240)
def test_a_newcomer_gets_the_state_while_rounds_outlast_compute():
    """Delayed updates with rounds longer than a step's compute: a donor's training loop goes
    straight from applying one round to starting the next, so no progress report ever finds it
    without a round in flight. It must still offer its state (between the two), or the newcomer
    waits for nothing until its state_timeout."""
    torch.set_num_threads(1)
    steps = 20
    cfg = OptimizerConfig(target_batch_size=16, delay_updates=True)
    rid = run_id()
    first = Peer(PeerConfig(run_id=rid), AVG)
    peers = [first] + [Peer(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs)), AVG) for _ in range(2)]
    reached = threading.Event()
    try:
        trainers = [Trainer(i, p, cfg, micro=8, delay=0.01, steps=steps,
                            on_step=lambda s: reached.set() if s >= 5 else None) for i, p in enumerate(peers[:2])]
        for t in trainers:
            t.start()
        for _ in range(1200):
            if reached.wait(0.1) or any(t.error for t in trainers):
                break
        assert reached.is_set() and all(t.error is None for t in trainers), [t.error for t in trainers]
        newcomer = Trainer(2, peers[2], OptimizerConfig(target_batch_size=16, delay_updates=True, state_timeout=20),
                           micro=8, delay=0.01, steps=steps)
        trainers.append(newcomer)
        newcomer.start()
        join_all(trainers)
    finally:
        for p in peers:
            p.close()
    assert newcomer.opt.resyncs >= 1 and any(rec.local_samples > 0 for rec in newcomer.opt.history)
    joined = min(newcomer.params)
    assert 5 < joined < steps
    for s in range(joined, steps + 1):
        have = [t.params[s] for t in trainers if s in t.params]
        assert len(have) >= 2 and all(torch.equal(have[0], p) for p in have[1:]), f"peers differ after step {s}"


def test_a_garbage_state_from_the_runs_donors_is_refused_clearly():
    rid = run_id()
    donors = start(2, rid)
    newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(donors[0].maddrs)), AVG)
    try:
        # two donors attest step 5 (one alone would not be the run's step) and serve bytes that are
        # not a training state
        for donor in donors:
            donor.report(ProgressRecord(donor.peer_id, 5, 0, 1.0, Role.TRAINER, time=time.time()))
            donor.offer_state(5, b"\x80not a state" * 100)
        model = make_model()
        before = flat(model)
        opt, _ = make_opt(model)
        # every donor's state is refused; the newcomer retries others until state_timeout
        with pytest.raises(StateError, match="not a dedloc training state"):
            CollaborativeOptimizer(opt, newcomer, OptimizerConfig(target_batch_size=64, state_timeout=5), model=model)
        assert torch.equal(flat(model), before), "a refused state changed the model"
    finally:
        for p in (*donors, newcomer):
            p.close()


@pytest.mark.timeout(240)
def test_aggregator_only_peer_takes_the_averaging_and_training_stays_exact():
    """Two trainers with slow uplinks (one in client mode) and a CPU aggregator with bandwidth:
    the plan hands the aggregator the vector (BytePS), and training is still the exact large batch."""
    from dedloc.roles.aggregator import Aggregator

    torch.set_num_threads(1)
    steps, target = 6, 48
    cfg = OptimizerConfig(target_batch_size=target)
    slow = AveragingConfig(matchmaking_time=2, averaging_timeout=20, upload_mbps=8, download_mbps=80, probe_interval=0)
    fast = AveragingConfig(matchmaking_time=2, averaging_timeout=20, upload_mbps=800, download_mbps=800,
                           probe_interval=0)
    rid = run_id()
    first = Peer(PeerConfig(run_id=rid), slow)
    peers = [first]
    agg, stop = None, threading.Event()
    try:
        peers.append(Peer(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs), client_mode=True), slow))
        agg = Aggregator(PeerConfig(run_id=rid, initial_peers=tuple(first.maddrs)), fast)
        server = threading.Thread(target=agg.run, args=(stop,), daemon=True)
        server.start()
        deadline = time.monotonic() + 20
        while not first.collaboration().aggregators:
            assert time.monotonic() < deadline, "the aggregator never announced itself"
            time.sleep(0.1)
        trainers = [Trainer(i, p, cfg, micro=m, delay=0.01, steps=steps) for i, (p, m) in enumerate(zip(peers, (5, 7)))]
        for t in trainers:
            t.start()
        join_all(trainers)
        stop.set()
        server.join(30)
        assert not server.is_alive(), "the aggregator did not stop"
    finally:
        stop.set()
        for p in peers:
            p.close()
        if agg is not None:
            agg.close()
    assert agg.rounds >= steps - 1 and agg.aggregated >= steps - 1, (agg.rounds, agg.aggregated)
    assert all(rec.group_size == 3 for t in trainers for rec in t.opt.history[1:])
    for s in range(steps + 1):
        assert torch.equal(trainers[0].params[s], trainers[1].params[s]), f"peers differ after step {s}"
    losses, params = replay([t.log for t in trainers], steps, clip=None)
    torch.testing.assert_close(trainers[0].params[steps], params, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(240)
def test_far_from_the_target_progress_is_reported_in_the_background():
    """The training loop does not wait for the DHT on every micro-batch: while the target is far
    (at the measured speeds), the count is published and read in the background. Near it, each
    micro-batch still waits for a fresh count, so the batch bound and exactness are unchanged."""
    torch.set_num_threads(1)
    steps, target, micro = 3, 320, 4
    cfg = OptimizerConfig(target_batch_size=target)
    trainers = run_collaboration(cfg, steps, micro=(micro, micro), delays=(0.05, 0.05), opt_kwargs=())
    for t in trainers:
        total = t.opt.blocking_reports + t.opt.background_reports
        assert t.opt.background_reports >= 0.3 * total, (t.opt.blocking_reports, t.opt.background_reports)
    for s in range(steps + 1):
        assert torch.equal(trainers[0].params[s], trainers[1].params[s]), f"peers differ after step {s}"
    for s in range(steps):
        consumed = sum(len(i) for t in trainers for i, _ in t.log.get(s, []))
        assert {rec.batch for t in trainers for rec in t.opt.history if rec.step == s} == {float(consumed)}
        assert target <= consumed < target + 2 * micro, (s, consumed)
    _, params = replay([t.log for t in trainers], steps, clip=None)
    torch.testing.assert_close(trainers[0].params[steps], params, rtol=1e-5, atol=1e-5)
