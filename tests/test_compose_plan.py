"""Several cartridges "loaded in order", trained ones among them: what the gateway's plan places,
and that LMCache's own lookup serves it. A first-k cartridge that is exact at position 0 (whole
chunks) followed by trained cartridges is one composite: its chained chunk keys run over the
first-k ids then the trained placeholder ids, and a REAL LMCacheEngine with the plugin (built by
LMCache's loader from YAML) retrieves, bit for bit, the concatenated KV. A trained cartridge after
tokens vLLM computes is a composite keyed after them plus a priming request: once the computed
tokens' chunks are stored (what the prime makes vLLM do), LMCache's lookup chains them (its CPU
tier) with the trained chunks (the plugin). A trained cartridge off a chunk boundary answers 400
with the rule."""

from __future__ import annotations

import pytest
import torch

from conftest import random_kv
from test_plugin import CHUNK, D, H, L, MODEL, engine_for, flat
from lmcache_cartridge.api.gateway import GatewaySettings, RequestError
from lmcache_cartridge.api.requests import CartridgeSpec
from lmcache_cartridge.api.resolver import Resolver
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools.testmodel import ensure_test_model


@pytest.fixture
def parts(tmp_path):
    """Resolved cartridges: first-k `sys` (1 chunk), `doc` (2 chunks, extends sys), `other` (1
    chunk, does not), `odd` (40 tokens); trained `ta` (1 chunk) and `tb` (2 chunks); token-only `t`."""
    tok_dir = str(ensure_test_model())
    allowed = tmp_path / "allowed"
    settings = GatewaySettings(upstream="http://127.0.0.1:9", model=MODEL, tokenizer=tok_dir,
                               registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", chunk_size=CHUNK,
                               local_roots=(allowed,))
    reg = Registry(settings.registry)
    kv = {}
    doc_ids = list(range(10, 10 + 2 * CHUNK))
    for name, n, seed, tokens in (("sys", CHUNK, 1, doc_ids[:CHUNK]), ("doc", 2 * CHUNK, 2, doc_ids),
                                  ("other", CHUNK, 3, list(range(300, 300 + CHUNK))),
                                  ("odd", 40, 4, list(range(400, 440)))):
        kv[name] = random_kv(L, n, H, D, seed=seed)
        pack_kv(kv[name], allowed / name, cartridge_id=name, model=MODEL, kind="first_k", token_ids=tokens,
                chunk_size=CHUNK)
    if True:  # doc extends sys: its first chunk's KV is sys's (a first-k KV depends only on its prefix)
        kv["doc"][:, :, :CHUNK] = kv["sys"]
        pack_kv(kv["doc"], allowed / "doc", cartridge_id="doc", model=MODEL, kind="first_k", token_ids=doc_ids,
                chunk_size=CHUNK, overwrite=True)
    for name, n, seed in (("ta", CHUNK, 5), ("tb", 2 * CHUNK, 6)):
        kv[name] = random_kv(L, n, H, D, seed=seed)
        pack_kv(kv[name], allowed / name, cartridge_id=name, model=MODEL, kind="trained",
                vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    torch.save({"token_ids": [7, 8, 9]}, allowed / "t.pt")
    for name in ("sys", "doc", "other", "odd"):  # the operator's: first-k KV a client brought is
        reg.register(allowed / name)            # never composed (test_client_kv_salt)
    r = Resolver(settings, reg)
    res = {n: r.resolve(CartridgeSpec(id=str(allowed / n), source="local"))
           for n in ("sys", "doc", "other", "odd", "ta", "tb", "t.pt")}
    return {"r": r, "reg": reg, "kv": kv, "res": res, "dir": tmp_path}


def test_first_k_then_trained_is_one_composite_served_by_lmcache_bit_for_bit(parts):
    r, res, kv, reg = parts["r"], parts["res"], parts["kv"], parts["reg"]
    order = ["sys", "doc", "ta", "tb"]  # doc extends sys: doc's KV covers both, then ta, tb
    plan = r.plan([res[n] for n in order])
    assert plan.trained and len(plan.wanted) == 1
    comp = plan.wanted[0]
    m = Manifest.load(comp.path)
    assert m.kind == "trained" and m.provenance["composite_of"] == ["doc", "ta", "tb"]
    assert (
        plan.prefix == m.token_ids == list(res["doc"].token_ids) + list(res["ta"].token_ids) + list(res["tb"].token_ids)
    )
    writes = reg.writes
    assert r.plan([res[n] for n in order]).wanted == [comp] and reg.writes == writes  # cached: no write
    # a later token-only part and a first-k one are placed after, as tokens
    tail = r.plan([res["doc"], res["ta"], res["t.pt"], res["other"]])
    assert tail.prefix == (list(res["doc"].token_ids) + list(res["ta"].token_ids) + [7, 8, 9]
                           + list(res["other"].token_ids))
    assert len(tail.wanted) == 1 and tail.wanted[0].id != comp.id

    # LMCache's own lookup and retrieve, the plugin serving the composite from the parts' chunks
    want = torch.cat([kv["doc"], kv["ta"], kv["tb"]], dim=2)
    user = [900, 901, 902]
    with engine_for(parts["dir"], reg.path) as eng:
        assert eng.engine.lookup(plan.prefix + user) == 5 * CHUNK
        n, got = eng.retrieve(plan.prefix + user)
        assert n == 5 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(want).view(torch.uint8))
        # the trained parts' own keys differ after a first-k head: alone, ta is served at 0 only
        assert eng.engine.lookup(list(res["ta"].token_ids) + list(res["tb"].token_ids) + user) == CHUNK


