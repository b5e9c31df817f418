"""OpenAI-compatible gateway that adds the `cartridges` request field in front of a vLLM server.

Why a gateway: vLLM fixes a request's tokens before any connector sees it, so the cartridge's
token ids must be placed first by whoever builds the prompt. The gateway resolves each cartridge
(registry id or label, local path, or S3 URI; fetching and registering it so the plugin serves
it), builds the prompt with the model's tokenizer and chat template, puts the cartridge's ids
first (the BOS slot belongs to the cartridge), forwards a token-id prompt to the upstream
`/v1/completions`, and answers with ordinary OpenAI responses (chat ones rebuilt from the
completion, streaming included).

Runs as its own process (`lmcache-cartridge gateway`). It owns a registry connection and a
tokenizer; the vLLM server and its plugins are reached only over HTTP and the shared registry.
"""


import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest
from lmcache_cartridge.store.registry import Entry, Registry, RegistryError
from lmcache_cartridge.lmcache.serving import NotServed, Wanted, wait_served

logger = logging.getLogger("lmcache_cartridge.api.gateway")


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx with this message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GatewaySettings:
    upstream: str
    model: str                      # the upstream model name (vLLM --model): manifests must match it
    tokenizer: str                  # a local tokenizer directory (usually the model directory)
    registry: Path
    cache_dir: Path
    chunk_size: int = 256
    local_roots: tuple[Path, ...] = ()  # local cartridge paths must lie under one of these
    s3: dict[str, str] = field(default_factory=dict)
    max_cartridges: int = 4
    max_id_length: int = 1024
    max_body_bytes: int = 4 << 20
    upstream_timeout: float = 600.0
    serve_timeout: float = 15.0     # wait this long for the engine's plugins to serve a cartridge


# --- resolution -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CartridgeRef:
    id: str
    source: str | None = None
    force_redownload: bool = False


