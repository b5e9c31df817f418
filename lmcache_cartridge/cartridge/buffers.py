"""Byte views and copies of CPU tensors: the one place that turns a tensor into bytes.

Runs in whichever process moves chunk bytes (the plugin in vLLM's workers, the CLI, tests); it
owns nothing: callers own both tensors of every copy.
"""

from __future__ import annotations

import ctypes

import torch


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable/readable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src`'s bytes into `dst`: one memmove for contiguous CPU tensors.

    ctypes releases the GIL for the call; torch's `copy_` with its default intra-op threads was
    measured ~5x slower than a single memmove on this 2-core machine (benchmarks/chunk_retrieval).
    """
    if (dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
            and dst.nbytes == src.nbytes):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
    else:
        dst.copy_(src)


def clone_bytes(src: torch.Tensor) -> torch.Tensor:
    out = torch.empty(src.nbytes, dtype=torch.uint8)
    copy_into(out, src.reshape(-1).view(torch.uint8))
    return out
