"""The byte protocol for tensor parts (see docs/wire.md).

A frame is a fixed 44-byte little-endian header followed by ``numel * itemsize`` raw bytes
(or a UTF-8 message for ERROR frames). Payloads are streamed in large chunks straight out of
and into preallocated tensors: no per-chunk framing, no protobuf. While reading a payload, the
receiver sends credit bytes back on the same stream, which pace the sender (dedloc.net.bulk).

Guarantees: a receiver never allocates from a length a peer sent; it reads into a buffer of
the size it expects and rejects any other size with :class:`ProtocolError` naming the field.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
import torch

from dedloc.errors import AveragingError, ProtocolError
from dedloc.net import bulk

MAGIC = b"DDLC"
MAX_TOTAL_WEIGHT = float(1 << 52)
"""No header's weight is above this: a member's weight is at most 2^40 (averaging/bounds.py), and a
result's is a total over at most 4096 of them."""
VERSION = 8  # 2: members carry a "fetch" flag, ready records the vector size; 3: payloads are credit-paced;
# 4: probes are credit-paced too; 5: a credit per 16 KiB (was 64 KiB); 6: results are pulled on a stream
# of their own (PULL) and streamed while contributions still arrive; 7: verified parts (CHECK, VERDICT, DIGEST);
# 8: every part's RESULT is preceded by its contributor set (CONTRIBUTORS); parts that differ are amended (AMEND)
HEADER = struct.Struct("<4sHBB16sIdQ")
MAX_ERROR_BYTES = 4096
UNKNOWN_ROUND = "unknown round (missed or expired)"
"""The ERROR text of a peer that does not know the round a stream names (it restarted, the round
expired there, or it never joined): the one refusal a caller tells apart (:class:`UnknownRound`)."""


class UnknownRound(ProtocolError, AveragingError):
    """A peer answered that it does not know this round (``UNKNOWN_ROUND``): it holds nothing of it,
    so whoever else can serve the request may be asked instead."""


def refusal(who: str, text: str) -> ProtocolError:
    """The error for ``who`` answering ERROR with ``text``."""
    if text == UNKNOWN_ROUND:
        return UnknownRound(f"{who} does not know the round (it restarted, or the round expired there)")
    return ProtocolError(f"{who} refused: {text}")
DIGEST_BYTES = 32
MAX_GROUP = 4096
"""The largest group a contributor set can name (matchmaking caps groups well below this)."""


class Kind(enum.IntEnum):
    CONTRIB = 1  # sender -> aggregator: my weighted-mean input for your part
    RESULT = 2  # aggregator -> member: the averaged part (weight = total weight averaged)
    ERROR = 3  # either way: the round failed for this stream; payload is a UTF-8 reason
    FAILOVER = 4  # sender -> backup aggregator: CONTRIB for the part of a failed aggregator
    ACK = 5  # backup -> aggregator: the RESULT arrived whole
    FETCH = 6  # member -> group representative: send me the final (hierarchical) result
    RING = 7  # ring all-reduce chunk; part = step index
    PULL = 8  # member -> aggregator: send me your part's RESULT on this stream
    CHECK = 9  # sender -> backup aggregator (verified rounds): a copy of its CONTRIB, for the recomputation
    VERDICT = 10  # member -> backup aggregator (verified rounds): is the part's result you hold verified?
    DIGEST = 11  # backup -> member: blake2b-256 of the verified part's wire bytes (payload: the digest)
    CONTRIBUTORS = 12  # before every RESULT: whose contributions it averages (payload: a bitmask of member indices)
    AMEND = 13  # member -> fixer, after CONTRIBUTORS(agreed set): re-reduce the part with exactly that set


DTYPES: dict[int, torch.dtype] = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Header:
    kind: Kind
    dtype: torch.dtype | None
    round_id: bytes
    part: int
    weight: float
    numel: int

    @property
    def nbytes(self) -> int:
        if self.kind in (Kind.ERROR, Kind.DIGEST, Kind.CONTRIBUTORS):
            return self.numel
        if self.dtype is None:
            return 0
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def pack_header(kind: Kind, round_id: bytes, part: int = 0, weight: float = 0.0, numel: int = 0,
                dtype: torch.dtype | None = None) -> bytes:
    if len(round_id) != 16:
        raise ValueError("round_id must be 16 bytes")
    code = 0 if dtype is None else DTYPE_CODES[dtype]
    return HEADER.pack(MAGIC, VERSION, int(kind), code, round_id, part, float(weight), numel)


