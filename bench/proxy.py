"""The agent proxy's overhead (loop/proxy.py): N requests direct vs through the proxy.

    .venv/bin/python -m bench.proxy            # 200 requests of each kind, alternating
    .venv/bin/python -m bench.proxy -n 500 --tokens 64

Against the stand-in server, one client each way (a new connection per request, as an agent
CLI run makes them), alternating direct and proxied so that the machine's noise hits both:
a small JSON answer (`/v1/models`), a whole chat completion and a streamed one (`--tokens`
tokens, `stream_options.include_usage`). It prints the median and p95 of each and the ratio
proxied / direct: the time an agent's request pays for its receipt.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.stand import Server
from ralph_runner.loop.proxy import Proxy


def cases(model: str, tokens: int) -> dict[str, Callable[[str], None]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hello " * 50}]}
    chat |= {"max_tokens": tokens, "ignore_eos": True}

    def models(url: str) -> None:
        httpx.get(f"{url}/models", timeout=10).raise_for_status()

    def whole(url: str) -> None:
        httpx.post(f"{url}/chat/completions", json=chat, timeout=30).raise_for_status()

    def stream(url: str) -> None:
        body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=30) as response:
            response.raise_for_status()
            for _ in response.iter_raw():
                pass

    return {"GET /v1/models": models, "chat, whole": whole, "chat, streamed": stream}


def timed(call: Callable[[str], None], url: str) -> float:
    started = time.perf_counter()
    call(url)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="requests of each kind, each way")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per chat answer")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as scratch:
        server = Server(Path(scratch) / "standin")
        server.start()
        try:
            with Proxy(server.url) as proxy:
                print(f"stand-in {server.url}, proxy {proxy.url}; {args.n} requests each way")
                print("| request | direct p50 | proxied p50 | direct p95 | proxied p95 | ratio |")
                print("|---|---|---|---|---|---|")
                for name, call in cases("stand-in", args.tokens).items():
                    for url in (server.url, proxy.url):  # warm up both
                        call(url)
                    direct, proxied = [], []
                    for _ in range(args.n):
                        direct.append(timed(call, server.url))
                        proxied.append(timed(call, proxy.url))
                    d50, p50 = statistics.median(direct), statistics.median(proxied)
                    d95 = statistics.quantiles(direct, n=20)[-1]
                    p95 = statistics.quantiles(proxied, n=20)[-1]
                    print(
                        f"| {name} | {d50 * 1e3:.2f} ms | {p50 * 1e3:.2f} ms | "
                        f"{d95 * 1e3:.2f} ms | {p95 * 1e3:.2f} ms | {p50 / d50:.2f} |"
                    )
                totals = proxy.settled()
                print(
                    f"proxy counted {totals.requests} requests, {totals.prompt_tokens} prompt and "
                    f"{totals.generated_tokens} generated tokens"
                )
        finally:
            server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
