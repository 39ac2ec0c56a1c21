"""`ctxengine bench rendering`: what escaping costs on benign content, and that no written attack escapes.

For each benign corpus (HTML, Markdown, code, JSON; see `bench/rendering_corpus.py`) the overhead is the
cl100k token count of the escaped text over the token count of the raw text, each summed over the corpus:
what a model pays, in tokens, for the envelope's escaping. The attack figures come from the same check as
`ctxengine gate trust` (`harness.gates.rendering_attacks`): every written attack rendered between two
other envelopes must parse back exactly. Targets: every overhead at most 1.03, zero escapes.
See docs/rendering-contract.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from activities.tokens import TiktokenCounter
from core.rendering import ESCAPING_FINGERPRINT, escape_content
from harness.bench.rendering_corpus import code_corpus, html_corpus, json_corpus, markdown_corpus
from harness.gates import rendering_attacks

OVERHEAD_TARGET = 1.03
CORPORA: dict[str, Callable[[], list[str]]] = {
    "html": html_corpus,
    "markdown": markdown_corpus,
    "code": code_corpus,
    "json": json_corpus,
}


def overhead(texts: list[str], escape: Callable[[str], str], count: Callable[[str], int]) -> tuple[int, int]:
    """Return (raw tokens, escaped tokens) summed over ``texts``."""
    return sum(count(t) for t in texts), sum(count(escape(t)) for t in texts)


def run(*, escape: Callable[[str], str] = escape_content, progress: bool = False) -> dict[str, Any]:
    """Measure every corpus with ``escape`` (the real rule unless a test injects another) and the attacks."""
    count = TiktokenCounter("cl100k_base").count
    result: dict[str, Any] = {"escaping_fingerprint": ESCAPING_FINGERPRINT}
    overheads = []
    for name, corpus in CORPORA.items():
        texts = corpus()
        raw, escaped = overhead(texts, escape, count)
        ratio = round(escaped / raw, 4)
        overheads.append(ratio)
        result[f"overhead_{name}"] = ratio
        result[f"{name}_documents"] = len(texts)
        result[f"{name}_chars"] = sum(len(t) for t in texts)
        result[f"{name}_tokens_raw"] = raw
        result[f"{name}_tokens_escaped"] = escaped
        if progress:
            print(f"{name}: {len(texts)} documents, {raw} -> {escaped} tokens ({ratio}x)")
    attacks = rendering_attacks()
    result["attacks"] = attacks["attacks"]
    result["attack_escapes"] = attacks["envelope_escapes"]
    result["overhead_target"] = OVERHEAD_TARGET
    result["passed"] = all(r <= OVERHEAD_TARGET for r in overheads) and result["attack_escapes"] == 0
    return result
