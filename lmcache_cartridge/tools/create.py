"""Make "first-k" cartridges: run real text through a local HF model and keep its KV cache.

Canonical KV layout across the project: one tensor `[2, num_layers, num_tokens, num_kv_heads,
head_dim]` (0 = K, 1 = V), K after RoPE exactly as HF caches it, in the model's dtype. A
cartridge is only valid as the prefix it was computed for, so the token ids travel with it.

Runs offline in the `create` command's process (and in tests that make cartridges), never on
the serving path: the HF model on CPU by default or on the `device` asked for (a GPU makes long
documents practical), prefilled in chunks so memory stays bounded; the KV comes back on CPU. It
reads the model directory and owns nothing on disk: it returns a `CreatedCartridge` in memory,
and its caller packs it (`pack_kv`) where it chooses, after `packed.check_output_dir` (which only
probes) said it can: before the forward pass, which takes minutes.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.cartridge.model_kv import DEFAULT_PREFILL_CHUNK, compute_prefix_kv, load_model
from lmcache_cartridge.errors import CartridgeFormatError


@dataclass
class CreatedCartridge:
    """A cartridge before packing: its KV is valid only after exactly these token ids."""

    kv: torch.Tensor  # [2, num_layers, num_tokens, num_kv_heads, head_dim]
    token_ids: list[int]
    provenance: dict[str, Any] = field(default_factory=dict)


def sample_chunks(body_len: int, budget: int, chunk: int, seed: int) -> list[tuple[int, int]]:
    """SCI: random non-overlapping `[start, end)` chunks of a sequence, in order, `budget` tokens.

    Chunk starts are anywhere in the sequence (sorted random offsets into the tokens left over),
    not on a fixed grid. The last chunk is cut short to hit the budget exactly;
    chunks may abut, so two can read as one longer chunk.
    """
    if body_len <= budget:
        return [(0, body_len)] if body_len else []
    lengths = [chunk] * (budget // chunk) + ([budget % chunk] if budget % chunk else [])
    free = body_len - budget
    rng = random.Random(seed)
    gaps = sorted(rng.randint(0, free) for _ in lengths)
    spans, used = [], 0
    for gap, length in zip(gaps, lengths):
        spans.append((gap + used, gap + used + length))
        used += length
    return spans


def document_tokens(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """(leading special ids, text ids): what the engine computes for a prompt that starts with
    `text`, split where the document begins.

    The tokenizer decides, as vLLM's does for a text prompt: a Llama tokenizer prepends BOS (the
    cartridge starts with it, the attention sink); a Qwen2 tokenizer adds nothing (the cartridge
    starts with the text). Specials a tokenizer appends (an EOS after the text) are dropped: the
    user's tokens follow the cartridge, not an end of sequence.
    """
    plain = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    full = [int(t) for t in tokenizer(text)["input_ids"]]
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k], plain
    raise CartridgeFormatError(
        "the tokenizer encodes the document differently with and without special tokens; "
        "cannot tell where the document starts"
    )


def create_first_k(
    model_dir: str | Path,
    text: str,
    *,
    max_tokens: int | None = None,
    sci_chunk: int | None = None,
    seed: int = 0,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    engine: Any | None = None,
    device: str | torch.device | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> CreatedCartridge:
    """Cartridge from real text: the first `max_tokens` tokens (the tokenizer's BOS included where
    it adds one), or with `sci_chunk` the leading specials plus sampled document chunks (Sampled
    Chunk Initialization, Cartridges paper).

    The KV is computed by `engine` (an `engine_kv.EngineKVMaker`: vLLM itself, the engine that
    will serve it, so served it answers exactly as the plain prompt does), or without one by HF
    transformers (eager, the model's dtype: an independent implementation whose rounding differs
    from vLLM's, so greedy answers can part from the plain prompt's).
    `model_and_tokenizer` lets callers that make several cartridges load the model once (with an
    engine only its tokenizer is used).
    Without an engine, `device` (default cpu; e.g. cuda, cuda:1) is where the model is loaded and
    the forward pass runs (a model passed in stays where it is: then give no device), and
    `prefill_chunk` tokens go through the model at a time (`compute_prefix_kv`; None: all at once).
    The KV is returned on CPU in the model's dtype.
    """
    import transformers

    _check_options(text, max_tokens, sci_chunk, prefill_chunk, device, engine, model_and_tokenizer)
    model, tokenizer, limit = _model_or_tokenizer(model_dir, model_and_tokenizer, engine, device)
    head, body = document_tokens(tokenizer, text)
    doc = head + body

    if sci_chunk is None:
        method = "first_k"
        token_ids = doc if max_tokens is None else doc[:max_tokens]
        spans = None
    else:
        method = "sci"
        spans = sample_chunks(len(body), max_tokens - len(head), sci_chunk, seed)
        token_ids = head + [t for s, e in spans for t in body[s:e]]
    if len(token_ids) > limit:
        raise CartridgeFormatError(
            f"the document is {len(doc)} tokens, longer than the model's "
            f"max_position_embeddings ({limit}); pass max_tokens <= {limit} (or sci_chunk with "
            "max_tokens) to keep part of it"
        )

    if engine is None:
        kv = compute_prefix_kv(model, token_ids, prefill_chunk)
        computed_by = {"engine": "transformers", "dtype": str(kv.dtype).removeprefix("torch."),
                       "attention": "eager", "device": str(next(model.parameters()).device),
                       "prefill_chunk": prefill_chunk}
    else:
        kv = engine.prefix_kv(token_ids)
        computed_by = engine.describe()
    provenance: dict[str, Any] = {
        "model_dir": str(model_dir),
        "kv_computed_by": computed_by,
        "method": method,
        "max_tokens": max_tokens,
        "sci_chunk": sci_chunk,
        "seed": seed,
        "source_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "source_num_tokens": len(doc),
        "leading_special_ids": list(head),
        "num_tokens": len(token_ids),
        "transformers_version": transformers.__version__,
    }
    if spans is not None:
        # Offsets into the document's tokens after its leading specials (BOS where the
        # tokenizer adds one), so a cartridge can be re-derived.
        provenance["sci_spans"] = [[s, e] for s, e in spans]
    return CreatedCartridge(kv=kv, token_ids=[int(t) for t in token_ids], provenance=provenance)


def _check_options(text: str, max_tokens: int | None, sci_chunk: int | None, prefill_chunk: int | None,
                   device: Any, engine: Any, model_and_tokenizer: Any) -> None:
    """`create_first_k`'s options, refused before any model is loaded."""
    if not text or not text.strip():
        raise CartridgeFormatError(
            "source text is empty: give the document the cartridge should hold"
        )
    if max_tokens is not None and max_tokens < 2:
        raise CartridgeFormatError(
            f"max_tokens={max_tokens} is too small: a cartridge needs at least two tokens"
        )
    if sci_chunk is not None:
        if sci_chunk < 1:
            raise CartridgeFormatError(
                f"sci_chunk must be a positive number of tokens, got {sci_chunk}"
            )
        if max_tokens is None:
            raise CartridgeFormatError(
                "sci_chunk needs max_tokens: SCI samples chunks up to a token budget"
            )
    if prefill_chunk is not None and prefill_chunk < 1:
        raise CartridgeFormatError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
    if device is not None and (engine is not None or model_and_tokenizer is not None):
        raise CartridgeFormatError("device is where create_first_k loads the model: not with an engine or "
                                   "a model passed in (that one runs where it is)")


def _model_or_tokenizer(model_dir: str | Path, model_and_tokenizer: tuple[Any, Any] | None, engine: Any,
                        device: str | torch.device | None) -> tuple[Any, Any, int]:
    """(model, tokenizer, the model's max_position_embeddings). With an engine, which computes
    the KV, only the tokenizer and the config are loaded (the model is None)."""
    if engine is None:
        model, tokenizer = model_and_tokenizer or load_model(model_dir, device=device or "cpu")
        return model, tokenizer, model.config.max_position_embeddings
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = model_and_tokenizer[1] if model_and_tokenizer else AutoTokenizer.from_pretrained(str(model_dir))
    return None, tokenizer, AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings
