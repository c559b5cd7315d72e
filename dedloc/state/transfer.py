"""Serving and downloading training states between peers (runs in the runtime process).

Protocol ``dedloc.{run}.state``: the requester sends ``{"v", "min_step"}`` (msgpack, as in
net/rpc.py); the donor answers ``{"step", "size"}`` then ``size`` raw bytes, or ``{"busy"}`` /
``{"error"}``. Guarantees:
- a donor serves at most ``max_uploads`` requesters at once and answers ``busy`` beyond that, so
  newcomers spread over donors (they try donors in random order);
- when a requester wants a newer state than the donor has cached, the donor flags it as wanted;
  the training process sees the flag at its next report and offers a fresh state;
- a download has a deadline, checks the announced size against a cap, and tries the next donor on
  any failure; it raises StateError naming every donor tried when none succeeded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hivemind.p2p import PeerID

from dedloc.averaging.wire import VERSION
from dedloc.errors import ProtocolError, StateError
from dedloc.net import rpc
from dedloc.net.node import Node

logger = logging.getLogger(__name__)
UPLOAD_GRACE = 300.0
CHUNK = 4 << 20
MAX_STATE_BYTES = 64 << 30
FRESH_WAIT = 30.0


@dataclass
class _Cached:
    step: int
    blob: bytes


class StateServer:
    def __init__(self, node: Node, max_uploads: int = 2):
        self.node = node
        self.proto = f"dedloc.{node.config.run_id}.state"
        self.cached: _Cached | None = None
        self.training_step = -1
        self.wanted = False
        self._offered = asyncio.Condition()
        self._uploads = asyncio.Semaphore(max_uploads)

    async def start(self) -> None:
        if not self.node.config.client_mode:
            await self.node.p2p.add_binary_stream_handler(self.proto, self._on_stream)

    async def offer(self, step: int, blob: bytes) -> None:
        async with self._offered:
            if self.cached is None or step >= self.cached.step:
                self.cached = _Cached(step, blob)
            self.wanted = False
            self._offered.notify_all()

    async def _fresh(self, min_step: int) -> _Cached | None:
        if self.cached is not None and self.cached.step >= min_step:
            return self.cached
        if self.training_step < min_step:
            return None
        self.wanted = True
        async with self._offered:
            try:
                await asyncio.wait_for(
                    self._offered.wait_for(lambda: self.cached is not None and self.cached.step >= min_step),
                    FRESH_WAIT)
            except asyncio.TimeoutError:
                return None
        return self.cached

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            request = await asyncio.wait_for(rpc.read_message(reader), 10)
            if not isinstance(request, dict) or request.get("v") != VERSION or not isinstance(
                    request.get("min_step"), int):
                raise ProtocolError(f"malformed state request (protocol {VERSION} expected)")
            if self._uploads.locked():
                await rpc.reply_last(reader, writer, {"busy": True})
                return
            async with self._uploads:
                state = await self._fresh(request["min_step"])
                if state is None:
                    await rpc.reply_last(reader, writer, {"error": f"no state at step >= {request['min_step']}"})
                    return
                await rpc.write_message(writer, {"step": state.step, "size": len(state.blob)})
                view = memoryview(state.blob)
                for i in range(0, len(view), CHUNK):
                    writer.write(view[i:i + CHUNK])
                    await writer.drain()
                await rpc.wait_peer_closed(reader, UPLOAD_GRACE)  # the newcomer closes once it has it all
                logger.info(f"sent the state of step {state.step} ({len(state.blob) / 1e6:.1f} MB) to {peer}")
        except ProtocolError as e:
            logger.warning(f"refused a state request from {peer}: {e}")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.debug(f"state stream with {peer} ended early: {e!r}")
        finally:
            writer.close()

    async def download(self, donors: list[str], min_step: int, timeout: float) -> tuple[int, bytes, str]:
        """Fetch a state at step >= min_step from the first donor that has one, trying them in order."""
        deadline = time.monotonic() + timeout
        reasons: list[str] = []
        for donor in donors:
            left = deadline - time.monotonic()
            if left <= 0:
                reasons.append(f"{donor}: deadline passed")
                break
            try:
                step, blob = await asyncio.wait_for(self._download_from(donor, min_step), left)
                return step, blob, donor
            except Exception as e:  # any failure of one donor: try the next
                reasons.append(f"{donor}: {type(e).__name__}: {e}")
                logger.debug(f"state download from {donor} failed: {e!r}")
        raise StateError(f"could not download the state at step >= {min_step}: " + ("; ".join(reasons)
                         if reasons else "no donor is advertising it"))

    async def _download_from(self, donor: str, min_step: int) -> tuple[int, bytes]:
        _, reader, writer = await self.node.p2p.call_binary_stream_handler(PeerID.from_base58(donor), self.proto)
        try:
            await rpc.write_message(writer, {"v": VERSION, "min_step": min_step})
            head = await rpc.read_message(reader)
            if not isinstance(head, dict):
                raise ProtocolError("malformed answer")
            if head.get("busy"):
                raise StateError("busy")
            if "error" in head:
                raise StateError(str(head["error"]))
            step, size = head.get("step"), head.get("size")
            if not isinstance(step, int) or not isinstance(size, int) or step < min_step or not (
                    0 < size <= MAX_STATE_BYTES):
                raise ProtocolError(f"bad state header {head!r}")
            blob = await reader.readexactly(size)
            return step, blob
        finally:
            writer.close()