def parse_refs(raw: Any, settings: GatewaySettings) -> list[CartridgeRef]:
    """Validate the request's `cartridges` field (shape, types, limits)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(400, "'cartridges' must be a list of {id, source, force_redownload} objects")
    if len(raw) > settings.max_cartridges:
        raise RequestError(400, f"too many cartridges: {len(raw)} (at most {settings.max_cartridges})")
    refs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RequestError(400, f"cartridges[{i}] must be an object")
        unknown = set(item) - {"id", "source", "force_redownload"}
        if unknown:
            raise RequestError(400, f"cartridges[{i}] has unknown fields {sorted(unknown)}")
        cid, source, force = item.get("id"), item.get("source"), item.get("force_redownload", False)
        if not isinstance(cid, str) or not cid:
            raise RequestError(400, f"cartridges[{i}].id must be a non-empty string")
        if len(cid) > settings.max_id_length:
            raise RequestError(400, f"cartridges[{i}].id is longer than {settings.max_id_length} characters")
        if source is not None and source not in ("s3", "local"):
            raise RequestError(400, f"cartridges[{i}].source must be 's3' or 'local', got {source!r}")
        if not isinstance(force, bool):
            raise RequestError(400, f"cartridges[{i}].force_redownload must be true or false")
        refs.append(CartridgeRef(cid, source, force))
    return refs


class Resolver:
    """Turns a cartridge reference into a registered, servable cartridge. Owned by the app."""

    def __init__(self, settings: GatewaySettings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry

    def resolve(self, ref: CartridgeRef) -> tuple[Entry, Manifest]:
        """Blocking (file reads, S3 downloads, packing): the app calls it from a worker thread."""
        try:
            return self._resolve(ref)
        except (RequestError, CartridgeError):
            raise
        except (OSError, ValueError) as e:  # unreadable file, NUL byte, name too long, ...
            raise RequestError(400, f"cannot use cartridge {ref.id[:200]!r}: {type(e).__name__}: {e}") from None

    def _resolve(self, ref: CartridgeRef) -> tuple[Entry, Manifest]:
        if ref.id.startswith("s3://") or ref.source == "s3" and "://" in ref.id:
            entry = self._s3(ref)
        elif ref.id.startswith("/") or ref.source == "local":
            entry = self._local(ref)
        else:
            try:
                entry = self.registry.resolve(ref.id)
            except RegistryError as e:
                raise RequestError(404, str(e)) from None
        manifest = Manifest.load(entry.path)
        if manifest.model != self.settings.model:
            raise RequestError(400, f"cartridge {entry.id!r} was made for model {manifest.model!r}, "
                                    f"this server runs {self.settings.model!r}")
        if manifest.chunk_size != self.settings.chunk_size:
            raise RequestError(400, f"cartridge {entry.id!r} has chunk_size {manifest.chunk_size}, "
                                    f"the server uses {self.settings.chunk_size}")
        return entry, manifest

    def _s3(self, ref: CartridgeRef) -> Entry:
        from lmcache_cartridge.store.registration import register_s3
        from lmcache_cartridge.store.s3 import NotFound, OriginError, S3Settings, AccessDenied

        try:
            return register_s3(self.registry, ref.id, self.settings.cache_dir,
                               S3Settings.from_mapping(self.settings.s3),
                               force_redownload=ref.force_redownload, chunk_size=self.settings.chunk_size)
        except NotFound as e:
            raise RequestError(404, str(e)) from None
        except AccessDenied as e:
            raise RequestError(403, str(e)) from None
        except OriginError as e:
            raise RequestError(502, f"cannot fetch {ref.id}: {e}") from None
        except (CartridgeError, ValueError) as e:  # ValueError: a malformed s3:// URI
            raise RequestError(400, str(e)) from None

    def _local(self, ref: CartridgeRef) -> Entry:
        path = Path(ref.id)
        if not path.is_absolute():
            raise RequestError(400, f"local cartridge id must be an absolute path, got {ref.id!r}")
        resolved = path.resolve()
        if not any(resolved.is_relative_to(root.resolve()) for root in self.settings.local_roots):
            raise RequestError(403, f"{ref.id} is outside the directories this gateway may read")
        if resolved.is_dir() and (resolved / MANIFEST_NAME).is_file():
            packed_dir = resolved
        elif resolved.is_file():
            packed_dir = self._pack_file(resolved)
        else:
            raise RequestError(404, f"no cartridge at {ref.id}")
        try:
            return self.registry.register(packed_dir, source_uri=str(resolved))
        except CartridgeError as e:
            raise RequestError(400, str(e)) from None

    def _pack_file(self, path: Path) -> Path:
        """A `.pt` in any input format: pack once, content-addressed, into the cache dir."""
        from lmcache_cartridge.cartridge.formats import load_input
        from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv

        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        out = self.settings.cache_dir / "packed" / digest[:32]
        if (out / MANIFEST_NAME).is_file():
            return out
        try:
            loaded = load_input(path)
            kv = loaded.kv
            if kv is None:  # token-only: compute its KV once with the model
                from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model

                model, _ = load_model(self.settings.tokenizer)
                kv = compute_prefix_kv(model, loaded.token_ids)
            kind = "first_k" if loaded.token_ids is not None else "trained"
            tok = self.tokenizer_info()
            pack_kv(kv, out, cartridge_id=_safe_id(path.stem, digest), model=self.settings.model, kind=kind,
                    token_ids=loaded.token_ids, vocab=VocabInfo(*tok), chunk_size=self.settings.chunk_size,
                    provenance={"source": str(path), "sha256": digest}, overwrite=True)
        except CartridgeError as e:
            raise RequestError(400, str(e)) from None
        return out

    def tokenizer_info(self) -> tuple[int, tuple[int, ...]]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.settings.tokenizer)
        return len(tok), tuple(tok.all_special_ids)


def _without_credentials(url: str) -> str:
    """`url` with any `user:password@` removed, for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=host))


def _safe_id(stem: str, digest: str) -> str:
    import re

    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:80] or "cartridge"
    return f"{clean}-{digest[:12]}"


def chain_prefix(manifests: list[Manifest]) -> list[int]:
    """The token ids to put first for several cartridges, or an error saying why they clash.

    Valid combinations are first-k chains: each cartridge's tokens extend the previous one's
    (a shared system prompt, then a document computed after it), so the longest one carries
    the KV of all. Anything else would need KV that was never computed.
    """
    if not manifests:
        return []
    ordered = manifests
    for prev, nxt in zip(ordered, ordered[1:]):
        if nxt.token_ids[: len(prev.token_ids)] != prev.token_ids:
            raise RequestError(
                400, f"cartridges {prev.cartridge_id!r} and {nxt.cartridge_id!r} cannot be combined: "
                     f"{nxt.cartridge_id!r} was not computed after {prev.cartridge_id!r}'s tokens "
                     "(only first-k chains, each extending the previous, can be served together)")
    return list(ordered[-1].token_ids)


