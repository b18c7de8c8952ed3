"""Secrets masked in every file and stream: a runbook's `secrets:` values and tokens by shape."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MASK = "****"
# Secret values shorter than this are not masked: masking "a" or "42" everywhere would make a
# report unreadable and would reveal the value anyway (every gap in the text would show it).
MIN_SECRET_LENGTH = 4
# Credentials recognised by their shape, masked whether or not a runbook lists them in `secrets:`.
TOKEN_PATTERNS = (
    r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{16,}",  # OpenAI, Anthropic (sk-ant-...) API keys
    r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{16,}",  # Hugging Face access tokens
    r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])",  # AWS access key ids
)
BEARER = re.compile(r"(?i)(?<![A-Za-z0-9])(bearer\s+)[A-Za-z0-9._~+/-]+=*")


class Redactor:
    """Masks secret values and credential-shaped tokens in text and in records."""

    def __init__(self, secret_values: Iterable[str]) -> None:
        values = sorted(
            {v for v in secret_values if len(v) >= MIN_SECRET_LENGTH}, key=len, reverse=True
        )
        # Longest first, so a secret that contains another one is masked whole.
        self._pattern = re.compile("|".join([*(re.escape(v) for v in values), *TOKEN_PATTERNS]))

    def text(self, s: str) -> str:
        return BEARER.sub(r"\g<1>" + MASK, self._pattern.sub(MASK, s))

    def data(self, obj: Any, *, keys: bool = False) -> Any:
        """Every string in nested data masked; `keys` too (the state keeps strikes by item
        text), else keys are kept as they are (they are field names)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {
                self.data(key) if keys else key: self.data(value, keys=keys)
                for key, value in obj.items()
            }
        if isinstance(obj, list | tuple):
            return [self.data(value, keys=keys) for value in obj]
        return obj
