"""What the attested step costs (issue 38): the run's step from ``ATTEST`` vouching peers
(records.py ``CollaborationView.global_step``) against the largest claim (the rule at b122246,
re-stated here as the baseline), per view of n peers; and what a signed direct-connection hello
adds per connection (net/tcp.py). The attestation reads the progress records every peer already
publishes: it adds no DHT record, request or byte per step.

    python bench/attest.py            # prints one JSON object
"""

import json
import random
import time

from cryptography.hazmat.primitives.asymmetric import ed25519

from dedloc.net.identity import peer_id_of, public_key_of
from dedloc.net.tcp import _signed
from dedloc.records import CollaborationView, ProgressRecord, Role


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
    print(json.dumps(out))


if __name__ == "__main__":
    main()
