"""First-k KV a client brought (named by a local path or an S3 URI in a request, not registered
by the operator) reaches only requests that name it. Its ids are a claim nobody checked: keyed
as usual, forged KV for a popular prompt would be served to everyone sending that prompt
(LMCache keys depend on token ids only). So such a registration is salted (`Entry.salt`,
derived from the KV and ids): the plugin keys its chunks under LMCache's `lmcache.tag.*`
mechanism, and only the gateway's requests that name it carry the tag (and vLLM's
`cache_salt`). The serving proof with a real vLLM is in test_gateway_e2e."""

from __future__ import annotations

import sqlite3

import pytest

from conftest import random_kv
from test_plugin import CHUNK, D, H, L, MODEL, engine_for, flat
from lmcache_cartridge.api.gateway import GatewaySettings
from lmcache_cartridge.api.requests import CartridgeSpec, check_client_kv_params
from lmcache_cartridge.api.resolver import Resolver
from lmcache_cartridge.cartridge.keys import SALT_TAG, client_kv_salt
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools.testmodel import ensure_test_model

PROMPT = list(range(5000, 5000 + 2 * CHUNK))  # a prompt everybody sends


@pytest.fixture
def env(tmp_path):
    allowed = tmp_path / "allowed"
    settings = GatewaySettings(upstream="http://127.0.0.1:9", model=MODEL, tokenizer=str(ensure_test_model()),
                               registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", chunk_size=CHUNK,
                               local_roots=(allowed,))
    kv = {"forged": random_kv(L, 2 * CHUNK, H, D, seed=1), "next": random_kv(L, 3 * CHUNK, H, D, seed=2),
          "ta": random_kv(L, CHUNK, H, D, seed=3)}
    pack_kv(kv["forged"], allowed / "forged", cartridge_id="forged", model=MODEL, kind="first_k",
            token_ids=PROMPT, chunk_size=CHUNK)
    pack_kv(kv["next"], allowed / "next", cartridge_id="next", model=MODEL, kind="first_k",
            token_ids=PROMPT + list(range(7000, 7000 + CHUNK)), chunk_size=CHUNK)
    pack_kv(kv["ta"], allowed / "ta", cartridge_id="ta", model=MODEL, kind="trained",
            vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    reg = Registry(settings.registry)
    return {"r": Resolver(settings, reg), "reg": reg, "kv": kv, "dir": tmp_path, "allowed": allowed}


def named(env, name):
    return env["r"].resolve(CartridgeSpec(id=str(env["allowed"] / name), source="local"))


def test_a_clients_first_k_is_salted_an_operators_is_not(env):
    reg, allowed = env["reg"], env["allowed"]
    forged = named(env, "forged")
    assert forged.entry.salt == client_kv_salt(forged.manifest) and len(forged.entry.salt) == 32
    assert reg.get("forged").salt == forged.entry.salt
    assert named(env, "ta").entry.salt == ""  # trained ids are derived from the KV (test_manifest_trust)
    # the operator registering these bytes vouches for them; a client naming them again keeps that
    assert reg.register(allowed / "forged").salt == ""
    env["r"]._cache.clear()
    assert named(env, "forged").entry.salt == ""
    # ... but not for other bytes written there afterwards
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=9), allowed / "forged", cartridge_id="forged", model=MODEL,
            kind="first_k", token_ids=PROMPT, chunk_size=CHUNK, overwrite=True)
    env["r"]._cache.clear()
    again = named(env, "forged")
    assert again.entry.salt == client_kv_salt(again.manifest) != forged.entry.salt


def test_a_registry_from_before_salts_opens_with_nothing_salted(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript("""CREATE TABLE cartridges (id TEXT PRIMARY KEY, path TEXT NOT NULL, source_uri TEXT NOT NULL,
        model TEXT NOT NULL, kind TEXT NOT NULL, num_layers INTEGER NOT NULL, num_kv_heads INTEGER NOT NULL,
        head_dim INTEGER NOT NULL, dtype TEXT NOT NULL, num_tokens INTEGER NOT NULL, chunk_size INTEGER NOT NULL,
        content_hash TEXT NOT NULL, labels TEXT NOT NULL DEFAULT '[]', added_at REAL NOT NULL,
        epoch INTEGER NOT NULL DEFAULT 0);
        INSERT INTO cartridges VALUES ('a', '/x', '/x', 'm', 'first_k', 1, 1, 8, 'bfloat16', 4, 4, 'h', '[]', 0, 0);""")
    db.close()
    assert Registry(tmp_path / "old.db").get("a").salt == ""


def test_salted_kv_is_served_only_to_requests_carrying_its_salt(env):
    """A real LMCacheEngine with the plugin: the prompt without the salt finds nothing (before
    and after the salted request made LMCache write the chunks back to its CPU tier); with it,
    the cartridge's bytes."""
    salt = named(env, "forged").entry.salt
    tagged = {SALT_TAG: salt}
    with engine_for(env["dir"], env["reg"].path) as eng:
        assert eng.engine.lookup(PROMPT + [1]) == 0
        assert eng.engine.lookup(PROMPT + [1], request_configs=tagged) == 2 * CHUNK
        n, got = eng.retrieve(PROMPT + [1], request_configs=tagged)
        assert n == 2 * CHUNK and (got[:, :, :n] == flat(env["kv"]["forged"])).all()
        assert eng.retrieve(PROMPT + [1])[0] == 0
        assert eng.engine.lookup(PROMPT + [1], request_configs={SALT_TAG: "0" * 32}) == 0


def test_the_plan_loads_a_clients_kv_only_as_the_requests_one_kv_cartridge(env):
    r = env["r"]
    forged, nxt, ta = named(env, "forged"), named(env, "next"), named(env, "ta")
    plan = r.plan([forged])
    assert plan.wanted == [forged.entry] and plan.salt == forged.entry.salt and plan.prefix == PROMPT
    # two clients' cartridges: the first one's KV under its salt, the next one's tokens computed
    plan = r.plan([forged, nxt])
    assert plan.wanted == [forged.entry] and plan.salt == forged.entry.salt and plan.prefix == list(nxt.token_ids)
    # beside trained KV (keyed without salt) it is computed: a priming request, never a composite part
    plan = r.plan([forged, ta])
    assert plan.salt == "" and plan.prefix == PROMPT + list(ta.token_ids)
    assert [p.length for p in plan.primes] == [2 * CHUNK]
    assert all("forged" not in (w.id, *w.labels) for w in plan.wanted) and len(plan.wanted) == 1
    # after the operator's first-k (keys without salt), a client's extension is computed
    env["reg"].register(env["allowed"] / "forged")
    env["r"]._cache.clear()
    plan = r.plan([named(env, "forged"), named(env, "next")])
    assert plan.salt == "" and [w.id for w in plan.wanted] == ["forged"]


def test_clients_may_not_set_the_salt_tag(env):
    with pytest.raises(ValueError, match="gateway's to set"):
        check_client_kv_params({SALT_TAG: "x"})
    assert check_client_kv_params({"lmcache.tag.team": "x"}) == {"lmcache.tag.team": "x"}
    # the cartridge-token count a standalone gateway sends through a vLLM running the middleware:
    # an integer in range only (set by anyone else it only delays that request, bounded)
    from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM

    assert check_client_kv_params({CARTRIDGE_TOKENS_PARAM: 512}) == {CARTRIDGE_TOKENS_PARAM: 512}
    for bad in (True, -1, 1 << 30, "512", 1.5, None):
        with pytest.raises(ValueError, match="must be an integer"):
            check_client_kv_params({CARTRIDGE_TOKENS_PARAM: bad})
