"""Hole punching and relaying between NAT'd peers, per transport (TCP, QUIC).

Each trial builds a fresh network (dedloc/testing/nat.py): a relaying peer and 3 public
trainers (the observers libp2p needs), and four default-config trainers behind home routers,
two ordinary ones and two that randomise ports (``--random-fully``: punching cannot pass). The
NAT'd peers listen on the transport under test only. In each trial:
- the second peer behind an ordinary router probes the first (a 16 MiB push): the first dial goes
  through the relay; the trial counts as punched if a direct connection appears within 30 s, and
  ``time_to_direct`` runs from that first dial to the direct connection;
- the probe is repeated once direct: ``direct_MBps``;
- the pair behind --random-fully routers probes the same way, through the relay: ``relayed_MBps``.

Prints one JSON line per transport: transport, trials, punch_success_rate, time_to_direct_s
(median over punched trials), relayed_MBps and direct_MBps (medians), slot_s (median time from starting the run's peers until
every NAT'd peer held its relay slot), failures (reasons). On loopback veths the link is the CPU:
relayed costs two extra hops through the relay's daemon.
Run as root:  python bench/netem/nat.py [--trials N] [--transports tcp quic]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from dedloc.testing.nat import Nat, NatNetwork, available, start_run
from dedloc.testing.netem import exit_on_signals

LISTEN = {"tcp": ["/ip4/0.0.0.0/tcp/0"], "quic": ["/ip4/0.0.0.0/udp/0/quic-v1"]}
AVERAGING = dict(matchmaking_time=3, averaging_timeout=60, probe_interval=0, probe_mb=16)
MB = 1e6


def _push_rate(peer, target: str) -> float:
    result = peer.call(op="probe", peers=[target], timeout=300)
    if target not in result["pushed"]:
        raise RuntimeError(f"probe of {target[-8:]} failed: {result['failed'].get(target)}")
    return result["pushed"][target] / MB


def trial(transport: str, logdir: str, index: int) -> dict:
    net = NatNetwork(public=4, nats=[Nat(), Nat(), Nat(random_ports=True), Nat(random_ports=True)])
    peers = []
    try:
        started = time.monotonic()
        peers, infos = start_run(net, logdir, f"natbench{index}", AVERAGING, nat_listen=LISTEN[transport])
        slot_s = time.monotonic() - started
        ids = [i["peer_id"] for i in infos]
        b = peers[5]
        dialled = time.monotonic()
        first = _push_rate(b, ids[4])
        direct_at = None
        while time.monotonic() - dialled < 30:
            if b.call(op="connections").get(ids[4], {}).get("direct"):
                direct_at = time.monotonic()
                break
            time.sleep(0.2)  # the daemon announces no event for a new connection
        out = {"slot_s": slot_s, "punched": direct_at is not None, "first_MBps": first}
        if direct_at is not None:
            out["time_to_direct_s"] = direct_at - dialled
            out["direct_MBps"] = _push_rate(b, ids[4])
        out["relayed_MBps"] = _push_rate(peers[7], ids[6])
        relayed_path = peers[7].call(op="connections").get(ids[6], {})
        out["relayed_path_direct"] = bool(relayed_path.get("direct"))
        return out
    finally:
        for p in peers:
            p.close()
        net.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["tcp", "quic"], choices=sorted(LISTEN))
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        raise SystemExit(f"cannot run: {why}")
    exit_on_signals()
    for transport in args.transports:
        results, failures = [], []
        for i in range(args.trials):
            with tempfile.TemporaryDirectory() as logdir:
                try:
                    results.append(trial(transport, logdir, i))
                except Exception as e:
                    failures.append(f"{type(e).__name__}: {e}")
        punched = [r for r in results if r["punched"]]

        def median(key: str, rows: list[dict]) -> float | None:
            values = [r[key] for r in rows if key in r]
            return round(statistics.median(values), 2) if values else None

        print(json.dumps({
            "transport": transport, "trials": args.trials,
            "punch_success_rate": round(len(punched) / args.trials, 3),
            "time_to_direct_s": median("time_to_direct_s", punched),
            "relayed_MBps": median("relayed_MBps", results), "direct_MBps": median("direct_MBps", punched),
            "slot_s": median("slot_s", results),
            "relayed_pair_went_direct": sum(r["relayed_path_direct"] for r in results),
            "failures": failures}), flush=True)


if __name__ == "__main__":
    main()
