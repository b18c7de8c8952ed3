"""Secrets masked in every file and stream: a runbook's `secrets:` values, the values of
variables named like secrets, tokens and URL credentials by shape."""

from __future__ import annotations

import re
import threading
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
# A URL's credentials: the password of `scheme://user:password@host` (the user stays), and the
# whole userinfo of `https://TOKEN@host` (a token as the user name, as git hosts take it).
URL_PASSWORD = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+(?=@)")
URL_TOKEN = re.compile(r"(?i)(\bhttps?://)[^/\s:@]+(?=@)")
# A variable whose name says it holds a secret (`api_key`, `hfkey`, `hf_token`, `db_password`,
# `client_secret`, `credentials`): its value is masked as if `secrets:` listed it. `tokens`
# (plural: `max_tokens`) is a count, not a secret.
SECRET_NAME = re.compile(r"(?i)(key$|token(?!s)|passw(or)?d|secret|credential)")
# The words local servers take where a key is required but none is checked (vLLM's docs use
# EMPTY, Claude Code's recipe none): no secret, and masking them would garble every report.
PLACEHOLDERS = frozenset({"empty", "none", "null", "dummy", "no-key", "not-needed"})
# An environment variable named like a secret (`WANDB_API_KEY`, `HF_TOKEN`, `PGPASSWORD`,
# `GITHUB_PAT`): `PAT` only as a word part, as `PATH` holds it.
ENV_SECRET_NAME = re.compile(
    r"(?i)(key|token(?!s)|secret|passw(or)?d|credential|(?<![a-z0-9])pat(?![a-z0-9]))"
)
FLAGS = frozenset({"true", "false", "yes", "no", "on", "off"})  # an env switch, no secret


def secret_named(name: str, value: object) -> bool:
    """A variable that holds a secret by its name: a text value (not a number) of a name shaped
    like a secret's."""
    return (
        isinstance(value, str)
        and not value.strip().replace(".", "", 1).isdigit()
        and value.strip().lower() not in PLACEHOLDERS
        and SECRET_NAME.search(name) is not None
    )


def env_secret_named(name: str, value: object) -> bool:
    """An environment variable that holds a secret by its name (`{{ env.WANDB_API_KEY }}`):
    masked as a runbook variable named so is, a switch (`USE_KEYRING=true`) excepted."""
    return (
        secret_named("key", value)  # the value's rules: text, no number, no placeholder
        and len(str(value)) >= MIN_SECRET_LENGTH
        and str(value).strip().lower() not in FLAGS
        and ENV_SECRET_NAME.search(name) is not None
    )


_made: list[str] = []  # secrets this process made (the agent proxy's URL tokens)
_made_lock = threading.Lock()


def register(value: str) -> None:
    """A secret the run made (the agent proxy's URL token, which an agent prints in its errors):
    masked from now on by every Redactor, those made before included."""
    with _made_lock:
        if value not in _made:
            _made.append(value)


class Redactor:
    """Masks secret values and credential-shaped tokens in text and in records."""

    def __init__(self, secret_values: Iterable[str]) -> None:
        self._values = {v for v in secret_values if len(v) >= MIN_SECRET_LENGTH}
        self._made = -1  # how many registered secrets the pattern holds
        self._pattern = self._compiled()

    def _compiled(self) -> re.Pattern[str]:
        with _made_lock:
            self._made = len(_made)
            made = set(_made)
        # Longest first, so a secret that contains another one is masked whole.
        values = sorted(self._values | made, key=len, reverse=True)
        return re.compile("|".join([*(re.escape(v) for v in values), *TOKEN_PATTERNS]))

    def text(self, s: str) -> str:
        if self._made != len(_made):  # a secret registered since
            self._pattern = self._compiled()
        s = BEARER.sub(r"\g<1>" + MASK, self._pattern.sub(MASK, s))
        return URL_TOKEN.sub(r"\g<1>" + MASK, URL_PASSWORD.sub(r"\g<1>" + MASK, s))

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
