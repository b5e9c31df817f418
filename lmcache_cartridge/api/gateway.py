"""OpenAI-compatible gateway that adds the `cartridges` request field in front of a vLLM server.

Why a gateway: vLLM fixes a request's tokens before any connector sees it, so the cartridge's
token ids must be placed first by whoever builds the prompt. The gateway resolves each cartridge
(`api.resolver`: registry id or label, local path, S3 object or prefix; fetched, converted and
registered once so the plugin serves it), places them in order (`Resolver.plan`), builds the
prompt after them (`api.prompts`), sends the plan's priming requests where tokens vLLM computes
precede a trained cartridge, forwards a token-id prompt to the upstream `/v1/completions`, and
answers with ordinary OpenAI responses (chat ones rebuilt from the completion, streaming
included). Request bodies are the pydantic models of `api.requests`.

Runs as its own process (`lmcache-cartridge gateway`), or inside vLLM's API server
(`api.middleware`, `vllm serve --middleware`). It owns a registry connection, a resolution cache
and a tokenizer; the vLLM server and its plugins are reached only over HTTP and the shared
registry.

What runs where, by who calls it (all in the gateway's process, on its event loop unless said):

    create_app(settings)          `api.launch`, `api.middleware`, tests: builds one `Gateway`, the
                                  FastAPI app whose routes (`_routes`) only call into it, and the
                                  ASGI middleware `ApiKeys` (runs first) and `BodyLimit`
    Gateway(settings)             create_app: opens the registry, the resolver, the cartridge
                                  threads, the tokenizer, the upstream client; builds the catalog
                                  sync (`lmcache.catalog_sync.catalog_sync`), not started
    Gateway.lifespan(app)         the ASGI server (uvicorn, a TestClient, the middleware's lifespan
                                  runner), at start and stop: runs the catalog sync's thread;
                                  closes the client, the threads and the registry
    Gateway.handle(body, chat)    the POST /v1/completions and /v1/chat/completions routes: the
                                  three phases below in order, each failure answered once
    Gateway.prepare(...)          handle: resolves and plans the cartridges and waits until they
                                  are served, on the cartridge threads (`CARTRIDGE_THREADS`:
                                  blocking file, S3 and registry work); builds the token ids and
                                  the upstream body (`completion_body`)
    Gateway.prime(plan, route)    handle, when the plan has primes: the priming requests upstream
    Gateway.relay(upstream)       handle: the request upstream; its answer, or its stream as it
                                  arrives (`relay_events`, chat chunks rebuilt)
    Gateway.refused(error)        handle: what prepare raised as an HTTP answer, by the one
                                  table `api.resolver.REFUSALS` (NotServed with its own status)
    Gateway.error(...)            every phase and route: the OpenAI error body (`api.asgi`),
                                  labelled for /metrics
    Gateway.models(), .cartridges(...)   GET /v1/models (the upstream's), GET /v1/cartridges
                                  (`cartridge_list`, read on the default thread pool)
"""

import asyncio
import functools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from lmcache_cartridge.api.asgi import BodyTooLarge, error_response, read_body, replay
from lmcache_cartridge.api.metrics import STATUS_REASON, GatewayMetrics
from lmcache_cartridge.api.prompts import PromptBuilder
from lmcache_cartridge.api.requests import ChatRequest, CompletionRequest, describe
from lmcache_cartridge.api.resolver import Plan, Resolver, refusal
from lmcache_cartridge.api.routing import SESSION_HEADER, route_id, session_key
from lmcache_cartridge.api.settings import GatewaySettings, RequestError
from lmcache_cartridge.cartridge.keys import SALT_TAG
from lmcache_cartridge.cartridge.manifest import MAX_ID_LENGTH
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.lmcache.serving import NotServed, Wanted, wait_served
from lmcache_cartridge.paths import private_dir
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.vllm.composites import COMPOSE_PARAM
from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM, TRAINED_TOKENS_PARAM

__all__ = ["GatewaySettings", "RequestError", "create_app"]

logger = logging.getLogger("lmcache_cartridge.api.gateway")


