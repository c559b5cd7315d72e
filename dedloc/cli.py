"""The `dedloc` command: ``train`` (join a collaboration and train a recipe), ``tokenizer`` (train the
run's tokenizer), ``finetune`` (downstream evaluation of a checkpoint), ``demo`` (a local
collaboration), ``backbone`` (a CPU-only peer keeping the DHT and checkpoints) and ``aggregator``
(a CPU-only peer that averages for the trainers).

Options are generated from the configuration dataclasses, so the CLI and the Python API share
one definition of every setting and its validation.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import faulthandler
import inspect
import json
import os
import signal
import sys
import textwrap
import threading
import typing
from typing import Any

from dedloc.errors import DedlocError


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (``x: int = 1`` then ``\"\"\"doc\"\"\"``)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def add_fields(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
               defaults: dict[str, Any] | None = None, group: str | None = None) -> None:
    """One ``--option`` per dataclass field, typed from its default (or from ``defaults``, a role's
    own), with the field's help and, where its metadata names them, its ``choices``; under the
    heading ``group`` in ``--help`` if given."""
    if group is not None:
        parser = parser.add_argument_group(group)  # type: ignore[assignment]
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        default = (defaults or {}).get(f.name, default)
        help_text = f.metadata.get("help", docs.get(f.name, "")).replace("%", "%%") + (
            f" (default: {default})" if default not in (None, ()) else "")
        hint = hints[f.name]
        if hint is bool or bool in typing.get_args(hint):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif isinstance(default, tuple):
            item = next((t for t in (int, float) if t in typing.get_args(hint)), str)
            parser.add_argument(flag, nargs="*", type=item, default=list(default), action=_Repeatable,
                                help=help_text)
        else:
            kind = next((t for t in (int, float, str) if t is hint or t in typing.get_args(hint)), str)
            parser.add_argument(flag, type=kind, default=default, help=help_text, choices=f.metadata.get("choices"))


class _Repeatable(argparse.Action):
    """A list option that may be given more than once (``--data a --data b c``): the first use
    replaces the default, later ones add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, "_repeated", set())
        current = list(getattr(namespace, self.dest)) if self.dest in seen else []
        seen.add(self.dest)
        setattr(namespace, "_repeated", seen)
        setattr(namespace, self.dest, current + list(values))


def from_args(cls: type, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> Any:
    """The validated config ``cls`` built from the options ``add_fields`` added."""
    from dedloc.config import from_dict

    return from_dict(cls, {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in skip})


KEY_OPTIONS = ("--owner", "--invite")
"""Options whose value is a key or token in URL-safe base64: one in 64 starts with ``-``."""


def _glue_keys(argv: list[str]) -> list[str]:
    """``--owner -Xy...`` as ``--owner=-Xy...``: argparse reads a value starting with ``-`` as an
    option (about one owner key in 64 did not work pasted as printed)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in KEY_OPTIONS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _joined(argv: list[str]):
    """The manifest ``--join`` names (``dedloc train``), or None."""
    from dedloc.roles.manifest import Manifest

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--join", default=None)
    text = pre.parse_known_args(argv)[0].join
    return Manifest.read(text) if text else None


def _recipe_named(argv: list[str] | None) -> str:
    """The ``--recipe`` on the command line (its fields' defaults depend on it)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default="tiny-mlm")
    return pre.parse_known_args(argv)[0].recipe


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr: where a peer hangs. Only in a process's
    main thread with a real stderr file (not when ``main`` is called in-process under captured output)."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(argv: list[str] | None = None) -> int:
    _dump_stacks_on_sigusr1()
    argv = _glue_keys(sys.argv[1:] if argv is None else list(argv))
    from dedloc.config import PUBLIC_HOST_MADDRS, AveragingConfig, BackboneConfig, MonitorConfig, PeerConfig
    from dedloc.data.mlm import DataConfig
    from dedloc.data.tokenizer import TokenizerConfig
    from dedloc.demo.collab import DemoConfig
    from dedloc.recipes.mlm import PRECISIONS, RECIPES, MLMRecipe
    from dedloc.roles.finetune import FinetuneConfig
    from dedloc.roles.doctor import versions
    from dedloc.roles.export import ExportConfig
    from dedloc.roles.manifest import PER_PEER
    from dedloc.roles.trainer import TrainConfig, state_dir_of

    recipe_name = _recipe_named(argv)
    if recipe_name not in RECIPES:  # before --help, whose defaults come from the recipe
        print(f"dedloc: error: unknown recipe {recipe_name!r} (known: {', '.join(RECIPES)})", file=sys.stderr)
        return 2
    try:
        manifest = _joined(argv) if argv[:1] in (["train"], ["doctor"], ["export"], ["ledger"]) else None
    except DedlocError as e:
        print(f"dedloc: error: {e}", file=sys.stderr)
        return 2
    recipe_defaults = dataclasses.asdict(manifest.build_recipe() if manifest is not None
                                         else RECIPES.get(recipe_name, RECIPES["tiny-mlm"]))
    parser = argparse.ArgumentParser(prog="dedloc", description="Collaborative deep learning (DeDLOC).")
    parser.add_argument("--version", action="version", version=f"dedloc {versions()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a local collaboration pretraining a small ALBERT on this machine")
    demo.add_argument("--averaging", action="store_true",
                      help="instead: only average vectors among local peers (the runtime's smoke test)")
    demo.add_argument("--numel", type=int, default=1 << 20, help="--averaging: vector length (default 1M)")
    demo.add_argument("--rounds", type=int, default=3, help="--averaging: rounds (default 3)")
    demo.add_argument("--verbose", action="store_true", help="log every event at INFO")
    add_fields(demo, DemoConfig)
    add_fields(demo, MLMRecipe, skip=RECIPE_SET_BY_DEMO)
    train = sub.add_parser("train", help="join a collaboration and train (the recipe's options default to "
                                         "the chosen --recipe's values)")
    add_fields(train, TrainConfig, group="this peer")
    add_fields(train, MLMRecipe, defaults=recipe_defaults,
               group="the recipe: must match the run (but --micro-batch and --precision, each peer's own; "
                     "--join sets them all)")
    add_fields(train, DataConfig, group="data (this peer reads all of it, in its own order)")
    add_fields(train, PeerConfig, defaults={"log_level": "WARNING"}, group="network, identity and membership")
    add_fields(train, AveragingConfig, skip=("aggregator_only", "compression"),
               group="averaging (network tuning: the defaults suit most peers)")
    train.add_argument("--join", default=None, help="the run's manifest, as a token or a file (`dedloc run manifest` "
                                                   "prints it): its run id, recipe, tokenizer, data, initial peers and "
                                                   "owner key become the defaults; run-wide recipe values may not differ")
    if manifest is not None:
        train.set_defaults(run_id=manifest.run_id, recipe=manifest.recipe, **{
            k: list(v) if isinstance(v, tuple) else v for k, v in dict(
                tokenizer=manifest.tokenizer, data=manifest.data, initial_peers=manifest.initial_peers,
                owner=manifest.owner).items() if v})
    doctor = sub.add_parser("doctor", help="check this machine for a run without joining it: versions, device, "
                                           "state dir, the run's tokenizer and data, initial peers, reachability")
    doctor.add_argument("--join", default=None, help="the run's manifest, as a token or a file")
    doctor.add_argument("--state-dir", default=None, help="as dedloc train's (default: dedloc-state/RUN_ID)")
    doctor.add_argument("--device", default="auto", help="as dedloc train's: auto, cpu, cuda or cuda:N")
    doctor.add_argument("--precision", default="auto", choices=PRECISIONS)
    doctor.add_argument("--no-network", action="store_true", help="skip the reachability check (the p2p layer "
                                                                  "starts for a few seconds and the initial peers dial back)")
    add_fields(doctor, PeerConfig, skip=DOCTOR_SKIPS, defaults={"log_level": "WARNING"})
    _run_defaults(doctor, manifest)
    tokenizer = sub.add_parser("tokenizer", help="train the run's tokenizer from its data sources "
                                                 "(Unigram, NFKC; sahajBERT's kind)")
    tokenizer.add_argument("--recipe", default="tiny-mlm", help="take --vocab-size from this recipe")
    add_fields(tokenizer, TokenizerConfig, defaults={"vocab_size": recipe_defaults["vocab_size"]})
    finetune = sub.add_parser("finetune", help="fine-tune a checkpoint on NER (seqeval F1) or classification "
                                               "(accuracy) and print the validation metrics")
    add_fields(finetune, FinetuneConfig)
    add_fields(finetune, MLMRecipe, skip=tuple(f.name for f in dataclasses.fields(MLMRecipe)
                                               if f.name not in MODEL_SHAPE), defaults=recipe_defaults)
    export = sub.add_parser("export", help="write a backbone checkpoint as a transformers model directory "
                                           "(save_pretrained), with the run's tokenizer")
    export.add_argument("--join", default=None, help="the run's manifest (token or file): its recipe and tokenizer")
    export.add_argument("--recipe", default="tiny-mlm", choices=sorted(RECIPES), help="the recipe the run trains")
    add_fields(export, ExportConfig)
    add_fields(export, MLMRecipe, skip=tuple(f.name for f in dataclasses.fields(MLMRecipe)
                                             if f.name not in MODEL_SHAPE), defaults=recipe_defaults)
    if manifest is not None:
        export.set_defaults(recipe=manifest.recipe, **({"tokenizer": manifest.tokenizer} if manifest.tokenizer else {}))
    backbone = sub.add_parser("backbone", help="run a CPU-only backbone peer: DHT, checkpoints, state for newcomers")
    add_fields(backbone, PeerConfig, skip=("client_mode",), defaults={"host_maddrs": PUBLIC_HOST_MADDRS})
    add_fields(backbone, BackboneConfig)
    aggregator = sub.add_parser("aggregator", help="run an aggregator-only peer: averages for the trainers, "
                                                   "trains nothing (BytePS-style help from a CPU box)")
    add_fields(aggregator, PeerConfig, skip=("client_mode",))
    add_fields(aggregator, AveragingConfig, skip=("aggregator_only",))
    monitor = sub.add_parser("monitor", help="serve the run's live dashboard (web page, /api/state, /metrics); "
                                             "joins as a client-mode peer that trains nothing")
    add_fields(monitor, PeerConfig, skip=("client_mode",))
    add_fields(monitor, MonitorConfig)
    ledger = sub.add_parser("ledger", help="print a backbone's contribution ledger (CHECKPOINT_DIR/ledger.json) "
                                           "as CSV or JSON")
    ledger.add_argument("path", nargs="?", default=None,
                        help="the ledger file, or the backbone's checkpoint directory (none: read the run's, "
                             "as the dashboard shows it, through --initial-peers or --join)")
    ledger.add_argument("--format", choices=("csv", "json"), default="csv")
    ledger.add_argument("--join", default=None, help="the run's manifest (token or file): its run id and initial peers")
    ledger.add_argument("--peer", default=None, help="print only this peer's row (a peer id, or 'me': the identity "
                                                      "in --state-dir), with its rank")
    ledger.add_argument("--state-dir", default=None, help="as dedloc train's (for --peer me)")
    add_fields(ledger, PeerConfig, skip=READER_SKIPS, defaults={"log_level": "WARNING"},
               group="reading the run's ledger (without a path)")
    _run_defaults(ledger, manifest)
    run = sub.add_parser("run", help="owner: create an invite-only run (`dedloc run init`)")
    run_sub = run.add_subparsers(dest="run_command", required=True)
    init = run_sub.add_parser("init", help="make the owner key and run.json in --dir, print the flags peers join with")
    init.add_argument("--dir", required=True, help="where owner.key (secret), run.json and revoked go")
    init.add_argument("--run-id", required=True, help="the run's name")
    made = run_sub.add_parser("manifest", help="print the one token (and write the file) volunteers join with: "
                                               "`dedloc train --join TOKEN`")
    made.add_argument("--run-id", required=True, help="the run's name")
    made.add_argument("--recipe", default="tiny-mlm", choices=sorted(RECIPES), help="the named recipe the run trains")
    add_fields(made, MLMRecipe, skip=PER_PEER, defaults=recipe_defaults)
    made.add_argument("--tokenizer", default="", help="the run's tokenizer directory, as volunteers will find it")
    made.add_argument("--data", nargs="*", default=[], action=_Repeatable, help="the run's data sources")
    made.add_argument("--initial-peers", nargs="*", default=[], action=_Repeatable,
                      help="the addresses volunteers bootstrap from (the backbone prints its own)")
    made.add_argument("--owner", default="", help="the owner key of an invite-only run (`dedloc run init` prints it)")
    made.add_argument("--out", default="", help="also write the manifest to this file (JSON)")
    invite = sub.add_parser("invite", help="owner: print an invitation for a peer id (the peer passes it to --invite)")
    invite.add_argument("peer_id", help="the volunteer's peer id (`dedloc identity` prints it)")
    invite.add_argument("--run", required=True, help="the run directory `dedloc run init` made")
    invite.add_argument("--expires", default="7d", help="how long it is valid: 90s, 30m, 12h, 7d, 2w (default 7d)")
    invite.add_argument("--backbone", action="store_true",
                        help="let this peer act as the run's backbone (its checkpoints count as the run's step)")
    revoke = sub.add_parser("revoke", help="owner: void a peer's invitations (written to RUN/revoked)")
    revoke.add_argument("peer_id")
    revoke.add_argument("--run", required=True, help="the run directory `dedloc run init` made")
    ident = sub.add_parser("identity", help="print this peer's id (to ask the owner for an invitation), "
                                            "creating its key if missing")
    ident.add_argument("--identity-path", default=None,
                       help="the key file (default: dedloc-state/RUN_ID/identity.key, as `dedloc train` uses)")
    ident.add_argument("--run-id", default="dedloc", help="the run (for the default path)")
    args = parser.parse_args(argv)
    from dedloc.logs import configure

    try:
        if args.command == "demo":
            configure("INFO" if args.verbose else "WARNING")
            if args.averaging:
                from dedloc.demo.averaging import AveragingDemoConfig, run as run_averaging

                if args.trainers < 2 or args.numel < 1 or args.rounds < 1:
                    parser.error("--trainers must be >= 2, --numel and --rounds >= 1")
                out = run_averaging(AveragingDemoConfig(peers=args.trainers, numel=args.numel, rounds=args.rounds))
                return 0 if all(r["identical"] and r["max_err"] < 1e-4 for r in out["rounds"]) else 1
            from dedloc.demo.collab import run

            summary = run(from_args(DemoConfig, args), from_args(MLMRecipe, args, skip=RECIPE_SET_BY_DEMO),
                          log_level="INFO" if args.verbose else "WARNING")
            ok = summary["loss_last_avg"] < summary["loss_first_avg"] and summary["max_param_diff"] == 0.0
            if not ok:
                print("dedloc: the demo did not train correctly (loss did not fall, or peers differ)",
                      file=sys.stderr)
            return 0 if ok else 1
        if args.command == "export":
            from dedloc.roles.export import export as run_export

            shape = {k: getattr(args, k) for k in MODEL_SHAPE}
            base = manifest.build_recipe() if manifest is not None else RECIPES[args.recipe]
            written = run_export(from_args(ExportConfig, args), dataclasses.replace(base, **shape).validate())
            print(f"wrote {written['out']}: {written['parameters']} parameters ({written['tensors']} tensors) and the "
                  f"tokenizer; load it with transformers' AutoModelForMaskedLM.from_pretrained", flush=True)
            return 0
        if args.command == "doctor":
            return _doctor(args, from_args(PeerConfig, args, skip=DOCTOR_SKIPS), manifest)
        if args.command == "train":
            from dedloc.roles.train_command import train

            recipe, peer_config = from_args(MLMRecipe, args), from_args(PeerConfig, args)
            if manifest is not None:
                manifest.check(peer_config.run_id, args.recipe, recipe)
            return train(from_args(TrainConfig, args), recipe, from_args(DataConfig, args), peer_config,
                         from_args(AveragingConfig, args, skip=("aggregator_only", "compression")))
        if args.command == "tokenizer":
            from dedloc.data.tokenizer import build

            config = from_args(TokenizerConfig, args)
            tok = build(config)
            print(f"tokenizer: vocabulary {len(tok)}, written to {config.out}; train with --tokenizer {config.out}")
            return 0
        if args.command == "finetune":
            from dedloc.recipes import get_recipe
            from dedloc.roles.finetune import finetune as run_finetune

            config = from_args(FinetuneConfig, args)
            metrics = run_finetune(config, get_recipe(config.recipe, **{k: getattr(args, k) for k in MODEL_SHAPE}))
            print(json.dumps(metrics))
            return 0
        if args.command in ("run", "invite", "revoke", "identity"):
            from dedloc.roles import membership

            if args.command == "run" and args.run_command == "manifest":
                print(_manifest(args))
            elif args.command == "run":
                print(membership.run_init(args.dir, args.run_id))
            elif args.command == "invite":
                print(membership.invite(args.run, args.peer_id, args.expires, args.backbone))
            elif args.command == "revoke":
                print(membership.revoke(args.run, args.peer_id))
            else:
                print(membership.identity(args.identity_path or os.path.join(state_dir_of(None, args.run_id),
                                                                             "identity.key")))
            return 0
        if args.command == "backbone":
            return _backbone(from_args(PeerConfig, args, skip=("client_mode",)), from_args(BackboneConfig, args))
        if args.command == "ledger":
            return _ledger(args)
        if args.command == "monitor":
            return _monitor(from_args(PeerConfig, args, skip=("client_mode",)), from_args(MonitorConfig, args))
        if args.command == "aggregator":
            return _aggregator(from_args(PeerConfig, args, skip=("client_mode",)),
                               from_args(AveragingConfig, args, skip=("aggregator_only",)))
    except DedlocError as e:
        print(f"dedloc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dedloc: interrupted", file=sys.stderr)
        return 130
    return 0


DOCTOR_SKIPS = ("name", "metrics_port", "metrics_host", "progress_ttl")
"""PeerConfig fields `dedloc doctor` does not take (it publishes nothing and serves no metrics)."""
READER_SKIPS = DOCTOR_SKIPS + ("client_mode", "host_maddrs", "announce_maddrs", "relay_service")
"""... nor does `dedloc ledger` reading the run (a client-mode peer that only reads)."""


def _run_defaults(parser: argparse.ArgumentParser, manifest) -> None:
    """The run's id, initial peers and owner key from ``manifest`` (``--join``) as ``parser``'s defaults."""
    if manifest is not None:
        parser.set_defaults(run_id=manifest.run_id, **{k: list(v) if isinstance(v, tuple) else v for k, v in dict(
            initial_peers=manifest.initial_peers, owner=manifest.owner).items() if v})


MODEL_SHAPE = ("hidden_size", "layers", "heads", "embedding_size", "intermediate_size", "seq_len")
"""The recipe fields `dedloc finetune` takes: the pretrained model's shape."""
RECIPE_SET_BY_DEMO = ("total_steps", "warmup_steps")
"""The demo's schedule spans its --steps."""


def _manifest(args) -> str:
    """``dedloc run manifest``: the token (and, with --out, the file) volunteers join with."""
    from dedloc.config import PeerConfig
    from dedloc.files import write_atomically
    from dedloc.recipes.mlm import RECIPES, MLMRecipe
    from dedloc.roles.manifest import PER_PEER, Manifest

    PeerConfig(run_id=args.run_id, initial_peers=tuple(args.initial_peers), owner=args.owner).validate()
    recipe = dataclasses.replace(RECIPES[args.recipe], **{
        f.name: getattr(args, f.name) for f in dataclasses.fields(MLMRecipe) if f.name not in PER_PEER})
    manifest = Manifest.of(args.run_id, args.recipe, recipe, tokenizer=args.tokenizer, data=tuple(args.data),
                           initial_peers=tuple(args.initial_peers), owner=args.owner)
    if args.out:
        write_atomically(args.out, manifest.to_json() + "\n")
    token = manifest.token()
    return ((f"manifest written to {args.out}\n" if args.out else "")
            + f"volunteers join with:\n  dedloc train --join {token}" + (" --invite <its invitation>" if args.owner else "")
            + (f"\n  (or --join {args.out})" if args.out else ""))


def _with_state_identity(peer_config, state_dir: str | None):
    """``peer_config`` with the identity in the peer's state directory, when it names none and one is
    there: a command that only looks at a run (doctor, ledger) is answered in an invite-only run only
    under the identity its invitation names."""
    from dedloc.roles.trainer import state_dir_of

    key = os.path.join(state_dir_of(state_dir, peer_config.run_id), "identity.key")
    if peer_config.identity_path is None and os.path.exists(key):
        return dataclasses.replace(peer_config, identity_path=key)
    return peer_config


def _ledger(args) -> int:
    """``dedloc ledger``: a backbone's ledger file, or the run's ledger read over the network."""
    from dedloc.config import PeerConfig
    from dedloc.monitor.ledger import Ledger, rows_csv
    from dedloc.roles.trainer import state_dir_of

    if args.path is not None:
        path = os.path.join(args.path, "ledger.json") if os.path.isdir(args.path) else args.path
        if not os.path.exists(path):
            raise DedlocError(f"no ledger at {path}")
        try:
            rows, source = Ledger.load(path).table(), path
        except ValueError as e:
            raise DedlocError(str(e)) from None
    else:
        from dedloc.logs import configure
        from dedloc.roles.monitor import read_ledger

        peer_config = from_args(PeerConfig, args, skip=READER_SKIPS)
        if not peer_config.initial_peers:
            raise DedlocError("dedloc ledger needs a path, or --initial-peers (or --join) to read the run's")
        configure(peer_config.log_level)
        source, rows = read_ledger(_with_state_identity(peer_config, args.state_dir))
    if args.peer is not None:
        me = args.peer
        if me == "me":
            from dedloc.auth.identity import load_identity, peer_id_of

            key = args.identity_path or os.path.join(state_dir_of(args.state_dir, args.run_id), "identity.key")
            if not os.path.exists(key):
                raise DedlocError(f"--peer me: no identity at {key} (give --state-dir or --identity-path)")
            try:
                me = peer_id_of(load_identity(key).public_key())
            except ValueError as e:
                raise DedlocError(str(e)) from None
        ranked = [dict(r, rank=i + 1) for i, r in enumerate(rows) if r.get("peer") == me]
        if not ranked:
            print(f"{me}: no contribution counted yet (by {source})", file=sys.stderr)
            return 1
        rows = ranked
    print(rows_csv(rows) if args.format == "csv" else json.dumps(rows, indent=1) + "\n", end="")
    return 0


def _doctor(args, peer_config, manifest) -> int:
    """``dedloc doctor`` (roles/doctor.py): one line per check as it ends; 1 if any failed."""
    from dedloc.logs import configure
    from dedloc.roles.doctor import diagnose
    from dedloc.roles.trainer import state_dir_of

    configure(peer_config.log_level)
    state_dir = state_dir_of(args.state_dir, peer_config.run_id)
    peer_config = _with_state_identity(peer_config, args.state_dir)
    print(f"dedloc doctor: run {peer_config.run_id!r}", flush=True)
    failed = 0
    for check in diagnose(peer_config, state_dir, args.device, args.precision, manifest, network=not args.no_network):
        print(check.line(), flush=True)
        failed += check.status == "FAIL"
    print(f"{failed} check(s) failed" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


def _backbone(peer_config, backbone_config) -> int:
    from dedloc.roles.backbone import Backbone

    return _serve(lambda: Backbone(peer_config, backbone_config), "backbone", peer_config.log_level)


def _monitor(peer_config, monitor_config) -> int:
    from dedloc.roles.monitor import Monitor

    if not peer_config.initial_peers:  # it accepts no connections: alone, it could only watch itself
        raise DedlocError("dedloc monitor needs --initial-peers: the address of a peer in the run (the backbone "
                          "prints it)")
    return _serve(lambda: Monitor(peer_config, monitor_config), "monitor", peer_config.log_level)


def _aggregator(peer_config, averaging_config) -> int:
    from dedloc.roles.aggregator import Aggregator

    return _serve(lambda: Aggregator(peer_config, averaging_config), "aggregator", peer_config.log_level,
                  peer_config.initial_peers)


def _serve(make, what: str, log_level: str, initial_peers: tuple[str, ...] | None = None) -> int:
    """Run a role until SIGTERM or Ctrl+C, then close it (no daemon or socket is left behind).
    ``initial_peers``: for a role that joins a run (not the backbone, which may start one), the
    addresses it was given; none is said loudly (it would watch or serve an empty run)."""
    from dedloc.logs import configure

    configure(log_level)
    node = make()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if initial_peers is not None and not initial_peers:
            print(f"warning: no --initial-peers: this {what} is alone in its run; pass the address of a peer in "
                  f"the run (the backbone prints it)", file=sys.stderr, flush=True)
        print(f"{what} peer running; " + ("others join with --initial-peers " + " ".join(node.maddrs) if node.maddrs
                                          else "it accepts no connections: others join through another peer"),
              flush=True)
        node.run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
