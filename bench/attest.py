"""What the attested step costs (issue 38): the run's step from ``ATTEST`` vouching peers
(records.py ``CollaborationView.global_step``) against the largest claim (the rule at b122246,
re-stated here as the baseline), per view of n peers; what a signed direct-connection hello
adds per connection (net/tcp.py); and what signed joins add per step (matchmaking rule 13: one
signature per joiner, one check per join at the leader and per proof at each reader, and the
proofs' bytes in the ``closed`` record). The attestation reads the progress records every peer
already publishes: it adds no DHT record or request per step.

    python bench/attest.py            # prints one JSON object
"""

import json
import random
import time

import msgpack
from cryptography.hazmat.primitives.asymmetric import ed25519

from dedloc.auth.identity import peer_id_of, public_key_of
from dedloc.net.tcp import _signed
from dedloc.records import ClosedRecord, CollaborationView, JoinProof, ProgressRecord, Role, join_signed, join_statement


def largest_claim(view: CollaborationView) -> int:
    """The step rule at b122246: the newest step of a peer that can send its state."""
    if any(r.role == Role.TRAINER for r in view.peers):
        return max(r.step for r in view.peers if r.role.serves)
    return max((r.step for r in view.peers if r.role != Role.AGGREGATOR), default=0)


def views(n: int, count: int = 200) -> list[list[ProgressRecord]]:
    rng = random.Random(n)
    out = []
    for _ in range(count):
        step = rng.randrange(1000)
        recs = [ProgressRecord(f"p{i}", step + (rng.random() < 0.1), rng.randrange(64), 10.0,
                               Role.CLIENT if i % 5 == 4 else Role.TRAINER, fingerprint=f"{step}:ab")
                for i in range(n)]
        out.append(recs + [ProgressRecord("bb", max(0, step - 5), 0, 0.0, Role.BACKBONE)])
    return out


def per_view(rule, recs_list) -> float:
    t0 = time.perf_counter()
    for recs in recs_list:
        rule(CollaborationView.build(recs, 0.0))
    return (time.perf_counter() - t0) / len(recs_list)


def closed_record_cost(n: int) -> dict:
    """Matchmaking rule 13 for a group of ``n``: each joiner signs its join once, the leader checks
    each join's signature, and the group's ``closed`` record carries the ``n - 1`` proofs (bytes
    against the same record without them); a reader checks them once per record (cached after)."""
    keys = [ed25519.Ed25519PrivateKey.generate() for _ in range(n)]
    ids = [peer_id_of(k.public_key()) for k in keys]
    leader, step, inc = ids[0], 0, "0123456789abcdef"
    t0 = time.perf_counter()
    proofs = tuple((m, JoinProof(inc, k.sign(join_statement("run", step, leader, m, inc, True))))
                   for m, k in zip(ids[1:], keys[1:]))
    sign = (time.perf_counter() - t0) / (n - 1)
    record = ClosedRecord(leader, tuple(ids), time.time() + 60, proofs)
    bare = ClosedRecord(leader, tuple(ids), record.until)
    join_signed.cache_clear()
    t0 = time.perf_counter()
    assert len(record.signed("run", step)) == n
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        record.signed("run", step)
    cached = (time.perf_counter() - t0) / 100
    return {"join_sign_us": round(sign * 1e6, 1), "record_first_read_us": round(first * 1e6, 1),
            "record_cached_read_us": round(cached * 1e6, 1),
            "record_bytes": len(msgpack.packb(record.to_wire(), use_bin_type=True)),
            "record_bytes_without_proofs": len(msgpack.packb(bare.to_wire(), use_bin_type=True))}


def main() -> None:
    out = {}
    for n in (4, 16, 1000):
        vs = views(n)
        base = per_view(largest_claim, vs)
        new = per_view(lambda v: v.global_step, vs)
        out[f"peers_{n}"] = {"largest_claim_us": round(base * 1e6, 1), "attested_us": round(new * 1e6, 1),
                             "ratio": round(new / base, 2)}
    key = ed25519.Ed25519PrivateKey.generate()
    me = peer_id_of(key.public_key())
    msg = _signed(bytes(16), "dedloc.run.allreduce", me, me, bytes(16))
    t0 = time.perf_counter()
    for _ in range(1000):
        sig = key.sign(msg)
    sign = (time.perf_counter() - t0) / 1000
    t0 = time.perf_counter()
    for _ in range(1000):
        public_key_of(me).verify(sig, msg)
    verify = (time.perf_counter() - t0) / 1000
    out["hello_sign_us"], out["hello_verify_us"] = round(sign * 1e6, 1), round(verify * 1e6, 1)
    out["dht_records_added_per_step"] = 0
    for n in (4, 16):
        out[f"closed_record_{n}"] = closed_record_cost(n)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
