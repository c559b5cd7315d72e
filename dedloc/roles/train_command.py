"""``dedloc train``: one trainer peer in the foreground, with live progress, until done or stopped.

SIGTERM and Ctrl+C stop it between micro-batches; the data position is saved and the peer leaves
cleanly (no daemon or DataLoader worker is left behind). With ``--out``, ``summary.json`` and
``loss.png`` are written at the end, however it ended.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.data.mlm import DataConfig
from dedloc.recipes.mlm import MLMRecipe
from dedloc.records import Role, label
from dedloc.roles.doctor import installed
from dedloc.roles.trainer import TrainConfig, Trainer


def train(config: TrainConfig, recipe: MLMRecipe, data: DataConfig, peer_config: PeerConfig,
          averaging: AveragingConfig) -> int:
    """Run a trainer until ``max_steps`` or a stop signal; 0 on success."""
    import logging

    from rich.console import Console
    from rich.live import Live

    from dedloc.logs import configure
    from dedloc.roles.progress import ProgressDisplay
    from dedloc.roles.report import write_outputs

    configure(peer_config.log_level)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    console = Console()
    with console.status("checking the data and tokenizer, joining the collaboration"):
        trainer = Trainer(config, recipe, data, peer_config, averaging)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    display = ProgressDisplay(f"dedloc train: {config.recipe} on {trainer.device} as "
                              f"{label(trainer.peer_id, peer_config.name)}",
                              config.max_steps, me=trainer.peer_id)
    peer = trainer.peer
    how = "client mode (it accepts no connections)" if peer.config.client_mode else \
        f"{'reachable' if peer.reachable else 'not reachable'} ({peer.reachability})"
    named = f" ({peer_config.name})" if peer_config.name else ""
    console.print(f"peer {trainer.peer_id}{named} joined run {peer.config.run_id!r} at global step {trainer.opt.global_step}: "
                  f"{config.recipe} on {trainer.device} ({trainer.precision}), micro-batch {recipe.micro_batch}, "
                  f"{how}, {len(peer.config.initial_peers)} initial peer(s), run-wide settings "
                  f"{trainer.opt.config.run_hash} (checked against the run's), dedloc {installed('dedloc')}; "
                  f"identity and data position in {trainer.state_dir}", soft_wrap=True, markup=False)
    last_view = [0.0]

    def on_step(event) -> None:
        display.add(event)
        if time.monotonic() - last_view[0] > 1.0:
            display.view, last_view[0] = trainer.opt.view, time.monotonic()
            if display.view is not None:  # a backbone's record names the step of its newest checkpoint
                display.checkpoint = max((r.step for r in display.view.peers if r.role == Role.BACKBONE),
                                         default=-1)
        if live is not None:
            live.update(display.render())
        else:
            print(display.line(), flush=True)

    def on_resync(step: int) -> None:
        display.resyncs += 1

    summary = None
    try:
        # off a terminal (a log file), one line per global step instead of a live table
        with (Live(display.render(), console=console, refresh_per_second=4) if console.is_terminal
              else contextlib.nullcontext()) as live:
            try:
                summary = trainer.run(stop, on_step=on_step, on_resync=on_resync)
            except KeyboardInterrupt:
                summary = trainer.summary(time.monotonic() - display.started)
                console.print("interrupted: leaving the collaboration")
        console.print()  # the live table leaves the cursor on its last line
        if config.max_steps is not None and trainer.opt.global_step >= config.max_steps:
            with console.status("handing the final state to a backbone"):
                trainer.hand_over(stop)
        steps = summary["steps"]
        console.print(f"stopped at global step {summary['global_step']}: took part in {len(steps)} steps, "
                      f"{summary['samples']} samples" + (f", loss {summary['loss_first']:.3f} -> "
                                                        f"{summary['loss_last']:.3f}" if steps else ""))
        if config.out:
            paths = write_outputs(config.out, summary, steps, summary["loss_per_step"],
                                  f"dedloc train: {config.recipe}")
            console.print(f"wrote {paths[0]} and {paths[1]}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.close()
    return 0