# --- prompts ----------------------------------------------------------------------------------
class PromptBuilder:
    """Tokenizer-side work. Owned by the app; the tokenizer is loaded once."""

    def __init__(self, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.bos = self.tok.bos_token_id

    def completion_ids(self, prompt: Any, prefix: list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tok(prompt, add_special_tokens=not prefix)["input_ids"]
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "'prompt' must be a string or a list of token ids (one prompt per request)")
        return prefix + ids

    def chat_ids(self, messages: Any, prefix: list[int]) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise RequestError(400, "'messages' must be a non-empty list of {role, content} with string content")
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # no chat template, or one that rejects these roles/order
            raise RequestError(400, f"the model's chat template rejected 'messages': {type(e).__name__}: {e}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if prefix and ids and ids[0] == self.bos:  # the cartridge owns the BOS slot
            ids = ids[1:]
        return prefix + ids


# --- responses --------------------------------------------------------------------------------
def completion_to_chat(resp: dict) -> dict:
    """Rewrite an upstream /v1/completions response as a chat.completion."""
    return {
        "id": "chatcmpl-" + str(resp.get("id", uuid.uuid4().hex)).removeprefix("cmpl-"),
        "object": "chat.completion",
        "created": resp.get("created", int(time.time())),
        "model": resp.get("model"),
        "choices": [
            {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
             "finish_reason": c.get("finish_reason"), "logprobs": c.get("logprobs")}
            for c in resp.get("choices", [])
        ],
        "usage": resp.get("usage"),
    }


def completion_chunk_to_chat(chunk: dict, first: bool) -> dict:
    return {
        "id": "chatcmpl-" + str(chunk.get("id", "")).removeprefix("cmpl-"),
        "object": "chat.completion.chunk",
        "created": chunk.get("created", int(time.time())),
        "model": chunk.get("model"),
        "choices": [
            {"index": c.get("index", 0),
             "delta": ({"role": "assistant"} if first else {}) | {"content": c.get("text", "")},
             "finish_reason": c.get("finish_reason")}
            for c in chunk.get("choices", [])
        ],
    }


# --- the app ----------------------------------------------------------------------------------
# Published request schemas (the handlers validate by hand, with messages; these document the
# API and let schemathesis fuzz it). Other OpenAI/vLLM sampling fields pass through.
_CARTRIDGES_SCHEMA = {
    "type": "array",
    "items": {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
        "id": {"type": "string", "minLength": 1},
        "source": {"type": "string", "enum": ["s3", "local"]},
        "force_redownload": {"type": "boolean"}}},
}
_COMMON = {"model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
           "temperature": {"type": "number", "minimum": 0}, "stream": {"type": "boolean"},
           "cartridges": _CARTRIDGES_SCHEMA}


def _body(required: str, prompt_schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": [required],
        "properties": {required: prompt_schema, **_COMMON}}}}}}


_COMPLETIONS_BODY = _body("prompt", {"oneOf": [{"type": "string"},
                                               {"type": "array", "items": {"type": "integer", "minimum": 0}}]})
_CHAT_BODY = _body("messages", {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}})

_CHAT_ONLY = {"messages", "tools", "tool_choice", "response_format", "parallel_tool_calls", "top_logprobs"}


