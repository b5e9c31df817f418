"""Request bodies of the gateway as pydantic models: FastAPI validates them, publishes them in the
OpenAPI schema, and `describe` turns pydantic's errors into one clear 400 message.

Fields the gateway reads are typed strictly (no `"3"` -> 3, no `"yes"` -> true); every other
OpenAI/vLLM field (sampling parameters, `n`, `stop`, ...) passes through to the upstream server,
which validates it. Runs in the gateway process; no state.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_ID_LENGTH = 1024
SOURCES = ("s3", "local")


class CartridgeSpec(BaseModel):
    """One entry of `cartridges` (seed 000's request API)."""

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
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] = Field(description="a string or a list of token ids (one prompt)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)


# --- messages ---------------------------------------------------------------------------------
_WHOLE_FIELD = {
    "prompt": "'prompt' must be a string or a list of token ids (one prompt per request)",
    "messages": "'messages' must be a non-empty list of {role, content} with string content",
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
    return f"'{path}': {e.get('msg')}"
