"""A small Python client for the gateway: OpenAI requests plus the `cartridges` field.

Runs in the user's own process (an application, a notebook, a benchmark), never in the gateway or
vLLM. It owns only its HTTP connection pool (`close()` or a `with` block releases it); cartridges,
the registry and the KV stay with the gateway and the servers behind it.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx


def cartridge(id: str, source: str | None = None, force_redownload: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"id": id, "force_redownload": force_redownload}
    if source:
        ref["source"] = source
    return ref


class CartridgeClient:
    """Synchronous client. `cartridges` items are ids/URIs/paths or dicts from `cartridge()`."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "CartridgeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _refs(cartridges) -> list[dict[str, Any]]:
        return [c if isinstance(c, dict) else cartridge(c) for c in (cartridges or [])]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def completions(self, prompt, *, cartridges=None, **params) -> dict[str, Any]:
        return self._post("/v1/completions", {"prompt": prompt, "cartridges": self._refs(cartridges), **params})

    def chat(self, messages, *, cartridges=None, **params) -> dict[str, Any]:
        return self._post("/v1/chat/completions",
                          {"messages": messages, "cartridges": self._refs(cartridges), **params})

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield the JSON events of a streaming request (`stream: true` is set for you)."""
        import json

        body = {**body, "stream": True}
        with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
