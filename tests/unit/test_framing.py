"""The framing text matches the rendering: every trust level in a full request is explained, and truly."""

from __future__ import annotations

import re

from core.budget import ContextBudget
from core.build import build
from core.items import TrustLevel
from core.rendering import FRAMING_TEXT, TRUST_MEANINGS, parse_envelopes
from tests.unit import factories as f

_ENVELOPE_RE = re.compile(r"<<ctx:[0-9a-f]{16,64} .*?\n<</ctx:[0-9a-f]{16,64}>>\n", re.DOTALL)


def _request() -> tuple[str, list[tuple[str, str]]]:
    """Build a full request (policy, instructions, tools, memory, history with tool results) and render it."""
    plan = build(f.prefix(), f.body(6), budget=ContextBudget(), estimator=f.estimator(), secret=f.SECRET)
    text = "".join(s.text for s in plan.segments)
    return text, [(s.kind, s.trust.value) for s in plan.segments]


class TestFramingMatchesRequest:
    def test_every_trust_level_present_is_explained_in_platform_text(self) -> None:
        """Each trust level on an envelope of a real request appears, with its meaning, in the platform text."""
        text, _ = _request()
        platform_text = _ENVELOPE_RE.sub("", text)
        assert FRAMING_TEXT in platform_text
        present = {e.trust for e in parse_envelopes(text)}
        assert {"OPERATOR", "USER", "MODEL", "TOOL", "EXTERNAL_UNTRUSTED"} <= present
        for trust in present:
            assert TRUST_MEANINGS[trust] in platform_text

    def test_every_engine_trust_level_has_a_meaning(self) -> None:
        """No trust level the item model knows is left out of the framing."""
        assert {t.value for t in TrustLevel} <= set(TRUST_MEANINGS)

    def test_what_the_framing_says_each_level_holds_is_what_is_rendered(self) -> None:
        """Platform never renders in an envelope; the operator's instructions are OPERATOR; the user's are USER."""
        text, kinds = _request()
        envelopes = parse_envelopes(text)
        assert all(e.trust != "PLATFORM" for e in envelopes)
        by_trust: dict[str, list[str]] = {}
        for envelope in envelopes:
            by_trust.setdefault(envelope.trust, []).append(envelope.content)
        assert any("You are a research agent" in c for c in by_trust["OPERATOR"])
        assert any("what next?" in c for c in by_trust["USER"])
        assert not any("research agent" in c for trust in ("MODEL", "TOOL") for c in by_trust.get(trust, []))
        platform_kinds = {kind for kind, trust in kinds if trust == "PLATFORM"}
        assert platform_kinds, "the platform policy and framing render outside envelopes"
