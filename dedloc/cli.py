"""The `dedloc` command."""

from __future__ import annotations

import argparse
import sys

from dedloc.errors import DedlocError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc", description="Collaborative deep learning (DeDLOC).")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a local collaboration on this machine")
    demo.add_argument("--averaging", action="store_true",
                      help="average vectors among local peers (the only demo at this stage)")
    demo.add_argument("--peers", type=int, default=4, help="number of trainer peers (default 4)")
    demo.add_argument("--numel", type=int, default=1 << 20, help="vector length (default 1M)")
    demo.add_argument("--rounds", type=int, default=3, help="averaging rounds (default 3)")
    args = parser.parse_args(argv)
    from dedloc.logs import configure

    configure("WARNING")
    try:
        if args.command == "demo":
            if args.peers < 2 or args.numel < 1 or args.rounds < 1:
                parser.error("--peers must be >= 2, --numel and --rounds >= 1")
            from dedloc.demo.averaging import AveragingDemoConfig, run

            out = run(AveragingDemoConfig(peers=args.peers, numel=args.numel, rounds=args.rounds))
            ok = all(r["identical"] and r["max_err"] < 1e-4 for r in out["rounds"])
            return 0 if ok else 1
    except DedlocError as e:
        print(f"dedloc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dedloc: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
