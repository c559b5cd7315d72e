"""Ring all-reduce: the classic bandwidth-optimal baseline (n-1 reduce steps, n-1 gather steps).

Each member sends to its successor and receives from its predecessor; the stream for an edge is
opened by the sender unless the receiver is in client mode (then the receiver dials in and says
hello), so client-mode peers take part as long as no two of them are adjacent. Weighted: every
member sends ``w * x`` and the weight itself as one extra element, and divides at the end.
Every element's sum is computed by one member and copied around, so results are identical.

Failure semantics: none beyond the deadline. Any failure or timeout raises AveragingError and
leaves the caller's tensor untouched. This strategy exists to measure against.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from dedloc.averaging.round_core import OpenStream, RoundStats
from dedloc.averaging.group import Group
from dedloc.averaging.wire import Header, Kind, read_header, read_payload_into, write_frame
from dedloc.net.messages import wait_peer_closed
from dedloc.errors import AveragingError, ProtocolError

logger = logging.getLogger(__name__)
HELLO = 0xFFFFFFFF


def ring_order(group: Group) -> list[int]:
    """Member indices in ring order, no two client-mode members adjacent; raises if impossible."""
    reach = [i for i, m in enumerate(group.members) if m.reachable]
    clients = [i for i, m in enumerate(group.members) if not m.reachable]
    if len(clients) > len(reach):
        raise AveragingError(f"ring needs at least as many reachable peers as client-mode ones "
                             f"({len(reach)} < {len(clients)})")
    order: list[int] = []
    for k, i in enumerate(reach):
        order.append(i)
        if k < len(clients):
            order.append(clients[k])
    return order


class RingRound:
    """One member's side of a ring all-reduce."""

    def __init__(self, group: Group, me: int, local: torch.Tensor, weight: float, open_stream: OpenStream,
                 timeout: float, chunk_bytes: int = 4 << 20):
        self.group, self.open_stream, self.chunk_bytes = group, open_stream, chunk_bytes
        self.order = ring_order(group)
        n = len(self.order)
        self.pos = self.order.index(me)
        self.succ = self.order[(self.pos + 1) % n]
        self.pred = self.order[(self.pos - 1) % n]
        self.buf = torch.empty(local.numel() + 1, dtype=torch.float32)
        torch.mul(local, weight, out=self.buf[:-1])
        self.buf[-1] = weight
        self.chunks = list(torch.tensor_split(torch.arange(self.buf.numel()), n))
        self.bounds = [(int(c[0]) if len(c) else 0, int(c[-1]) + 1 if len(c) else 0) for c in self.chunks]
        self.deadline = asyncio.get_running_loop().time() + timeout
        loop = asyncio.get_running_loop()
        self._in: asyncio.Future = loop.create_future()  # (reader, writer, first header or None)
        self._out: asyncio.Future = loop.create_future()  # (reader, writer) towards the successor
        self._done = asyncio.Event()  # set when this member's result is final
        self._received = asyncio.Event()  # set when everything from the predecessor has arrived
        self.stats = RoundStats()

    def _peer(self, i: int) -> str:
        return self.group.members[i].peer_id

    async def handle(self, peer_id: str, header: Header, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        k = self.group.index(peer_id)
        if header.kind != Kind.RING:
            raise ProtocolError(f"unexpected {header.kind.name} in a ring round")
        if k == self.succ and header.part == HELLO and not self._out.done():
            self._out.set_result((reader, writer))
            until = self._done  # our sending side: run() waits for the successor to close it
        elif k == self.pred and header.part != HELLO and not self._in.done():
            self._in.set_result((reader, writer, header))
            until = self._received  # our receiving side: closed as soon as everything arrived
        else:
            raise ProtocolError(f"peer {peer_id} is not an expected ring neighbour")
        await asyncio.wait_for(until.wait(), max(0.0, self.deadline - asyncio.get_running_loop().time()))
        return False

    async def run(self) -> torch.Tensor:
        try:
            async with asyncio.timeout_at(self.deadline):
                return await self._run()
        except TimeoutError:
            raise AveragingError(f"step {self.group.step}: ring all-reduce timed out") from None
        except (ConnectionError, asyncio.IncompleteReadError, ProtocolError) as e:
            raise AveragingError(f"step {self.group.step}: ring all-reduce failed: {type(e).__name__}: {e}") from None
        finally:
            self._received.set()
            self._done.set()

    async def _run(self) -> torch.Tensor:
        rid, n = self.group.round_id, len(self.order)
        own: list[asyncio.StreamWriter] = []
        send: asyncio.Task | None = None
        try:
            if self.group.members[self.succ].reachable:
                r, w = await self.open_stream(self._peer(self.succ))
                own.append(w)
                self._out.set_result((r, w))
            own_in = None
            if not self.group.members[self.order[self.pos]].reachable:
                _, own_in = await self._open_in()
                own.append(own_in)
            out_reader, out = await self._out
            pending_header = None
            reader = None
            tmp = None
            for t in range(2 * (n - 1)):
                reduce = t < n - 1
                send_c = (self.pos - t) % n if reduce else (self.pos + 1 - (t - n + 1)) % n
                recv_c = (self.pos - t - 1) % n if reduce else (self.pos - (t - n + 1)) % n
                s, e = self.bounds[send_c]
                send = asyncio.create_task(write_frame(out, Kind.RING, rid, t, 0.0, self.buf[s:e], self.chunk_bytes,
                                                       out_reader))
                if reader is None:
                    reader, in_writer, pending_header = await self._in
                header = pending_header or await read_header(reader)
                pending_header = None
                if header.kind != Kind.RING or header.part != t:
                    raise ProtocolError(f"expected ring step {t}, got {header.kind.name} {header.part}")
                s2, e2 = self.bounds[recv_c]
                if reduce:
                    if tmp is None:
                        tmp = torch.empty(max(b - a for a, b in self.bounds), dtype=torch.float32)
                    self.stats.add_received(await read_payload_into(reader, in_writer, header, tmp[:e2 - s2]),
                                            f"s{t}<")
                    self.buf[s2:e2] += tmp[:e2 - s2]
                else:  # gather: the chunk is final, read it in place
                    self.stats.add_received(await read_payload_into(reader, in_writer, header, self.buf[s2:e2]),
                                            f"s{t}<")
                self.stats.add_sent(await send, f"s{t}>")
            # everything arrived: close our receiving side now, then let the successor close our
            # sending side once it has read all we wrote (closing it first could drop the tail)
            self._received.set()
            if own_in is not None:
                own_in.close()
            await wait_peer_closed(out_reader, self.deadline - asyncio.get_running_loop().time())
            total = float(self.buf[-1])
            if not total > 0:
                raise AveragingError(f"step {self.group.step}: total weight is {total}")
            return self.buf[:-1] / total
        finally:
            if send is not None:  # a read failed while this step's send was under way: end it, retrieved
                if not send.done():
                    send.cancel()
                await asyncio.gather(send, return_exceptions=True)
            for w in own:
                w.close()

    def close(self) -> None:
        """Release whatever still waits on this round (its streams' handlers)."""
        self._received.set()
        self._done.set()

    async def _open_in(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self.open_stream(self._peer(self.pred))
        await write_frame(writer, Kind.RING, self.group.round_id, HELLO)
        self._in.set_result((reader, writer, None))
        return reader, writer
