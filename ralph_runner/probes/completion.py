"""`completion: {url, model}`: a 1-token chat completion, because /health can answer 200 while
the engine hangs; vLLM answers 500/503 once its engine is dead (reason status).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt

from ralph_runner.plugins.fields import Templated
from ralph_runner.probes import ProbeContext, Verdict, excerpt, request

KIND = "completion"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str  # the OpenAI base URL, e.g. http://127.0.0.1:8000/v1
    model: str  # the served model's name
    max_tokens: Templated[PositiveInt] = 1  # tokens to generate
    prompt: str = "ping"  # the user message sent
    headers: dict[str, str] = {}  # e.g. Authorization for a server started with --api-key


def check(params: Params, ctx: ProbeContext) -> Verdict:
    body = {
        "model": params.model,
        "messages": [{"role": "user", "content": params.prompt}],
        "max_tokens": params.max_tokens,
    }
    url = f"{params.url.rstrip('/')}/chat/completions"
    response = request(ctx, "POST", url, json=body, headers=params.headers)
    if response.status_code != 200:
        return Verdict(False, "status", f"HTTP {response.status_code}: {excerpt(response.text)}")
    try:
        choices = response.json().get("choices")
    except (ValueError, AttributeError):
        choices = None
    if not isinstance(choices, list) or not choices:
        return Verdict(False, "body", f"HTTP 200 without choices: {excerpt(response.text)}")
    return Verdict(True, None, "HTTP 200, generated")
