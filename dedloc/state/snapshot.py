"""A training state as bytes: what a newcomer downloads and what a backbone checkpoints.

Format: ``torch.save`` of a dict with ``format``, ``step``, ``model``, ``optimizer``,
``scheduler``, ``scaler`` and ``extra``. Loading uses ``weights_only=True``, so a hostile donor
can send a wrong state (caught by the fingerprint check) but cannot run code.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, Iterable

import torch

from dedloc.errors import ProtocolError

FORMAT = 1


def encode(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    return buf.getvalue()


def decode(blob: bytes) -> dict[str, Any]:
    """Parse a state; raises ProtocolError if it is not one (wrong format, not a dict, no step)."""
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ProtocolError(f"not a dedloc training state: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("step"), int):
        raise ProtocolError(f"not a dedloc training state of format {FORMAT}")
    return state


def peek_step(blob: bytes) -> int:
    return decode(blob)["step"]


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """An exact hash of the tensors' values (any difference in any bit changes it)."""
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