@pytest.mark.parametrize("order, needle", [
    (["t.pt", "ta"], "would start at token 3, not a multiple of the chunk size 64"),  # 3 token ids
    (["ta", "t.pt", "tb"], "would start at token 67, not a multiple of the chunk size 64"),
    (["odd", "ta"], "would start at token 40, not a multiple of the chunk size 64"),
])
def test_combinations_that_cannot_be_exact_answer_400_with_the_rule(parts, order, needle):
    r, res = parts["r"], parts["res"]
    with pytest.raises(RequestError) as e:
        r.plan([res[n] for n in order])
    import fnmatch

    assert e.value.status == 400 and fnmatch.fnmatch(str(e.value), f"*{needle}*"), str(e.value)
    assert "placeholder ids" in str(e.value)


def test_trained_after_computed_tokens_is_primed_then_served_by_lmcache_bit_for_bit(parts):
    """[first-k sys, first-k other, trained ta]: `other` does not extend `sys`, so both are
    computed by vLLM; ta is a one-part composite keyed after their ids, with one prime of their
    128 tokens. [ta, sys, tb]: sys is computed after ta, tb keyed after both, one prime that loads
    ta (need 64) and computes sys. LMCache's lookup finds nothing of the run before the primed
    chunks are stored, and all of it, bit for bit, after."""
    r, res, kv, reg = parts["r"], parts["res"], parts["kv"], parts["reg"]
    ids = {n: list(res[n].token_ids) for n in ("sys", "other", "ta", "tb")}
    user = [900, 901, 902]

    one = r.plan([res["sys"], res["other"], res["ta"]])
    assert one.prefix == ids["sys"] + ids["other"] + ids["ta"] and one.kv_end == 3 * CHUNK
    assert [(p.length, p.need) for p in one.primes] == [(2 * CHUNK, 0)]
    m1 = Manifest.load(one.wanted[0].path)
    assert len(one.wanted) == 1 and m1.context_ids == ids["sys"] + ids["other"] and m1.token_ids == ids["ta"]
    assert m1.provenance["composite_of"] == ["ta"] and one.wanted[0].id not in ("ta",)

    two = r.plan([res["ta"], res["sys"], res["tb"]])
    assert two.prefix == ids["ta"] + ids["sys"] + ids["tb"] and two.kv_end == 4 * CHUNK
    assert [(p.length, p.need) for p in two.primes] == [(2 * CHUNK, CHUNK)]
    assert two.wanted[0] == res["ta"].entry
    m2 = Manifest.load(two.wanted[1].path)
    assert m2.context_ids == ids["ta"] + ids["sys"] and m2.token_ids == ids["tb"]
    writes = reg.writes
    assert r.plan([res["ta"], res["sys"], res["tb"]]).wanted == two.wanted and reg.writes == writes  # cached

    # what the prime leaves: sys's chunk is its own first-k KV (the plugin serves it), other's is computed
    computed = torch.cat([kv["sys"], random_kv(L, CHUNK, H, D, seed=21)], dim=2)
    with engine_for(parts["dir"], reg.path) as eng:
        assert eng.engine.lookup(one.prefix + user) == CHUNK  # unprimed: sys only, other is not computed
        eng.store(one.prefix[:2 * CHUNK], flat(computed))  # the prime: LMCache stores their chunks
        assert eng.engine.lookup(one.prefix + user) == 3 * CHUNK
        n, got = eng.retrieve(one.prefix + user)
        want = torch.cat([computed, kv["ta"]], dim=2)
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n].view(torch.uint8), flat(want).view(torch.uint8))

        eng.clear_local_cpu()
        assert eng.engine.lookup(two.prefix + user) == CHUNK  # ta only: sys after it is not computed yet
        gap = computed[:, :, CHUNK:]
        n, _ = eng.retrieve(two.prefix[:2 * CHUNK])  # the prime loads ta (LMCache keeps a copy) ...
        assert n == CHUNK
        eng.store(two.prefix[:2 * CHUNK], flat(torch.cat([kv["ta"], gap], dim=2)))  # ... and stores sys
        assert eng.engine.lookup(two.prefix + user) == 4 * CHUNK
        n, got = eng.retrieve(two.prefix + user)
        want = torch.cat([kv["ta"], gap, kv["tb"]], dim=2)
        assert n == 4 * CHUNK and torch.equal(got[:, :, :n].view(torch.uint8), flat(want).view(torch.uint8))