def unpack_header(raw: bytes) -> Header:
    """Parse and validate a header; raises ProtocolError naming what is wrong."""
    magic, version, kind, code, round_id, part, weight, numel = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a dedloc averaging stream")
    if version != VERSION:
        raise ProtocolError(f"protocol version mismatch: ours is {VERSION}, theirs is {version}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if code and code not in DTYPES:
        raise ProtocolError(f"unknown dtype code {code}")
    if kind == Kind.ERROR and numel > MAX_ERROR_BYTES:
        raise ProtocolError(f"error message of {numel} bytes exceeds {MAX_ERROR_BYTES}")
    if kind == Kind.DIGEST and (numel != DIGEST_BYTES or code):
        raise ProtocolError(f"a digest must be {DIGEST_BYTES} bytes, got {numel}")
    if kind == Kind.CONTRIBUTORS and (numel > MAX_GROUP // 8 or code):
        raise ProtocolError(f"a contributor set of {numel} bytes exceeds {MAX_GROUP // 8}")
    if not (weight == weight) or weight < 0 or weight > MAX_TOTAL_WEIGHT:
        raise ProtocolError(f"invalid weight {weight}")
    return Header(kind, DTYPES.get(code), bytes(round_id), part, weight, numel)


async def read_header(reader: asyncio.StreamReader) -> Header:
    try:
        raw = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(f"stream closed after {len(e.partial)} of {HEADER.size} header bytes") from None
    return unpack_header(raw)


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


async def write_frame(writer: asyncio.StreamWriter, kind: Kind, round_id: bytes, part: int = 0,
                      weight: float = 0.0, tensor: torch.Tensor | None = None, chunk_bytes: int = 4 << 20,
                      reader: asyncio.StreamReader | None = None,
                      hold: Callable[[], Awaitable[None]] | None = None,
                      supply: bulk.Supply | None = None) -> bulk.Transfer | None:
    """Write one frame; a tensor (CPU, contiguous) goes as raw bytes in large chunks, paced by the
    receiver's credits read from ``reader`` (dedloc.net.bulk). Returns once the payload is credited,
    with its timing (None without a payload). With ``supply``, the tensor is still being produced:
    only the bytes the supply reports ready are written (bulk.send_paced).

    With ``hold``, the payload's last credit unit is written only once ``await hold()`` returns, so
    the receiver cannot complete the frame before then; if ``hold`` raises, the frame is left
    incomplete and the exception propagates (the caller then closes the stream). The returned
    timing leaves the wait out."""
    if tensor is None:
        writer.write(pack_header(kind, round_id, part, weight))
        await writer.drain()
        return None
    if reader is None:
        raise ValueError("a frame with a payload needs the stream's reader for credits")
    writer.write(pack_header(kind, round_id, part, weight, tensor.numel(), tensor.dtype))
    view = memoryview(_bytes_view(tensor))
    try:
        if hold is None:
            return await bulk.send_paced(writer, reader, view, chunk_bytes, supply)
        head = max(0, len(view) - 1) // bulk.UNIT * bulk.UNIT  # whole units: the receiver credits all of them
        first = await bulk.send_paced(writer, reader, view[:head], chunk_bytes, supply)
        await hold()
        last = await bulk.send_paced(writer, reader, view[head:], chunk_bytes, bulk.shifted(supply, head))
        return bulk.Transfer(len(view), first.start, first.end + last.seconds, max(first.queue_s, last.queue_s))
    except bulk.ReceiverAnswered as e:
        why = await _refusal(reader)
        raise (refusal("the receiver", why) if why else ProtocolError(str(e))) from None


async def _refusal(reader: asyncio.StreamReader) -> str | None:
    """The text of the ERROR frame a receiver answered with instead of credits, if that is what it sent."""
    try:
        header = await asyncio.wait_for(read_header(reader), 5)
        if header.kind == Kind.ERROR:
            return await asyncio.wait_for(read_error_text(reader, header), 5)
    except (ProtocolError, ConnectionError, asyncio.IncompleteReadError, TimeoutError):
        pass
    return None


async def write_error(writer: asyncio.StreamWriter, round_id: bytes, message: str) -> None:
    data = message.encode()[:MAX_ERROR_BYTES]
    writer.write(pack_header(Kind.ERROR, round_id, numel=len(data)) + data)
    await writer.drain()


async def read_error_text(reader: asyncio.StreamReader, header: Header) -> str:
    data = await reader.readexactly(header.numel)
    return data.decode(errors="replace")


async def write_contributors(writer: asyncio.StreamWriter, round_id: bytes, part: int,
                             contributors: tuple[int, ...], group_size: int) -> None:
    """Write a CONTRIBUTORS frame: ``contributors`` (member indices) as a bitmask of
    ceil(group_size / 8) bytes, bit i of byte i // 8 for member i."""
    mask = sum(1 << i for i in contributors).to_bytes((group_size + 7) // 8, "little")
    writer.write(pack_header(Kind.CONTRIBUTORS, round_id, part, numel=len(mask)) + mask)
    await writer.drain()


async def read_contributors(reader: asyncio.StreamReader, header: Header, group_size: int) -> tuple[int, ...]:
    """Read a CONTRIBUTORS frame's payload (``header`` already read): the member indices in order.
    Raises ProtocolError unless it is exactly ceil(group_size / 8) bytes naming members only."""
    size = (group_size + 7) // 8
    if header.numel != size:
        raise ProtocolError(f"a contributor set for {group_size} members must be {size} bytes, got {header.numel}")
    mask = int.from_bytes(await reader.readexactly(size), "little")
    if mask >> group_size:
        raise ProtocolError(f"the contributor set names a member beyond the group's {group_size}")
    return tuple(i for i in range(group_size) if mask >> i & 1)


def check_payload(header: Header, out: torch.Tensor) -> None:
    """Raise ProtocolError unless the frame's payload fits ``out`` exactly (numel and dtype)."""
    if header.dtype != out.dtype:
        raise ProtocolError(f"dtype mismatch: expected {out.dtype}, got {header.dtype}")
    if header.numel != out.numel():
        raise ProtocolError(f"size mismatch: expected {out.numel()} elements, got {header.numel}")


async def read_payload_into(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, header: Header,
                            out: torch.Tensor, on_progress: Callable[[int], None] | None = None) -> bulk.Transfer:
    """Read the frame's payload into ``out`` (sending credits through ``writer``); the header must
    match out's numel and dtype, else ProtocolError and nothing is read. ``on_progress(bytes so
    far)`` is called as the payload arrives. Returns its timing."""
    check_payload(header, out)
    if not out.is_contiguous():
        raise ValueError("read_payload_into needs a contiguous tensor")
    return await bulk.recv_into(reader, writer, memoryview(_bytes_view(out)), on_progress)