def _without_credentials(url: str) -> str:
    """`url` with any `user:password@` removed, for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=host))


# --- responses --------------------------------------------------------------------------------
# A chat request with cartridges is answered by vLLM's /v1/completions and rebuilt here in the
# shape vLLM's own /v1/chat/completions gives (vllm/entrypoints/openai/chat_completion/protocol.py):
# every field of the completion is carried over but the completion's own (its text and logprobs,
# rebuilt; the prompt's ids and logprobs, which chat puts at the top level).
_COMPLETION_CHOICE_ONLY = ("index", "text", "logprobs", "finish_reason", "prompt_logprobs", "prompt_token_ids")
_CHAT_TOP_FROM_CHOICE = ("prompt_logprobs", "prompt_token_ids")
# vLLM's chat message: `tool_calls` is left out when empty (never filled here: tools are refused)
_MESSAGE = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(lp: dict | None, top: int | None) -> dict | None:
    """Completions' logprobs (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}) as
    chat's (`content`: per token its logprob, bytes and its `top` alternatives). Both endpoints
    list a step's alternatives in vLLM's order (the sampled token first, then by rank), the
    completion `top` + 1 of them and chat the first `top` (all of them for -1)."""
    if not lp:
        return None
    content = []
    tops = lp.get("top_logprobs") or []
    for i, (token, logprob) in enumerate(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [])):
        alternatives = list((tops[i] if i < len(tops) and tops[i] else {}).items())
        if top is not None and top >= 0:
            alternatives = alternatives[:top]
        content.append({"token": token, "logprob": -9999.0 if logprob is None else logprob,
                        "bytes": _token_bytes(token),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": _token_bytes(t)}
                                         for t, v in alternatives]})
    return {"content": content}


def _chat_fields(resp: dict, kind: str) -> dict:
    """The top-level fields of a chat answer or chunk built from completion `resp`: its id as
    chat's, `kind`, and every other field of the completion's carried over (usage,
    system_fingerprint, kv_transfer_params, ...); the prompt's ids and logprobs from its first
    choice, where chat puts them."""
    out = {"id": "chatcmpl-" + str(resp.get("id") or uuid.uuid4().hex).removeprefix("cmpl-"), "object": kind,
           "created": resp.get("created", int(time.time())), "model": resp.get("model"), "choices": []}
    out.update((k, v) for k, v in resp.items() if k not in out)
    first = (resp.get("choices") or [{}])[0]
    out.update((k, first[k]) for k in _CHAT_TOP_FROM_CHOICE if k in first)
    return out


def _choice_extras(c: dict) -> dict:
    """A completion choice's fields beyond the ones rebuilt (stop_reason, token_ids, ...)."""
    return {k: v for k, v in c.items() if k not in _COMPLETION_CHOICE_ONLY}


def completion_to_chat(resp: dict, top_logprobs: int | None = None) -> dict:
    """Rewrite an upstream /v1/completions response as a chat.completion (`top_logprobs`: the
    chat request's, for its logprobs)."""
    out = _chat_fields(resp, "chat.completion")
    out.setdefault("prompt_text", None)  # chat's own: the rendered prompt, sent only when asked for
    out["choices"] = [
        {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", ""), **_MESSAGE},
         "logprobs": chat_logprobs(c.get("logprobs"), top_logprobs), "finish_reason": c.get("finish_reason"),
         **_choice_extras(c)}
        for c in resp.get("choices") or []]
    return out


def completion_chunk_to_chat(chunk: dict, seen: set[int], top_logprobs: int | None = None) -> dict:
    """Rewrite an upstream completion stream chunk as a chat.completion.chunk. `seen`: the choice
    indices already sent (a choice's first delta carries the assistant role); chunks without
    choices (the usage chunk of `stream_options.include_usage`) keep their fields."""
    out = _chat_fields(chunk, "chat.completion.chunk")
    out.setdefault("prompt_text", None)  # as vLLM's chat chunks carry it (the rendered prompt, when asked for)
    for c in chunk.get("choices") or []:
        index = c.get("index", 0)
        delta = ({} if index in seen else {"role": "assistant"}) | {"content": c.get("text", "")}
        seen.add(index)
        out["choices"].append({"index": index, "delta": delta,
                               "logprobs": chat_logprobs(c.get("logprobs"), top_logprobs),
                               "finish_reason": c.get("finish_reason"), **_choice_extras(c)})
    return out


# `GET /v1/cartridges` pages: the items one answers when the request sets no `limit`, and the
# most a `limit` may ask for (an answer's size never grows with the registry).
LIST_LIMIT = 100
LIST_LIMIT_MAX = 1000