def test_trained_first_then_anything_still_served(parts):
    """Unchanged rules: trained first compose; token and first-k parts after them are tokens."""
    r, res = parts["r"], parts["res"]
    plan = r.plan([res["ta"], res["tb"], res["odd"], res["t.pt"]])
    assert plan.trained and len(plan.wanted) == 1
    assert plan.prefix == (list(res["ta"].token_ids) + list(res["tb"].token_ids) + list(res["odd"].token_ids)
                           + [7, 8, 9])
    single = r.plan([res["sys"], res["ta"]])
    assert Manifest.load(single.wanted[0].path).provenance["composite_of"] == ["sys", "ta"]


def test_context_ids_are_whole_chunks_and_only_composites_write_them(parts):
    """A packed cartridge's manifest has no `context_ids` (files written before it stay byte-equal);
    a composite after computed tokens round-trips them; a context that is not whole chunks, or
    holds non-ids, is refused (its keys could not start a chunk)."""
    import dataclasses
    import json

    from lmcache_cartridge.cartridge.manifest import ManifestError

    r, res = parts["r"], parts["res"]
    assert "context_ids" not in json.loads(res["ta"].manifest.to_json())
    m = Manifest.load(r.plan([res["sys"], res["other"], res["ta"]]).wanted[0].path)
    assert Manifest.from_dict(json.loads(m.to_json())) == m and m.context_chunks == 2
    assert m.key_token_ids == m.context_ids + m.token_ids
    for bad in (m.context_ids[:-1], m.context_ids[:-1] + [-1], m.context_ids[:-1] + [True]):
        with pytest.raises(ManifestError, match="context_ids"):
            dataclasses.replace(m, context_ids=bad).validate()


def test_inspect_shows_the_tokens_a_composite_comes_after(parts, capsys):
    from lmcache_cartridge.tools.cli import main

    r, res = parts["r"], parts["res"]
    path = r.plan([res["sys"], res["other"], res["ta"]]).wanted[0].path
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "128 computed tokens (2 chunks LMCache holds, not this cartridge)" in out, out
    assert main(["inspect", str(res["ta"].entry.path)]) == 0
    assert "computed tokens" not in capsys.readouterr().out


def test_an_instance_on_another_host_builds_the_same_composite_from_the_recipe(parts, tmp_path):
    """The gateway's registry is not the instance's (another host, both synced from the catalog):
    the recipe the gateway sends lets the instance's scheduler (`vllm.composites.HostComposer`)
    register the same composite (same id and bytes, keyed after the same context) in its own
    registry, once; a part this host lacks is an error there, not a guess. Then a real LMCache
    engine on that host's registry serves it."""
    import time
    from types import SimpleNamespace

    from lmcache_cartridge.errors import CartridgeError
    from lmcache_cartridge.store.composite import ensure_composite
    from lmcache_cartridge.vllm.composites import COMPOSE_PARAM, HostComposer

    r, res, kv = parts["r"], parts["res"], parts["kv"]
    plan = r.plan([res["sys"], res["other"], res["ta"], res["tb"]])
    assert len(plan.recipes()) == 1 and plan.recipes(2 * CHUNK) == []  # the run ends after the prime
    prompt = plan.prefix + [900, 901]
    other_host = Registry(tmp_path / "host2.db")
    with pytest.raises(CartridgeError, match="is not registered on this host"):
        ensure_composite(other_host, plan.recipes()[0], prompt, tmp_path / "cache2")
    for n in ("ta", "tb"):  # as the catalog sync registers them there: same ids, same bytes
        other_host.register(res[n].entry.path)
    settings = SimpleNamespace(registry=other_host.path, cache_dir=tmp_path / "cache2")
    composer = HostComposer(lambda: settings)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=prompt,
                              kv_transfer_params={COMPOSE_PARAM: plan.recipes()})
    for _ in range(3):
        composer.submit(request)  # vLLM asks each step: built once
    deadline = time.time() + 60  # a poll: over when the build is
    while composer._pending and time.time() < deadline:  # the build, its count included, is over
        time.sleep(0.05)
    built = other_host.get(plan.wanted[0].id)
    assert built is not None and built.content_hash == plan.wanted[0].content_hash and composer.built == 1
    assert Manifest.load(built.path) .context_ids == plan.prefix[:2 * CHUNK]
    writes = other_host.writes
    assert ensure_composite(other_host, plan.recipes()[0], prompt, tmp_path / "cache2").id == built.id
    assert other_host.writes == writes  # already there: no write

    computed = random_kv(L, 2 * CHUNK, H, D, seed=22)
    with engine_for(tmp_path, other_host.path) as eng:
        eng.store(plan.prefix[:2 * CHUNK], flat(computed))  # what the prime leaves on that host
        n, got = eng.retrieve(prompt)
        want = torch.cat([computed, kv["ta"], kv["tb"]], dim=2)
        assert n == 5 * CHUNK and torch.equal(got[:, :, :n].view(torch.uint8), flat(want).view(torch.uint8))
