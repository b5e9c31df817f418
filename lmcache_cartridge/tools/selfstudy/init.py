"""Where a trained cartridge's KV starts (`train --init`).

Runs in the `train` process, once per run, before the optimisation loop (`loop.build_student`).

- `first_k` (the paper's, the default): the KV of the document's first `tokens` tokens, the
  document as the chat template's system message (PEFT's `initialize_kv_prefix_from_text`).
- `attention`: the KV of the whole document, prefilled once, of which each layer and KV head
  keeps the document's first `first` tokens (1 by default: the attention sink; more keep part
  of what first-k would hold) and the `tokens - first` other positions the document's own tokens
  attended to most (attention summed over all later queries of the document and over the query
  heads of the KV head's group, as H2O ranks a cache). Kept positions stay in document order;
  their keys are rotated from their document positions to `0..tokens-1`, the positions the
  served cartridge occupies (RoPE is a rotation per frequency, so moving a key by `d` positions
  is one more rotation by `d`). The start then holds KV from the whole document, not only from
  its beginning.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError

PREFILL_CHUNK = 512  # query rows per forward pass: the attention weights held are [heads, 512, n]


def document_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, n] token ids of `text` as the chat template's system message, as PEFT's first-k
    initialisation tokenizes it."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                        add_generation_prompt=False, return_dict=False, return_tensors="pt")
    return torch.as_tensor(ids).reshape(1, -1)


def attention_kv(model, ids: torch.Tensor, tokens: int, first: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each [1, kv_heads, tokens, head_dim]: the module docstring's
    `attention` start for the document `ids` ([1, n]); `model` is the HF model (no adapter)."""
    n = ids.shape[1]
    if n < tokens:
        raise CartridgeError(f"the document has {n} tokens (chat template included), fewer than the cartridge's "
                             f"{tokens}: use a longer document or fewer --tokens")
    inv_freq = rope_frequencies(model)
    keys, values, scores = prefill_with_scores(model, ids)
    out = []
    for k, v, s in zip(keys, values, scores):
        keep = kept_positions(s, tokens, first)            # [kv_heads, tokens], ascending
        k, v = k[0], v[0]                                  # [kv_heads, n, head_dim]
        at = keep[..., None].expand(-1, -1, k.shape[-1])
        moved = rotate(k.gather(1, at), torch.arange(tokens) - keep, inv_freq)
        out.append((moved[None].contiguous(), v.gather(1, at)[None].contiguous()))
    return out


def kept_positions(score: torch.Tensor, tokens: int, first: int = 1) -> torch.Tensor:
    """[kv_heads, tokens] ascending positions: `0..first-1` and the `tokens - first` best scored
    of the others."""
    s = score.clone()
    s[:, :first] = float("inf")
    return s.topk(tokens, dim=1).indices.sort(dim=1).values


def rotate(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys `k` [..., L, head_dim] (RoPE applied, HF's rotate-half pairing) moved by `delta`
    [..., L] positions: one more rotation by `delta * inv_freq` per frequency."""
    angle = delta.to(torch.float32)[..., None] * inv_freq.to(device=k.device, dtype=torch.float32)
    emb = torch.cat((angle, angle), dim=-1)
    half = k.shape[-1] // 2
    turned = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k.float() * emb.cos() + turned.float() * emb.sin()).to(k.dtype)


def prefill_with_scores(model, ids: torch.Tensor) -> tuple[list, list, list[torch.Tensor]]:
    """Prefill `ids` in chunks of `PREFILL_CHUNK` queries with eager attention (which returns its
    weights), summing per layer the weight each key receives: ([1, kvh, n, hd] keys and values
    per layer, [kvh, n] scores per layer). Summing inside a forward hook keeps one chunk's
    weights alive at a time."""
    cfg = model.config
    layers = list(model.model.layers)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    n = ids.shape[1]
    scores = [torch.zeros(cfg.num_key_value_heads, n) for _ in layers]

    def hook(i: int):
        def add(_module, _args, output: Any) -> None:
            w = output[1]
            if w is None:
                raise CartridgeError("the model's eager attention returned no weights, which --init attention "
                                     "ranks positions by; use --init first_k")
            w = w[0].float().sum(1)                        # [heads, keys so far]
            scores[i][:, :w.shape[-1]] += w.view(cfg.num_key_value_heads, group, -1).sum(1).cpu()
        return add

    previous = cfg._attn_implementation
    model.set_attn_implementation("eager")
    handles = [layer.self_attn.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        past = None
        with torch.no_grad():
            for start in range(0, n, PREFILL_CHUNK):
                part = ids[:, start:start + PREFILL_CHUNK].to(model.device)
                past = model(input_ids=part, past_key_values=past, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(previous)
    keys = [layer.keys.cpu() for layer in past.layers]
    values = [layer.values.cpu() for layer in past.layers]
    return keys, values, scores


def rope_frequencies(model) -> torch.Tensor:
    """The model's RoPE frequencies, refused where keys are not rotated over the whole head."""
    rotary = getattr(model.model, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if inv_freq is None or 2 * inv_freq.numel() != head_dim:
        raise CartridgeError(f"--init attention moves keys between positions by their RoPE rotation, and "
                             f"{type(model).__name__} has no RoPE over its whole head; use --init first_k")
    return inv_freq