def cartridge_list(entries, models: tuple[str, ...], tenant=None, limit: int = LIST_LIMIT) -> dict:
    """`GET /v1/cartridges`: a page of the registered cartridges `tenant` may name (None: an
    operator's key, or no keys at all: every registered id) that this server serves, as an
    OpenAI list. `entries`: the registry's, in id order from the page's cursor on (read only as
    far as the page needs); `models`: the names of the served weights, the first the one
    requests use. Only what a request may use to name and size one: never its path or source
    URI, never the model name its manifest was made under (often the operator's model
    directory), never an entry outside the tenant's ids."""
    page = []
    for e in entries:
        if e.model in models and (tenant is None or tenant.may_name(e.id)):
            page.append(e)
            if len(page) > limit:
                break
    more, page = len(page) > limit, page[:limit]
    return {"object": "list", "data": [
        {"id": e.id, "object": "cartridge", "labels": list(e.labels), "model": models[0], "tokens": e.num_tokens,
         "kind": e.kind} for e in page],
        "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None, "has_more": more}


# --- the app ----------------------------------------------------------------------------------
# Threads for a request's cartridge work (resolving, planning, waiting until served): their own
# pool, so that however many clients keep it busy (large files, slow S3, engines not serving
# yet), the rest of the gateway (`GET /v1/cartridges`, requests without cartridges) keeps the
# event loop's default pool; beyond it, cartridge requests wait their turn.
CARTRIDGE_THREADS = 8
# Keep-alive on both sides of the gateway. A server closes an idle connection after its keep-alive
# (vLLM's and uvicorn's: 5 s), and a client that reuses it at that moment gets a connection closed
# without an answer: the gateway's 502 for a request vLLM never saw. So the gateway drops its idle
# upstream connections well before vLLM does, and as a server keeps its clients' connections longer
# than their pools do (httpx: 5 s), as a load balancer does (nginx: 75 s).
UPSTREAM_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 75

# chat's own fields, translated for /v1/completions
_CHAT_ONLY = {"messages", "top_logprobs", "max_completion_tokens"}
# Chat fields that need vLLM's chat endpoint itself (its tool-call parser turns the output into
# `tool_calls`): a chat request without cartridges goes there whole; with cartridges (sent as
# token ids to /v1/completions) they are refused, never dropped.
_CHAT_ENDPOINT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
# Chat fields whose meaning /v1/completions does not share (there `echo` repeats the whole
# prompt, cartridges included): refused with cartridges when set.
_CHAT_MEANING_ONLY = ("echo",)


@dataclass
class Upstream:
    """A request as the gateway sends it on: `body` to `path` with the router's session header
    (`route`). `plan`: its cartridges' (None: a request without any, passed whole). `translate`:
    a chat request sent to /v1/completions, whose answers are rebuilt in chat's shape
    (`top_logprobs`: the chat request's, for its logprobs)."""

    body: dict
    path: str
    route: dict
    plan: Plan | None = None
    translate: bool = False
    top_logprobs: int | None = None


def whole_body(body: CompletionRequest | ChatRequest, model: str) -> dict:
    """A request without cartridges as vLLM's own endpoint takes it: as sent, minus the
    `cartridges` field, under the upstream's model name."""
    upstream = {k: v for k, v in body.model_dump(exclude_unset=True).items() if k != "cartridges"}
    upstream["model"] = model
    return upstream


def prompt_text(body: CompletionRequest | ChatRequest, chat: bool):
    """The prompt of a request with cartridges, as text to tokenize after them: chat's messages
    or the completion's one prompt. 400 for what a token-id prompt on /v1/completions cannot
    carry (tool calls are parsed only on vLLM's chat endpoint; content parts other than text)."""
    try:
        if chat:
            needs = [k for k in _CHAT_ENDPOINT_ONLY if k in body.model_fields_set or k in (body.model_extra or {})]
            needs += [k for k in _CHAT_MEANING_ONLY if (body.model_extra or {}).get(k)]
            if needs:
                raise ValueError(repr(needs[0]))
            return [m.as_text() for m in body.messages]
        return body.one_prompt()
    except ValueError as e:
        raise RequestError(400, f"{e} cannot be combined with cartridges: a request with cartridges "
                                "reaches vLLM as token ids of text on /v1/completions, where tool calls "
                                "are not parsed and only text is rendered (send it without cartridges)") from None


def completion_body(body: CompletionRequest | ChatRequest, chat: bool, plan: Plan, ids: list[int], model: str,
                    chunk_size: int = 0) -> dict:
    """The /v1/completions body for a request with cartridges: the client's fields (chat's
    translated), the token-id prompt `ids`, and the kv_transfer_params the plan needs. With the
    engine's LMCache `chunk_size`: the cartridge tokens LMCache can serve (whole chunks), which
    the instance briefly waits for while another request's load of them is in flight
    (`vllm.readiness`)."""
    upstream = {k: v for k, v in body.model_dump(exclude_unset=True).items()
                if k not in _CHAT_ONLY and k not in ("prompt", "cartridges")}
    tags = [k for k in (body.kv_transfer_params or {}) if k.startswith("lmcache.tag.")]
    if tags and plan.wanted:
        raise RequestError(400, f"kv_transfer_params {tags[0]!r} cannot go with cartridges whose KV is "
                                "loaded: LMCache keys a request's chunks by its tags, and a cartridge's "
                                "chunks carry none of the client's")
    if plan.salt:
        # KV a client brought: keyed under its salt in LMCache (in-process the plugin keys it by
        # this tag; in MP mode the server's keys carry `cache_salt`, which the adapter matches by
        # the salt before any ":") and in vLLM's prefix cache (`cache_salt`), so only requests
        # naming it ever use it
        upstream["kv_transfer_params"] = {**(body.kv_transfer_params or {}), SALT_TAG: plan.salt}
        upstream["cache_salt"] = plan.salt if "cache_salt" not in upstream \
            else f"{plan.salt}:{upstream['cache_salt']}"[:128]
    elif plan.wanted and upstream.get("cache_salt"):
        # the client's own cache_salt on the operator's cartridges: after an empty cartridge salt.
        # vLLM's prefix cache keeps the request apart as before; in MP mode, whose keys carry
        # cache_salt, the server's adapter serves the operator's chunks to it
        # (`lmcache.mp_adapter.salt_of`), as in-process, and a client's salt is never named by it
        upstream["cache_salt"] = f":{upstream['cache_salt']}"[:128]
    upstream.update(model=model, prompt=ids)
    if chat:  # chat's logprobs: bool + top_logprobs: int -> completions' logprobs: int
        if body.logprobs:
            upstream["logprobs"] = body.top_logprobs or 0
        else:
            upstream.pop("logprobs", None)
        if body.max_completion_tokens is not None:  # chat's name for it, over the deprecated one
            upstream["max_tokens"] = body.max_completion_tokens
    if plan.trained:
        assert not plan.salt  # a client's KV is never loaded beside trained KV (Resolver._tail)
        # Placeholder tokens' KV must never be stored where LMCache would serve it, and a
        # failed load of the cartridge must fail the request, never recompute them
        # (vllm.load_failure): vLLM answers 500, mapped to a retryable 503 by the gateway. The
        # instance schedules it only once its first TRAINED_TOKENS_PARAM tokens can be
        # loaded there (vllm.readiness: waits, bounded, else fails), whichever instance.
        # `lmcache.skip_save` is the in-process mode's, `lmcache.max_offload_tokens` the MP mode's.
        upstream["kv_transfer_params"] = {**(body.kv_transfer_params or {}), "lmcache.skip_save": True,
                                          "lmcache.max_offload_tokens": 0, NO_RECOMPUTE_PARAM: True,
                                          TRAINED_TOKENS_PARAM: plan.kv_end, COMPOSE_PARAM: plan.recipes()}
    whole = len(plan.prefix) // chunk_size * chunk_size if chunk_size > 0 else 0
    if whole:
        upstream["kv_transfer_params"] = {**(upstream.get("kv_transfer_params") or {}), CARTRIDGE_TOKENS_PARAM: whole}
    return upstream


async def relay_events(r, translate: bool, top_logprobs: int | None = None):
    """The upstream's event stream `r` line by line as it arrives; completion chunks rebuilt as
    chat ones where `translate`. Closes `r` at the end (or when the client goes)."""
    seen: set[int] = set()
    try:
        async for line in r.aiter_lines():
            if not translate or not line.startswith("data: ") or line == "data: [DONE]":
                yield line + "\n"
                continue
            try:
                chunk = json.loads(line[6:])
            except ValueError:  # not an event we can translate: pass it on as is
                yield line + "\n"
                continue
            yield "data: " + json.dumps(completion_chunk_to_chat(chunk, seen, top_logprobs)) + "\n"
    finally:
        await r.aclose()


class ApiKeys:
    """ASGI middleware: a request to /v1/* without `Authorization: Bearer <key>` naming one of
    `keys` is answered 401 before its body is read (vLLM's `--api-key` rule: /health and the
    docs stay open). Keys are compared in constant time."""

    def __init__(self, app, settings: GatewaySettings) -> None:
        self.app, self.settings = app, settings
        self.keys = tuple(k.encode() for k in settings.all_keys())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or not scope.get("path", "").startswith("/v1"):
            return await self.app(scope, receive, send)
        import hmac

        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        if scheme.lower() == b"bearer" and any(hmac.compare_digest(token, k) for k in self.keys):
            # the tenant whose scope the request gets (None: an operator key), for `handle`
            scope.setdefault("state", {})["tenant"] = self.settings.tenant_of(token.decode(errors="replace"))
            return await self.app(scope, receive, send)
        resp = error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                              headers={"WWW-Authenticate": "Bearer"})
        return await resp(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before anyone parses it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        try:
            if declared.isdigit() and int(declared) > self.limit:
                raise BodyTooLarge()
            body = await read_body(receive, self.limit)
        except BodyTooLarge:
            return await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
        if body is None:
            return  # the client is gone
        return await self.app(scope, replay(body, receive), send)


class Gateway:
    """One gateway's resources and the phases of a request with cartridges (`handle`: `prepare`,
    `prime`, `relay`); the routes of `create_app` only call into it. Who calls what is in this
    module's docstring."""

    def __init__(self, settings: GatewaySettings, *, transport=None) -> None:
        import httpx

        self.settings = settings
        private_dir(settings.cache_dir)  # downloads and conversions land here and are served from it
        self.catalog_sync = self._catalog_sync()  # first: a bad catalog setting fails before the rest opens
        self.registry = Registry(settings.registry)
        self.resolver = Resolver(settings, self.registry)
        self.work = ThreadPoolExecutor(CARTRIDGE_THREADS, thread_name_prefix="cartridge-work")
        self.prompts = PromptBuilder(settings.tokenizer, settings.trained_chat_template)
        self.client = httpx.AsyncClient(base_url=settings.upstream, timeout=settings.upstream_timeout,
                                        transport=transport, limits=httpx.Limits(keepalive_expiry=UPSTREAM_KEEPALIVE_S),
                                        headers={"Authorization": f"Bearer {settings.upstream_api_key}"}
                                        if settings.upstream_api_key else None)
        self.shown_upstream = _without_credentials(settings.upstream)  # what error messages may name
        self.metrics = GatewayMetrics()
        self.primes = 0  # priming requests sent (Resolver.plan's `primes`)
        self._max_model_len = settings.max_model_len
        self.models_served = (settings.model, *settings.accept_models)  # names of the same weights

    def _catalog_sync(self):
        """The catalog's sync (`lmcache.catalog_sync`, as the plugin's), not started: the app's
        lifespan runs it. None without a `catalog_uri`; a setting that would spin raises ValueError."""
        from lmcache_cartridge.lmcache.catalog_sync import catalog_sync

        return catalog_sync(self.settings, self.settings.chunk_size)

    @asynccontextmanager
    async def lifespan(self, _app):
        """Started with the app, not at import: a TestClient, uvicorn or the middleware's own
        lifespan runner owns the catalog sync, the upstream client and the worker threads."""
        if self.catalog_sync is not None:
            self.catalog_sync.start()
        try:
            yield
        finally:
            if self.catalog_sync is not None:
                self.catalog_sync.stop()
            await self.client.aclose()
            self.work.shutdown(wait=False, cancel_futures=True)
            self.registry.close()

    # --- answers ---------------------------------------------------------------------------------
    @staticmethod
    def error(status: int, message: str, reason: str | None = None, retry_after: float | None = None):
        """An OpenAI-shaped error; `reason` (metrics.REASONS) labels it on /metrics (default: by status);
        `retry_after` seconds are sent as Retry-After."""
        resp = error_response(status, message)
        resp.reason = reason or STATUS_REASON.get(status, "upstream" if status == 502 else None)
        if retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, round(retry_after)))
        return resp

    def refused(self, e: Exception):
        """What `prepare` raised, answered: NotServed with its own status; the rest by the
        resolver's one table (`api.resolver.REFUSALS`)."""
        if isinstance(e, NotServed):
            return self.error(e.status, str(e), "not_served", retry_after=e.retry_after)
        e = refusal(e)
        return self.error(e.status, str(e), retry_after=e.retry_after)

    def unreachable(self, e: Exception):
        return self.error(502, f"upstream {self.shown_upstream} unreachable: {type(e).__name__}")

    @staticmethod
    def upstream_answer(data, status: int):
        """The upstream's own answer passed on (a non-200 is the upstream's error, labelled so)."""
        from fastapi.responses import JSONResponse

        resp = JSONResponse(data, status_code=status)
        resp.reason = "upstream" if status != 200 else None
        return resp

    def trained_failed(self, data):
        """vLLM failed a request with trained cartridges (HTTP 500): the engine fails such a request
        when a cartridge chunk could not be loaded after its lookup, instead of recomputing its
        placeholder tokens. Nothing wrong was answered and the engine is alive: retryable."""
        upstream_msg = str((data.get("error") or {}).get("message", "")) if isinstance(data, dict) else ""
        return self.error(503, "the engine could not load this request's trained cartridge KV (answering from "
                               "its placeholder tokens would be wrong, so nothing was generated); retry the request"
                               + (f" (upstream: {upstream_msg[:200]})" if upstream_msg else ""),
                          "trained_load_failed", retry_after=1)

    # --- a request -------------------------------------------------------------------------------
    async def handle(self, body: CompletionRequest | ChatRequest, chat: bool, tenant=None):
        """Answer a completion or chat request: `prepare` it, `prime` what its plan needs, `relay` it."""
        try:
            up = await self.prepare(body, chat, tenant)
        except (RequestError, NotServed, CartridgeError) as e:
            return self.refused(e)
        if up.plan is not None and up.plan.primes:
            failed = await self.prime(up.plan, up.route)
            if failed is not None:
                return failed
        return await self.relay(up)

    async def prepare(self, body: CompletionRequest | ChatRequest, chat: bool, tenant) -> Upstream:
        """Validate, resolve and plan the request's cartridges (waiting until the engine serves
        the ones whose KV it loads), and rewrite it for the upstream. Raises RequestError,
        NotServed or CartridgeError for what is answered instead."""
        settings = self.settings
        specs = body.cartridges or []
        if len(specs) > settings.max_cartridges:
            raise RequestError(400, f"too many cartridges: {len(specs)} (at most {settings.max_cartridges})")
        if body.model not in (None, *self.models_served):
            raise RequestError(404, f"model {body.model!r} is not served here ({settings.model!r} is)")
        if not specs:  # nothing to put first: vLLM's own endpoint takes the request as it is
            return Upstream(whole_body(body, settings.model), "/v1/chat/completions" if chat else "/v1/completions",
                            {SESSION_HEADER: session_key([])})
        resolved = [await self._cartridge_work(self.resolver.resolve, s, tenant) for s in specs]
        plan = await self._cartridge_work(self.resolver.plan, resolved)
        serving = await self._served(plan)
        ids = await self._prompt_ids(body, chat, plan)
        route = {SESSION_HEADER: session_key([route_id(r.entry.id if r.entry else None, r.token_ids)
                                              for r in resolved if r.entry is not None or r.token_ids])}
        # The cartridge-token count only where an `lmcache server` serves the engines (MP mode),
        # whose concurrent first hits race (`vllm.readiness`); in-process lookups do not, and
        # vllm-router's kv_aware policy stops routing a request by KV once it carries
        # kv_transfer_params (tests/test_fleet.py).
        mp = any(st.role == "mp-server" for st in serving)
        return Upstream(completion_body(body, chat, plan, ids, settings.model, settings.chunk_size if mp else 0),
                        "/v1/completions", route, plan, translate=chat,
                        top_logprobs=(body.top_logprobs or 0) if chat else None)

    async def _cartridge_work(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the cartridge threads (`CARTRIDGE_THREADS`)."""
        return await asyncio.get_running_loop().run_in_executor(self.work, functools.partial(fn, *args, **kwargs))

    async def _served(self, plan: Plan) -> list:
        """The serving records of the instances that serve the plan's wanted cartridges, once they
        all do (NotServed when they do not in time); none when it wants none."""
        if not plan.wanted:
            return []
        settings = self.settings
        with self.metrics.timed(self.metrics.ready_wait):
            return await self._cartridge_work(
                wait_served, settings.cache_dir, settings.registry,
                [Wanted(e.id, e.content_hash, e.epoch, e.kind) for e in plan.wanted], settings.serve_timeout,
                models=self.models_served)  # another model's instances never serve it

    async def _prompt_ids(self, body: CompletionRequest | ChatRequest, chat: bool, plan: Plan) -> list[int]:
        """The token ids sent: the plan's prefix, then the prompt; 400 when they and the tokens
        asked for exceed the model's context."""
        text = prompt_text(body, chat)
        ids = self.prompts.chat_ids(text, plan.prefix, after_trained=plan.trained) if chat \
            else self.prompts.completion_ids(text, plan.prefix)
        limit = await self.max_model_len()
        wanted = (body.max_completion_tokens if chat else None) or body.max_tokens or 0
        if limit is not None and len(ids) + wanted > limit:
            raise RequestError(400, f"cartridges ({len(plan.prefix)} tokens) + prompt ({len(ids) - len(plan.prefix)} "
                                    f"tokens) + max_tokens ({wanted}) = {len(ids) + wanted} tokens, over the "
                                    f"model's max_model_len of {limit}")
        return ids

    async def max_model_len(self) -> int | None:
        """The upstream's context length, asked once (vLLM's /v1/models carries it)."""
        import httpx

        if self._max_model_len is None:
            try:
                r = await self.client.get("/v1/models")
                self._max_model_len = int(r.json()["data"][0]["max_model_len"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                return None
        return self._max_model_len

    async def prime(self, plan: Plan, route: dict):
        """Send `plan.primes` in order, before the request itself: each asks vLLM for one token
        after the tokens just before a trained run, so vLLM computes them and LMCache stores their
        chunks, which the run's chunk keys are chained after (`api.resolver`). Sent to the same
        instance as the request (the router's session key); trained KV in a prime is loaded under
        the instance's readiness rule like any trained request's. None: all primed; else the error
        to answer (nothing is generated for the request without its whole head)."""
        import httpx

        for p in plan.primes:
            body = {"model": self.settings.model, "prompt": plan.prefix[:p.length], "max_tokens": 1, "temperature": 0}
            if p.need:
                body["kv_transfer_params"] = {NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: p.need,
                                              COMPOSE_PARAM: plan.recipes(p.length)}
            try:
                r = await self.client.post("/v1/completions", json=body, headers=route)
            except httpx.HTTPError as e:
                return self.unreachable(e)
            self.primes += 1
            if r.status_code == 200:
                continue
            if r.status_code == 500 and p.need:
                try:
                    data = r.json()
                except ValueError:
                    data = None
                return self.trained_failed(data)
            return self.error(502, f"upstream answered HTTP {r.status_code} to the priming request for the "
                                   f"{p.length} tokens before a trained cartridge: {r.text[:200]!r}")
        return None

    async def relay(self, up: Upstream):
        """Send the prepared request upstream and answer with what comes back: JSON, or the
        stream as it arrives (completions' answers in chat's shape where the client asked chat)."""
        import httpx
        from fastapi.responses import StreamingResponse

        try:
            if not up.body.get("stream"):
                with self.metrics.timed(self.metrics.upstream, up.path):
                    r = await self.client.post(up.path, json=up.body, headers=up.route)
                return self._answer(up, r)
            req = self.client.build_request("POST", up.path, json=up.body, headers=up.route)
            with self.metrics.timed(self.metrics.upstream, up.path):
                r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            return self.unreachable(e)
        if r.status_code != 200:
            return await self._stream_refused(r)
        return StreamingResponse(relay_events(r, up.translate, up.top_logprobs), media_type="text/event-stream")

    def _answer(self, up: Upstream, r):
        """The upstream's JSON answer `r` to `up` as the client gets it: a 200 (in chat's shape
        where `up.translate`), a failed trained load as a retryable 503, any other status passed
        on, a body that is not JSON as a 502."""
        from fastapi.responses import JSONResponse

        try:
            data = r.json()
        except ValueError:
            return self.error(502, f"upstream answered HTTP {r.status_code} with a non-JSON body: {r.text[:200]!r}")
        if r.status_code == 500 and up.plan is not None and up.plan.trained:
            return self.trained_failed(data)
        if r.status_code != 200:
            return self.upstream_answer(data, r.status_code)
        return JSONResponse(completion_to_chat(data, up.top_logprobs) if up.translate else data)

    async def _stream_refused(self, r):
        """A stream the upstream refused (its status not 200, its body read whole): its answer
        passed on, a body that is not JSON as a 502."""
        content = await r.aread()
        await r.aclose()
        try:
            return self.upstream_answer(json.loads(content or b"{}"), r.status_code)
        except ValueError:
            return self.error(502, f"upstream answered HTTP {r.status_code} with a non-JSON body: {content[:200]!r}")

    # --- the other routes ------------------------------------------------------------------------
    async def models(self):
        """`GET /v1/models`: the upstream's, passed on."""
        import httpx
        from fastapi.responses import JSONResponse

        try:
            r = await self.client.get("/v1/models")
            return JSONResponse(r.json(), status_code=r.status_code)
        except (httpx.HTTPError, ValueError) as e:
            return self.error(502, f"upstream {self.shown_upstream}: {type(e).__name__}")

    async def cartridges(self, tenant, limit: int, after: str | None):
        """`GET /v1/cartridges`: a page of the registered cartridges `tenant` may name (`cartridge_list`)."""
        from fastapi.responses import JSONResponse

        return JSONResponse(await asyncio.to_thread(cartridge_list, self.registry.after(after), self.models_served,
                                                    tenant, limit))


def create_app(settings: GatewaySettings, *, transport=None):
    """The gateway as an ASGI app. `transport`: the httpx transport its client reaches the upstream
    with (default: plain HTTP to `settings.upstream`; `api.middleware` passes one for a Unix socket
    or its own server's TLS)."""
    from fastapi import FastAPI

    gateway = Gateway(settings, transport=transport)
    app = FastAPI(title="lmcache_cartridge gateway", lifespan=gateway.lifespan)
    app.state.gateway = gateway
    # for operators' and tests' eyes
    app.state.resolver, app.state.registry, app.state.metrics = gateway.resolver, gateway.registry, gateway.metrics
    if gateway.catalog_sync is not None:
        app.state.catalog_sync = gateway.catalog_sync
    _routes(app, gateway)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(ApiKeys, settings=settings)  # added last: runs first, before the body is read
    return app


def _routes(app, gateway: Gateway) -> None:
    """`app`'s routes, each a call into `gateway`, and the request counting for /metrics."""
    from fastapi import Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            gateway.metrics.answered(request.url.path, response.status_code, getattr(request.state, "reason", None))
        return response

    @app.get("/metrics")
    async def _metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        request.state.reason = "invalid"
        return gateway.error(400, describe(list(exc.errors())))

    async def answer(body: CompletionRequest | ChatRequest, request: Request, chat: bool):
        """`handle` for the key's tenant (`ApiKeys`); the answer's reason kept for /metrics (`_count`)."""
        resp = await gateway.handle(body, chat=chat, tenant=getattr(request.state, "tenant", None))
        request.state.reason = getattr(resp, "reason", None)
        return resp

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await answer(body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return await gateway.models()

    @app.get("/v1/cartridges")
    async def cartridges(request: Request, limit: int = Query(LIST_LIMIT, ge=1, le=LIST_LIMIT_MAX),
                         after: str | None = Query(None, max_length=MAX_ID_LENGTH)):
        """A page of the registered cartridges the caller may name: `limit` items whose ids sort
        after `after` (the previous page's `last_id`)."""
        return await gateway.cartridges(getattr(request.state, "tenant", None), limit, after)

    @app.get("/health")
    async def health():
        """The gateway's own health, for its readiness probe: it does not ask the upstream, whose
        outage every gateway would otherwise share (all replicas unready at once, clients refused
        a connection instead of answered 502/503 per request)."""
        return JSONResponse({"gateway": "ok"})
