"""`ctxengine bench rendering`: the real escaping meets its targets; the old always-escape rule does not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

import core.rendering
from ctxengine.cli import app
from harness.bench import rendering_bench as rb
from harness.bench.rendering_corpus import ARTICLE_HTML, code_corpus, html_corpus, json_corpus, markdown_corpus
from harness.gates import rendering_attacks

OVERHEADS = ("overhead_html", "overhead_markdown", "overhead_code", "overhead_json")


def always_escape(text: str) -> str:
    """The rule before fidelity escaping: every backslash doubled, every '<' and '>' written as an escape."""
    return text.replace("\\", "\\\\").replace("<", "\\u{3C}").replace(">", "\\u{3E}")


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return rb.run()


class TestTargets:
    def test_overheads_meet_the_target(self, result: dict[str, Any]) -> None:
        """Every corpus costs at most 3% more tokens once escaped, and the bench says it passed."""
        for key in OVERHEADS:
            assert 1.0 <= result[key] <= rb.OVERHEAD_TARGET, (key, result[key])
        assert result["passed"] is True

    def test_every_attack_stays_inside(self, result: dict[str, Any]) -> None:
        """At least the 268 original written attacks are run, and none escapes its envelope."""
        assert result["attacks"] >= 268
        assert result["attack_escapes"] == 0

    def test_corpora_are_substantial(self, result: dict[str, Any]) -> None:
        """Each corpus holds real volume, so a ratio is not an artefact of a few lines."""
        for name in rb.CORPORA:
            assert result[f"{name}_documents"] >= 5
            assert result[f"{name}_tokens_raw"] >= 10_000

    def test_corpora_hold_what_the_old_rule_paid_for(self) -> None:
        """The benign corpora are full of '<', '>' and backslashes: the figures measure fidelity, not absence."""
        for corpus in (html_corpus(), markdown_corpus(), code_corpus(), json_corpus()):
            text = "".join(corpus)
            assert text.count("<") + text.count(">") + text.count("\\") >= 200
        assert "&&" in ARTICLE_HTML and "i < links.length" in ARTICLE_HTML
        assert any("\\\\Users\\\\" in doc for doc in json_corpus())


class TestNegative:
    def test_always_escaping_fails_the_gate(self) -> None:
        """With the old always-escape rule injected, HTML and JSON blow the target and the bench fails."""
        old = rb.run(escape=always_escape)
        assert old["overhead_html"] > 1.5
        assert old["overhead_json"] > rb.OVERHEAD_TARGET
        assert old["passed"] is False

    def test_escaping_that_lets_markers_through_fails(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """If rendering stopped escaping, written attacks would escape their envelopes and be counted."""
        monkeypatch.setattr(core.rendering, "escape_content", lambda text: text)
        assert rendering_attacks()["envelope_escapes"] > 0


class TestCommand:
    def test_cli_prints_one_json_object(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """`ctxengine bench rendering --json` prints the figures as one JSON object and exits 0 when passed."""
        figures = {"overhead_html": 1.0, "attacks": 336, "attack_escapes": 0, "passed": True}
        monkeypatch.setattr(rb, "run", lambda **_: figures)
        out = CliRunner().invoke(app, ["bench", "rendering", "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output) == figures

    def test_cli_exits_nonzero_when_failed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A failed bench run ends the command with exit code 1."""
        monkeypatch.setattr(rb, "run", lambda **_: {"passed": False})
        assert CliRunner().invoke(app, ["bench", "rendering", "--json"]).exit_code == 1