def create_app(settings: GatewaySettings):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    registry = Registry(settings.registry)
    resolver = Resolver(settings, registry)
    prompts = PromptBuilder(settings.tokenizer)
    client = httpx.AsyncClient(base_url=settings.upstream, timeout=settings.upstream_timeout)
    shown_upstream = _without_credentials(settings.upstream)  # what error messages may name
    app = FastAPI(title="lmcache_cartridge gateway")

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                       else "upstream_error", "code": status}}, status_code=status)

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise RequestError(413, f"request body over {settings.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise RequestError(413, f"request body over {settings.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    async def handle(request: Request, chat: bool):
        try:
            body = await read_body(request)
            refs = parse_refs(body.pop("cartridges", None), settings)
            resolved = [await asyncio.to_thread(resolver.resolve, r) for r in refs]
            manifests = [m for _, m in resolved]
            prefix = chain_prefix(manifests)
            if resolved:
                await asyncio.to_thread(
                    wait_served, settings.cache_dir / "stats", settings.registry,
                    [Wanted(e.id, e.content_hash, e.epoch, e.kind) for e, _ in resolved], settings.serve_timeout)
            if chat:
                ids = prompts.chat_ids(body.get("messages"), prefix)
            else:
                if "prompt" not in body:
                    raise RequestError(400, "'prompt' is required")
                ids = prompts.completion_ids(body["prompt"], prefix)
            if body.get("model") not in (None, settings.model):
                raise RequestError(404, f"model {body.get('model')!r} is not served here ({settings.model!r} is)")
            upstream = {k: v for k, v in body.items() if k not in _CHAT_ONLY and k != "prompt"}
            upstream.update(model=settings.model, prompt=ids)
            if chat:  # chat's logprobs: bool + top_logprobs: int -> completions' logprobs: int
                if body.get("logprobs") is True:
                    top = body.get("top_logprobs") or 1
                    if not isinstance(top, int) or isinstance(top, bool):
                        raise RequestError(400, "'top_logprobs' must be an integer")
                    upstream["logprobs"] = max(1, top)
                else:
                    upstream.pop("logprobs", None)
            if any(m.kind == "trained" for m in manifests):
                # If a trained cartridge's chunk ever fails to load, vLLM recomputes its
                # placeholder tokens: that KV must never be stored where LMCache would serve it.
                params = upstream.get("kv_transfer_params")
                if params is not None and not isinstance(params, dict):
                    raise RequestError(400, "'kv_transfer_params' must be an object")
                upstream["kv_transfer_params"] = {**(params or {}), "lmcache.skip_save": True}
        except RequestError as e:
            return error(e.status, str(e))
        except NotServed as e:
            resp = error(e.status, str(e))
            if e.retry_after is not None:
                resp.headers["Retry-After"] = str(max(1, round(e.retry_after)))
            return resp
        except CartridgeError as e:
            return error(400, str(e))
        stream = bool(upstream.get("stream"))
        try:
            if not stream:
                r = await client.post("/v1/completions", json=upstream)
                try:
                    data = r.json()
                except ValueError:
                    return error(502, f"upstream answered HTTP {r.status_code} with a non-JSON body: {r.text[:200]!r}")
                if r.status_code != 200:
                    return JSONResponse(data, status_code=r.status_code)
                return JSONResponse(completion_to_chat(data) if chat else data)
            req = client.build_request("POST", "/v1/completions", json=upstream)
            r = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return error(502, f"upstream {shown_upstream} unreachable: {type(e).__name__}")
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            try:
                return JSONResponse(json.loads(content or b"{}"), status_code=r.status_code)
            except ValueError:
                return error(502, f"upstream answered HTTP {r.status_code} with a non-JSON body: {content[:200]!r}")

        async def relay():
            first = True
            try:
                async for line in r.aiter_lines():
                    if not chat or not line.startswith("data: ") or line == "data: [DONE]":
                        yield line + "\n"
                        continue
                    try:
                        chunk = json.loads(line[6:])
                    except ValueError:  # not an event we can translate: pass it on as is
                        yield line + "\n"
                        continue
                    yield "data: " + json.dumps(completion_chunk_to_chat(chunk, first)) + "\n"
                    first = False
            finally:
                await r.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions", openapi_extra=_COMPLETIONS_BODY)
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_CHAT_BODY)
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        try:
            r = await client.get("/v1/models")
            return JSONResponse(r.json(), status_code=r.status_code)
        except (httpx.HTTPError, ValueError) as e:
            return error(502, f"upstream {shown_upstream}: {type(e).__name__}")

    @app.get("/health")
    async def health():
        try:
            r = await client.get("/health")
            return JSONResponse({"gateway": "ok", "upstream": r.status_code}, status_code=200 if r.status_code == 200 else 503)
        except httpx.HTTPError as e:
            return JSONResponse({"gateway": "ok", "upstream": type(e).__name__}, status_code=503)

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()
        registry.close()

    return app
