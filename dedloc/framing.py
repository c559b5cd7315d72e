"""The one way dedloc turns several fields into the bytes it signs or MACs.

Each part is length-prefixed (big-endian, ``width`` bytes), so no two different lists of parts give
the same bytes: ``("ab", "c")`` and ``("a", "bc")`` differ, which a plain concatenation would not."""

from __future__ import annotations


def framed(*parts: bytes | str, width: int = 4) -> bytes:
    """``parts`` (str encoded as UTF-8), each preceded by its length in ``width`` bytes."""
    out = []
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        out.append(len(b).to_bytes(width, "big"))
        out.append(b)
    return b"".join(out)
