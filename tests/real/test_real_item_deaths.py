"""What kills vLLM 0.32.0 on CPU with one request? Nothing we could find (docs/deaths.md,
"What a real engine does"): each request below is refused with a 400 and the same engine serves
the next one. So on this engine an item whose prompt it cannot take is no death: its attempts
fail, and `checklist.strikes` skips it; the death rule for an item (loop/blame.py) is tested on
the stand-in, whose `die_on_prompt_chars` reproduces the seed's GPU engine's assertion."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from real_helpers import SERVED_NAME, Engine

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

REFUSED: dict[str, dict[str, Any]] = {  # what each sends beside the model and max_tokens: 4
    # past the context (50,200 tokens here: the bound is 11 characters a token) it is refused
    # before it is tokenized
    "a prompt over the context": {"prompt": "w " * 300_000},
    "out-of-vocabulary token ids": {"prompt": [10**9, 5, 6]},
    "logit_bias out of the vocabulary": {"prompt": "hi", "logit_bias": {"99999999": 100}},
    "allowed_token_ids out of it": {"prompt": "hi", "allowed_token_ids": [99999999]},
    "prompt_logprobs past the limit": {"prompt": "hi", "prompt_logprobs": 100000},
    "logprobs past the limit": {"prompt": "hi", "logprobs": 100000},
    "n past the limit": {"prompt": "hi", "n": 100000},
    "min_tokens over max_tokens": {"prompt": "hi", "min_tokens": 100},
    "an empty prompt": {"prompt": ""},
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_request_the_engine_cannot_take_is_refused_and_it_serves_on(
    healthy_engine: Engine, name: str
) -> None:
    before = healthy_engine.serving()
    body = {"model": SERVED_NAME, "max_tokens": 4, **REFUSED[name]}
    refused = httpx.post(f"{healthy_engine.url}/completions", json=body, timeout=120)
    assert refused.status_code == 400, (refused.status_code, refused.text[:300])
    served = httpx.post(
        f"{healthy_engine.url}/completions",
        json={"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2},
        timeout=120,
    )
    assert served.status_code == 200, served.text[:300]
    assert healthy_engine.serving() == before  # the same server, not a restarted one
