"""Request bodies of the gateway as pydantic models: FastAPI validates them, publishes them in the
OpenAPI schema, and `describe` turns pydantic's errors into one clear 400 message.

Fields the gateway reads are typed strictly (no `"3"` -> 3, no `"yes"` -> true); every other
OpenAI/vLLM field (sampling parameters, `n`, `stop`, ...) passes through to the upstream server,
which validates it. Runs in the gateway process; no state.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from lmcache_cartridge.cartridge.keys import SALT_TAG
from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM

MAX_ID_LENGTH = 1024
SOURCES = ("s3", "local")

# What a client may put in `kv_transfer_params`: LMCache's per-request options that only narrow
# what is stored or partition keys (`lmcache.skip_save`, `lmcache.tag.<name>`), and the count of
# leading cartridge tokens the instance briefly waits for (`vllm.readiness.CARTRIDGE_TOKENS_PARAM`:
# a standalone gateway in front of a vLLM running the middleware sends it; set by anyone else it
# only delays that request, by at most `cartridge.first_k_wait_s`). Everything else is refused:
# the connector's other keys (`lmcache_cartridge.*`: composite registrations, the trained
# readiness and no-recompute rules) are the gateway's to set, and LMCache's scheduler reads
# `disagg_spec` without a guard (a malformed one is engine-fatal).
MAX_CARTRIDGE_TOKENS = 1 << 24
CLIENT_KV_PARAMS = ("lmcache.skip_save", "lmcache.tag.<name>", CARTRIDGE_TOKENS_PARAM)
_TAG_KEY = re.compile(r"lmcache\.tag\.[A-Za-z0-9_.-]{1,64}\Z")
MAX_KV_PARAMS = 8
MAX_TAG_VALUE = 256


def check_client_kv_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """`params` if every entry is one a client may set (`CLIENT_KV_PARAMS`), else ValueError
    naming the first that is not."""
    if params is None:
        return None
    if len(params) > MAX_KV_PARAMS:
        raise ValueError(f"at most {MAX_KV_PARAMS} entries")
    for key, value in params.items():
        if key == "lmcache.skip_save":
            if not isinstance(value, bool):
                raise ValueError("'lmcache.skip_save' must be true or false")
        elif key == CARTRIDGE_TOKENS_PARAM:
            if type(value) is not int or not 0 <= value <= MAX_CARTRIDGE_TOKENS:
                raise ValueError(f"{key!r} must be an integer from 0 to {MAX_CARTRIDGE_TOKENS}")
        elif key == SALT_TAG:
            raise ValueError(f"{key!r} is the gateway's to set (it keys KV a client brought)")
        elif _TAG_KEY.match(key):
            if not isinstance(value, str) or len(value) > MAX_TAG_VALUE:
                raise ValueError(f"{key!r} must be a string of at most {MAX_TAG_VALUE} characters")
        else:
            raise ValueError(f"{key[:80]!r} may not be set by a client (allowed: {', '.join(CLIENT_KV_PARAMS)})")
    return params


class CartridgeSpec(BaseModel):
    """One entry of a request's `cartridges` field."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr = Field(min_length=1, max_length=MAX_ID_LENGTH, description=(
        "s3://bucket/path/to/cartridge.pt (one object, any input format), s3://bucket/prefix (a packed "
        "cartridge), an absolute local path (with source 'local'), or a registered id or label"))
    source: Literal["s3", "local"] = Field("s3", description=(
        "where `id` lives; default 's3'. A bare id or label is looked up in the registry"))
    force_redownload: StrictBool = Field(False, description="fetch it again even if cached")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # other OpenAI/vLLM fields pass through

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    stream: StrictBool = False
    cartridges: list[CartridgeSpec] | None = Field(None, description="loaded in order, before the prompt")
    kv_transfer_params: dict[str, Any] | None = Field(None, description=(
        "LMCache per-request options a client may set: " + ", ".join(CLIENT_KV_PARAMS)))

    vllm_xargs: dict[str, Any] | None = Field(None, description="vLLM's extra arguments (passed through)")

    @field_validator("kv_transfer_params")
    @classmethod
    def _client_kv_params(cls, v):
        return check_client_kv_params(v)

    @field_validator("vllm_xargs")
    @classmethod
    def _no_kv_params_in_xargs(cls, v):
        # vLLM copies `vllm_xargs.kv_transfer_params` into the request where the body sets none
        if v is not None and "kv_transfer_params" in v:
            raise ValueError("may not carry 'kv_transfer_params' (send 'kv_transfer_params' itself)")
        return v


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(description=(
        "as vLLM takes it: a string, a list of token ids, or a batch of either; with cartridges, one prompt"))

    def one_prompt(self) -> str | list[int]:
        """The request's single prompt, for a request with cartridges (they go before one prompt);
        ValueError for a batch."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p
        raise ValueError("'prompt' must be one prompt (a string or a list of token ids) when cartridges are "
                         f"named, not a batch of {len(p)}: send one request per prompt")


class ContentPart(BaseModel):
    """An OpenAI content part, any type vLLM accepts (text, image_url, input_audio, ...): a request
    without cartridges reaches vLLM whole, and vLLM judges the parts."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """A chat message of any shape vLLM accepts: `content` a string, a list of parts, or absent /
    null (an assistant turn with `tool_calls`)."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def as_text(self) -> dict[str, Any]:
        """The message with its content as one string, as vLLM renders text parts for a chat
        template that takes strings: joined with newlines (`renderers/chat_utils.py`). Used only
        for requests with cartridges, whose prompt the gateway renders itself as token ids: a
        message without text content (tool calls, images, audio) is ValueError there."""
        d = self.model_dump(exclude_unset=True)
        if self.content is None:
            raise ValueError(f"a {self.role!r} message without text content")
        if isinstance(self.content, list):
            kinds = sorted({p.type for p in self.content if p.type != "text" or p.text is None})
            if kinds:
                raise ValueError(f"a {self.role!r} message with {', '.join(map(repr, kinds))} content parts")
            d["content"] = "\n".join(p.text for p in self.content)
        return d


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=-1, description="-1: every token's (vLLM's rule)")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="chat's max_tokens (which it deprecates)")


