"""One byte-stable JSON serialisation, used wherever bytes must not drift (sorted keys, no spaces)."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
