"""The cache-break explainer: where two renderings of a prefix first differ (ADR-0020 decision 3)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from core.plan import Segment

EXCERPT = 40


class PrefixDifference(BaseModel):
    segment_index: int
    item_id: str
    budget_class: str
    byte_offset: int  # from the start of the prefix, in UTF-8 bytes
    offset_in_segment: int
    expected: str  # bytes around the difference, decoded for reading
    actual: str


def first_difference(expected: Sequence[Segment], actual: Sequence[Segment]) -> PrefixDifference | None:
    """The first segment, and the byte in it, where `actual` departs from `expected`; None if identical."""
    offset = 0
    for index in range(max(len(expected), len(actual))):
        a = expected[index] if index < len(expected) else None
        b = actual[index] if index < len(actual) else None
        ab = a.text.encode("utf-8", "surrogatepass") if a else b""
        bb = b.text.encode("utf-8", "surrogatepass") if b else b""
        if a is not None and b is not None and a.item_id == b.item_id and ab == bb:
            offset += len(ab)
            continue
        k = 0
        while k < min(len(ab), len(bb)) and ab[k] == bb[k]:
            k += 1
        seg = b or a
        assert seg is not None
        lo = max(0, k - EXCERPT // 2)
        return PrefixDifference(
            segment_index=index,
            item_id=seg.item_id,
            budget_class=seg.budget_class.value,
            byte_offset=offset + k,
            offset_in_segment=k,
            expected=ab[lo : k + EXCERPT].decode("utf-8", "replace"),
            actual=bb[lo : k + EXCERPT].decode("utf-8", "replace"),
        )
    return None


class WireDifference(BaseModel):
    """Where two requests' cacheable prefixes, as serialized on the wire, first differ."""

    byte_offset: int  # from the start of the wire prefix (activities/wire.py), in UTF-8 bytes
    part: str  # the member the offset falls in: "tools", or "system" (the system message or blocks)
    expected: str  # bytes around the difference, decoded for reading
    actual: str


def first_wire_difference(expected: str, actual: str) -> WireDifference | None:
    """The first byte where the wire prefix `actual` departs from `expected`; None if identical.

    Both are wire-prefix texts: the parts (`tools` first, when present) joined by one newline.
    """
    eb, ab = expected.encode("utf-8", "surrogatepass"), actual.encode("utf-8", "surrogatepass")
    if eb == ab:
        return None
    k = 0
    while k < min(len(eb), len(ab)) and eb[k] == ab[k]:
        k += 1
    before = eb[:k]
    part = "tools" if eb.startswith(b"[") and b"\n" not in before else "system"
    lo = max(0, k - EXCERPT // 2)
    return WireDifference(
        byte_offset=k,
        part=part,
        expected=eb[lo : k + EXCERPT].decode("utf-8", "replace"),
        actual=ab[lo : k + EXCERPT].decode("utf-8", "replace"),
    )