# --- messages ---------------------------------------------------------------------------------
_WHOLE_FIELD = {
    "prompt": "'prompt' must be a string or a list of token ids (or a batch: a list of either)",
    "messages": "'messages' must be a non-empty list of {role, content}, content a string, a list of "
                "content parts ({type, ...}) or null",
}


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if part == "body":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(errors: list[dict]) -> str:
    """The first validation error in words a client can act on (the rest usually follow from it)."""
    e = errors[0]
    loc = tuple(e.get("loc", ()))
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    path = _path(loc)
    top = next((p for p in loc if p != "body"), None)
    if kind == "json_invalid":
        return f"invalid JSON: {ctx.get('error', e.get('msg'))}"
    if not path:
        return "request body must be a JSON object" if kind != "missing" else "a JSON request body is required"
    if kind == "missing":
        return f"'{path}' is required"
    if top in _WHOLE_FIELD:
        return _WHOLE_FIELD[top]
    if kind == "extra_forbidden":
        return f"{_path(loc[:-1])} has unknown fields [{loc[-1]!r}] (allowed: id, source, force_redownload)"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"'{path}' must be an object"
    if kind == "list_type":
        what = " of {id, source, force_redownload} objects" if path == "cartridges" else ""
        return f"'{path}' must be a list{what}"
    if kind == "string_too_short":
        return f"'{path}' must be a non-empty string"
    if kind == "string_too_long":
        return f"'{path}' is longer than {ctx.get('max_length')} characters"
    if kind == "literal_error":
        return f"'{path}' must be {ctx.get('expected')}, got {e.get('input')!r}"
    if kind == "bool_type":
        return f"'{path}' must be true or false"
    if kind in ("int_type", "int_parsing"):
        return f"'{path}' must be an integer"
    if kind in ("string_type",):
        return f"'{path}' must be a string"
    if kind == "value_error" and ctx.get("error") is not None:
        return f"'{path}': {ctx['error']}"
    return f"'{path}': {e.get('msg')}"
