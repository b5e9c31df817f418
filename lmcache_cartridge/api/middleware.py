"""The gateway inside vLLM's own API server: `vllm serve ... --middleware
lmcache_cartridge.api.middleware.CartridgeMiddleware`, so one process serves vLLM and the
`cartridges` request field.

Why: vLLM ignores request fields it does not know, so a request with `cartridges` sent to vLLM
itself (bypassing a separate gateway) was answered 200 without the document. Inside vLLM's ASGI
stack nothing can bypass it:

- POST /v1/completions and /v1/chat/completions whose JSON body has a `cartridges` field are
  answered by the gateway (`api.gateway.create_app`, the one implementation: resolution, the
  readiness wait, priming, the token-id rewrite, chat translation, streaming, its API keys, body
  limit and metrics). The rewritten request (no `cartridges` field) reaches this same server
  over its own listening address (loopback, its Unix socket, or TLS), and so passes vLLM's own
  middleware, `--api-key` included. Not in-process: httpx's ASGITransport collects the whole
  response before returning it, so a stream would not stream.
- `cartridges` on any other JSON POST (/v1/responses, /invocations, ...) answers 400, never a
  silent answer without the document.
- `kv_transfer_params` a client sends on any JSON POST is held to the gateway's rule
  (`api.requests.check_client_kv_params`: only LMCache's `lmcache.skip_save` and
  `lmcache.tag.<name>`): the connector's own keys (composite recipes, the trained readiness and
  no-recompute rules), the salt tag and LMCache's `disagg_spec` (read without a guard by
  LMCache's scheduler: engine-fatal) answer 400, and so does `vllm_xargs.kv_transfer_params`
  (vLLM copies it in where the body has none: a string or list there is engine-fatal too). Only
  the gateway's own requests to this server carry those keys: its client signs them with a
  secret header (`INTERNAL_HEADER`, shared by this server's API processes through a 0600 file in
  the private cache dir, `internal_secret`), which is checked in constant time and removed
  before vLLM sees the request. A request with a wrong or missing header is a client's.
- JSON bodies are judged as vLLM parses them (`json.loads` on the bytes, which also decodes
  UTF-16 and UTF-32): JSON in any encoding but UTF-8 answers 400 (`parse_body`), so no field can
  hide from the checks above in an encoding they do not read.
- GET /v1/cartridges (the cartridges the caller's key may name) is the gateway's, its keys included.
- Everything else reaches vLLM untouched: a body read to look for the fields is replayed byte
  for byte; GET /metrics gets the gateway's series appended.
- If the gateway cannot be set up (no cartridge plugin in the LMCache config, a bad setting),
  vLLM still serves, and requests with `cartridges` and GET /v1/cartridges answer 501 (after
  vLLM's own key check, where it has one); the reason names the operator's files and tenants,
  so it goes to the server's log, never into an answer.

Settings come from where the server's plugin and the `gateway` command read them: the LMCache
config (`$LMCACHE_CONFIG_FILE`, then the `LMCACHE_*` environment over it: registry, cache dir,
S3, chunk size, accept_models, catalog), the model from vLLM's own `--served-model-name` /
`--model`, and the gateway's other options from `ENV` (the `gateway` command's flags as
environment variables). Client keys: `$LMCACHE_CARTRIDGE_API_KEYS` and tenants if set, else
vLLM's own `--api-key` (a keyed server is never opened by `cartridges`).

Runs in vLLM's API server process (one gateway per process, built when the server starts).
"""

from __future__ import annotations

import asyncio
import gzip
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lmcache_cartridge import ensure_log_handler
from lmcache_cartridge import settings_reference as ref
from lmcache_cartridge.api.asgi import error_response, read_body, replay

logger = logging.getLogger("lmcache_cartridge.api.middleware")

GATEWAY_PATHS = ("/v1/completions", "/v1/chat/completions")
LIST_PATH = "/v1/cartridges"  # GET: the cartridges the caller may name, answered by the gateway
# the paths vLLM's --api-key guards (vllm/entrypoints/serve/middleware/authenticate.py)
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")
FORMS = (b"multipart/", b"application/x-www-form-urlencoded")
# The gateway's own requests to this server carry this header with the server's secret: only they
# may set the connector's kv_transfer_params keys (`check_client_body`).
INTERNAL_HEADER = b"x-lmcache-cartridge-internal"
UNAVAILABLE_MESSAGE = ("this server cannot serve 'cartridges': its cartridge gateway is not set up "
                       "(the server's log says why)")
SECRET_NAME = "middleware.secret"  # in the cache dir (0600): shared by this host's API processes
_SECRET_BYTES = 32


def _list(value: str) -> tuple[str, ...]:
    """Comma-separated values (as $LMCACHE_CARTRIDGE_API_KEYS always was)."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _paths(value: str) -> tuple[Path, ...]:
    """Directories separated by commas or os.pathsep (PATH's way)."""
    return tuple(Path(p) for p in _list(value.replace(os.pathsep, ",")))


def _template(value: str) -> str:
    return value if value == "model" else Path(value).read_text()


def _tenants(value: str):
    from lmcache_cartridge.api.settings import load_tenants

    return load_tenants(value)


@dataclass(frozen=True)
class _Option:
    field: str   # of GatewaySettings
    flag: str    # the `gateway` command's flag it stands for
    parse: Callable[[str], Any]


# The `gateway` command's options as environment variables of the vLLM server (names, types and
# defaults: `settings_reference`; the defaults are GatewaySettings').
ENV: dict[str, _Option] = {
    ref.ALLOW_LOCAL.name: _Option("local_roots", "--allow-local", _paths),
    ref.ALLOW_S3.name: _Option("s3_roots", "--allow-s3", _list),
    ref.TENANTS.name: _Option("tenants", "--tenants", _tenants),
    ref.MAX_CARTRIDGES.name: _Option("max_cartridges", "--max-cartridges", int),
    ref.MAX_BODY_BYTES.name: _Option("max_body_bytes", "--max-body-bytes", int),
    ref.MAX_CACHE_BYTES.name: _Option("max_cache_bytes", "--max-cache-bytes", int),
    ref.SERVE_TIMEOUT.name: _Option("serve_timeout", "--serve-timeout", float),
    ref.FORCE_REDOWNLOAD_INTERVAL.name: _Option("force_redownload_interval", "--force-redownload-interval", float),
    ref.TRAINED_CHAT_TEMPLATE.name: _Option("trained_chat_template", "--trained-chat-template", _template),
    ref.TOKENIZER.name: _Option("tokenizer", "--tokenizer", str),
}
MODEL_ENV = ref.MODEL.name  # only where vLLM's own arguments cannot be read


class NotConfigured(Exception):
    """The gateway cannot run in this server: the reason, for the log (501 answers omit it)."""


def _lmcache_config():
    """The LMCache config as the server's LMCache loads it (`lmcache.settings.load_lmcache_config`)."""
    from lmcache_cartridge.errors import CartridgeError
    from lmcache_cartridge.lmcache.settings import load_lmcache_config

    try:
        return load_lmcache_config()
    except CartridgeError as e:
        raise NotConfigured(str(e)) from e


def vllm_keys(args) -> tuple[str, ...]:
    """vLLM's own client keys: `--api-key`, else $VLLM_API_KEY (vLLM's rule)."""
    keys = (getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY")]
    return tuple(k for k in keys if k)


def settings_from_environment(args, upstream: str):
    """GatewaySettings for the gateway inside the vLLM server started with `args` (its argparse
    namespace; None where it cannot be read), reaching it at `upstream`. NotConfigured says why
    not."""
    from lmcache_cartridge.api.settings import API_KEY_ENV, GatewaySettings, gateway_api_keys, plugin_fields
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings

    config = _lmcache_config()
    try:
        plugin = PluginSettings.from_config(config, CartridgeStoragePlugin)
    except Exception as e:
        raise NotConfigured(f"no cartridge plugin in the server's LMCache config: {e}") from e
    served = getattr(args, "served_model_name", None) or []
    served = [served] if isinstance(served, str) else list(served)
    vllm_model = getattr(args, "model", None)
    names = [*served, vllm_model] if vllm_model else served
    model = names[0] if names else os.environ.get(MODEL_ENV)
    if not model:
        raise NotConfigured(f"the served model name is unknown (vLLM's arguments cannot be read): set {MODEL_ENV}")
    kw: dict[str, Any] = {}
    for env, opt in ENV.items():
        if os.environ.get(env, "").strip():
            try:
                kw[opt.field] = opt.parse(os.environ[env].strip())
            except (ValueError, OSError) as e:
                raise NotConfigured(f"{env} ({opt.flag}): {e}") from e
    try:
        keys = gateway_api_keys()
    except ValueError as e:
        raise NotConfigured(f"{API_KEY_ENV}: {e}") from e
    own = vllm_keys(args)
    tokenizer = kw.pop("tokenizer", None) or getattr(args, "tokenizer", None) or vllm_model or model
    server = plugin_fields(config, plugin)
    # vLLM answers to every served name, and LMCache's keys carry --model: a cartridge made for
    # any of them is this engine's
    server["accept_models"] = tuple(dict.fromkeys(n for n in (*names[1:], *plugin.accept_models) if n != model))
    return GatewaySettings(
        upstream=upstream, model=model, tokenizer=str(tokenizer), **server,
        # the gateway's keys (or tenants) if any, else vLLM's own: never open where vLLM is keyed
        api_keys=keys if keys or kw.get("tenants") else own,
        upstream_api_key=own[0] if own else None,
        **kw,
    )


def upstream_of(args, scope: dict) -> tuple[str, Any]:
    """Where this server listens, for the gateway's client: (base URL, httpx transport or None).
    From vLLM's arguments (--uds, --host, --port, TLS), else from the request's own socket."""
    import httpx

    uds = getattr(args, "uds", None)
    if uds:
        return "http://localhost", httpx.AsyncHTTPTransport(uds=uds)
    if args is not None and getattr(args, "port", None):
        host, port = getattr(args, "host", None), args.port
        tls = bool(getattr(args, "ssl_keyfile", None))
    else:
        host, port = (scope.get("server") or ("127.0.0.1", 8000))[:2]
        tls = scope.get("scheme") == "https"
    host = {None: "127.0.0.1", "": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    # TLS to our own listening socket: its certificate names the public host, not this address
    transport = httpx.AsyncHTTPTransport(verify=False) if tls else None
    return f"{'https' if tls else 'http'}://{host}:{port}", transport


# --- ASGI helpers ------------------------------------------------------------------------------
def _route_path(scope) -> str:
    root, path = scope.get("root_path") or "", scope.get("path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _header(scope, name: bytes) -> bytes:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return b""


# The fields the middleware looks at; a UTF-8 body naming none of them (nor holding a \u escape,
# which could spell one) is never parsed.
_FIELDS = (b"cartridges", b"kv_transfer_params", b"\\u")
_UTF8 = ("utf-8", "utf-8-sig")
NOT_JSON = object()
NOT_UTF8 = object()  # JSON that vLLM's parser decodes from UTF-16 or UTF-32
NOT_UTF8_MESSAGE = ("JSON request bodies must be UTF-8 (RFC 8259); this one is UTF-16 or UTF-32: "
                    "encode it as UTF-8")


def parse_body(body: bytes) -> Any:
    """A request body's JSON, parsed once for every check here: None where none of `_FIELDS` is
    in it (nothing to look at), `NOT_JSON` where it does not parse, `NOT_UTF8` for JSON in
    UTF-16 or UTF-32.

    The decision is made on what vLLM will parse: it runs `json.loads` on the body's bytes,
    which detects UTF-16 and UTF-32 (`json.detect_encoding`), where the fields' ASCII bytes never
    appear. Such a body is parsed whole as vLLM would, and refused if it is JSON, so the byte
    search below only ever runs on UTF-8."""
    if json.detect_encoding(body) not in _UTF8:
        try:
            json.loads(body)
        except ValueError:
            return NOT_JSON  # vLLM cannot parse it either
        return NOT_UTF8
    if not any(f in body for f in _FIELDS):
        return None
    try:
        return json.loads(body)
    except ValueError:
        return NOT_JSON


def has_cartridges(body: bytes, data: Any) -> bool:
    """Whether a request body (`data`: `parse_body`'s) is a JSON object with a `cartridges` field
    (a body that is not JSON but names it counts too: the gateway answers why it is not valid)."""
    if data is NOT_JSON:
        return b"cartridges" in body
    return isinstance(data, dict) and "cartridges" in data


def check_client_body(data: Any) -> str | None:
    """Why a client's JSON request body (`data`: `parse_body`'s) may not reach vLLM (its
    `kv_transfer_params` break the gateway's rule, `api.requests.check_client_kv_params`), else
    None. Bodies that are not a JSON object are vLLM's to judge (None). Also refused:
    `vllm_xargs.kv_transfer_params`, which vLLM copies into the request's params where the body
    sets none (its values are strings, numbers or lists there: never a client's to send)."""
    if not isinstance(data, dict):
        return None
    from lmcache_cartridge.api.requests import check_client_kv_params

    # vLLM hands the connector `kv_transfer_params` from the body, and on its token-in route
    # (/inference/v1/generate) from `sampling_params.extra_args`: one rule for both
    sampling = data.get("sampling_params")
    extra = sampling.get("extra_args") if isinstance(sampling, dict) else None
    for where, holder in (("kv_transfer_params", data),
                          ("sampling_params.extra_args.kv_transfer_params", extra)):
        params = holder.get("kv_transfer_params") if isinstance(holder, dict) else None
        if params is not None and not isinstance(params, dict):
            return f"'{where}' must be an object"
        try:
            check_client_kv_params(params)
        except ValueError as e:
            return f"'{where}': {e}"
    xargs = data.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        return "'vllm_xargs' may not carry 'kv_transfer_params' (send 'kv_transfer_params' itself)"
    return None


def internal_secret(cache_dir: Path) -> bytes:
    """The secret the gateway's requests to this server carry (`INTERNAL_HEADER`): read from
    `cache_dir`/`SECRET_NAME`, made there once (0600, linked into place whole: never replaced).
    One file for every API process of the server (`--api-server-count` > 1: the gateway of one
    process may reach another's socket) and every server of this user sharing the cache dir,
    which `private_dir` keeps to this user. PermissionError for a file that is not this user's
    own private regular file."""
    import stat

    path = Path(cache_dir) / SECRET_NAME
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | nofollow)
        except FileNotFoundError:
            tmp = path.with_name(f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
            try:
                os.write(fd, secrets.token_urlsafe(_SECRET_BYTES).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic, and never over another process's secret
            except FileExistsError:  # another process's secret won: the next round reads it
                pass
            finally:
                os.unlink(tmp)
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()) \
                    or st.st_mode & 0o077:
                raise PermissionError(f"{path} must be a regular file of this user's, mode 0600")
            token = f.read(256).strip()
        if len(token) >= _SECRET_BYTES:
            return token
        raise PermissionError(f"{path} holds no secret (delete it: it is made again)")
    raise PermissionError(f"{path} could not be made")


class _Signed:
    """httpx transport for the gateway's client: every request it sends to this server carries
    `INTERNAL_HEADER` with the secret (it reaches only this server's own listening address, and
    an explicit transport keeps httpx from routing it through an environment proxy)."""

    def __init__(self, inner, secret: bytes) -> None:
        import httpx

        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()
        self.secret = secret.decode()

    async def handle_async_request(self, request):
        request.headers[INTERNAL_HEADER.decode()] = self.secret
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class _Lifespan:
    """Runs an ASGI app's lifespan (the gateway's: catalog sync, closing its client)."""

    def __init__(self, app) -> None:
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def _step(self, message: str) -> None:
        await self.inbox.put({"type": message})
        got = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait({got, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not got.done():
            got.cancel()
            self.task.result()  # the app's exception, if it raised
            raise RuntimeError(f"the gateway's lifespan ended during {message}")
        reply = got.result()
        if reply["type"].endswith(".failed"):
            raise RuntimeError(reply.get("message") or reply["type"])

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.create_task(self.app(scope, self.inbox.get, self.outbox.put))
        await self._step("lifespan.startup")

    async def shutdown(self) -> None:
        if self.task is not None and not self.task.done():
            await self._step("lifespan.shutdown")
            await self.task


# --- the middleware ----------------------------------------------------------------------------
class CartridgeMiddleware:
    """ASGI middleware for vLLM's API server (`--middleware`): see the module docstring. vLLM adds
    it last, so it runs before vLLM's own middleware (its --api-key check included)."""

    def __init__(self, app) -> None:
        self.app = app
        self.gateway = None             # the gateway's ASGI app once built
        self.error: str | None = None   # why it could not be built (logged; 501 answers omit it)
        self.keys: frozenset[bytes] = frozenset()   # vLLM's keys and the gateway's
        self.vllm_keyed = False
        self.secret: bytes | None = None  # what the gateway's own requests carry (INTERNAL_HEADER)
        self._lifespan: _Lifespan | None = None
        self._started = False
        self._lock = asyncio.Lock()

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan_scope(scope, receive, send)
        if kind != "http":
            return await self.app(scope, receive, send)
        internal = False
        if _header(scope, INTERNAL_HEADER):  # vLLM never sees it, whoever sent it
            internal = self._internal(scope)
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != INTERNAL_HEADER])
        path, method = _route_path(scope), scope.get("method")
        if method == "GET" and path == "/metrics":
            return await self._metrics(scope, receive, send)
        if method == "GET" and path == LIST_PATH:  # the gateway's own route: vLLM has none
            if not self._started:
                await self._start(scope.get("app"), scope)
            if self.gateway is None:
                if self._refused_by_vllm(scope, path):
                    return await self.app(scope, receive, send)  # vLLM's 401 comes first, as for a POST
                return await self._unavailable()(scope, receive, send)
            return await self.gateway(dict(scope, path=path, raw_path=path.encode(), root_path=""), receive, send)
        if method != "POST" or _header(scope, b"content-type").lower().startswith(FORMS):
            return await self.app(scope, receive, send)  # uploads (audio, files) are not read here
        if not self._started:
            await self._start(scope.get("app"), scope)
        if internal:  # the gateway's own request to this server: the keys it sets are its own
            return await self.app(scope, receive, send)
        if self._refused_by_vllm(scope, path):
            return await self.app(scope, receive, send)  # vLLM answers 401 without reading the body
        body = await read_body(receive)
        if body is None:
            return  # the client is gone
        replay_body = replay(body, receive)
        data = parse_body(body)
        if data is NOT_UTF8:
            return await error_response(400, NOT_UTF8_MESSAGE)(scope, replay_body, send)
        refused = check_client_body(data)
        if refused is not None:
            return await error_response(400, refused)(scope, replay_body, send)
        if not has_cartridges(body, data):
            return await self.app(scope, replay_body, send)
        if path not in GATEWAY_PATHS:
            return await error_response(400, f"'cartridges' is served on {' and '.join(GATEWAY_PATHS)} only, "
                                             f"not on {path}")(scope, replay_body, send)
        if self.gateway is None:
            return await self._unavailable()(scope, replay_body, send)
        sub = dict(scope, path=path, raw_path=path.encode(), root_path="")
        return await self.gateway(sub, replay_body, send)

    def _unavailable(self):
        """The answer to what only the gateway serves, where it could not be built: 501 without
        the reason, which names the operator's files (the tenants file, the LMCache config) and
        tenants; the server's log has it."""
        return error_response(501, UNAVAILABLE_MESSAGE)

    def _internal(self, scope) -> bool:
        """Whether the request is the gateway's own (it carries this server's secret)."""
        got = _header(scope, INTERNAL_HEADER)
        return bool(got) and self.secret is not None and hmac.compare_digest(got, self.secret)

    def _refused_by_vllm(self, scope, path: str) -> bool:
        """Whether vLLM's own --api-key refuses this request whatever its body holds (its key is
        neither vLLM's nor the gateway's): then its body is not read, as vLLM would not read it."""
        if not self.vllm_keyed or not path.startswith(VLLM_GUARDED):
            return False
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        token = token.strip()
        ok = scheme.lower() == b"bearer" and any(hmac.compare_digest(token, k) for k in self.keys)
        return not ok

    # --- building the gateway (at server start, or at the first request without a lifespan)
    async def _start(self, app, scope: dict) -> None:
        async with self._lock:
            if self._started:
                return
            self._started = True
            ensure_log_handler()
            args = getattr(getattr(app, "state", None), "args", None)
            own = vllm_keys(args)
            self.vllm_keyed = bool(own)
            self.keys = frozenset(k.encode() for k in own)  # vLLM's keys may always send a body here
            try:
                from lmcache_cartridge.api.gateway import create_app
                from lmcache_cartridge.paths import private_dir

                upstream, transport = upstream_of(args, scope)
                settings = settings_from_environment(args, upstream)
                try:
                    secret = internal_secret(private_dir(settings.cache_dir))
                except OSError as e:  # this process's own: enough with one API process
                    logger.warning("lmcache_cartridge middleware: %s: %s; using a secret of this process's "
                                   "(with --api-server-count > 1 the gateway's requests reaching another API "
                                   "process are refused)", type(e).__name__, e)
                    secret = secrets.token_urlsafe(_SECRET_BYTES).encode()
                self.gateway = await asyncio.to_thread(create_app, settings, transport=_Signed(transport, secret))
                self.secret = secret
                self._lifespan = _Lifespan(self.gateway)
                await self._lifespan.startup()
            except Exception as e:
                self.gateway, self._lifespan, self.secret = None, None, None
                self.error = str(e) if isinstance(e, NotConfigured) else f"{type(e).__name__}: {e}"
                logger.error("lmcache_cartridge middleware: requests with 'cartridges' answer 501: %s", self.error)
                return
            self.keys = frozenset(k.encode() for k in (*own, *settings.all_keys()))
            who = ("no API key (open, as vLLM)" if not settings.all_keys() else "vLLM's --api-key"
                   if settings.all_keys() == own else "the gateway's API keys")
            logger.info("lmcache_cartridge middleware: 'cartridges' on %s served in this server (model %r, "
                        "registry %s, through %s, clients need %s)", " and ".join(GATEWAY_PATHS), settings.model,
                        settings.registry, upstream, who)

    async def _stop(self) -> None:
        if self._lifespan is not None:
            try:
                await self._lifespan.shutdown()
            except Exception as e:
                logger.warning("lmcache_cartridge middleware: gateway shutdown: %s: %s", type(e).__name__, e)
            self._lifespan = None

    async def _lifespan_scope(self, scope, receive, send):
        app = scope.get("app")

        async def send_(msg):
            if msg["type"] == "lifespan.startup.complete":
                await self._start(app, scope)  # vLLM is up: its arguments are final
            await send(msg)

        async def receive_():
            msg = await receive()
            if msg["type"] == "lifespan.shutdown":
                await self._stop()
            return msg

        return await self.app(scope, receive_, send_)

    # --- /metrics: vLLM's, then the gateway's
    async def _metrics(self, scope, receive, send):
        if self.gateway is None:
            return await self.app(scope, receive, send)
        start: dict | None = None
        parts: list[bytes] = []

        async def capture(msg):
            nonlocal start
            if msg["type"] == "http.response.start":
                start = msg
                return
            if msg["type"] != "http.response.body" or start is None:
                return await send(msg)
            parts.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            body, headers = b"".join(parts), list(start.get("headers") or [])
            if start["status"] == 200:
                body = self._with_gateway_metrics(body, headers)
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return await self.app(scope, receive, capture)

    def _with_gateway_metrics(self, body: bytes, headers) -> bytes:
        registry = self.gateway.state.metrics.registry
        hdr = {k.lower(): v.lower() for k, v in headers}
        encoding = hdr.get(b"content-encoding", b"identity")
        if encoding not in (b"identity", b"gzip"):
            return body
        text = gzip.decompress(body) if encoding == b"gzip" else body
        if b"openmetrics" in hdr.get(b"content-type", b""):
            from prometheus_client.openmetrics.exposition import generate_latest

            text = text.removesuffix(b"# EOF\n") + generate_latest(registry)  # one # EOF, at the end
        else:
            from prometheus_client import generate_latest

            text = text + (b"" if not text or text.endswith(b"\n") else b"\n") + generate_latest(registry)
        return gzip.compress(text) if encoding == b"gzip" else text
