"""End to end: cartridges served to a REAL vLLM OpenAI server on vLLM's CPU backend, through
LMCache 0.5.6 + `lmcache_cartridge.vllm.connector.CartridgeConnector` (CPU KV connector) + the plugin.

The session's pooled tiny-model server (`server_pool`, `tiny_server`). Prefix caching is off, so every
prompt token either is computed or comes from LMCache; vLLM's `/metrics` counter
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` proves which. Requests use
`logprobs`, never `prompt_logprobs` (that makes vLLM skip external KV). Baselines are sent with
`kv_transfer_params: {"lmcache.skip_save": true}` so LMCache does not store vLLM's own KV for
the cartridge's tokens (a later hit must come from the plugin, not from that copy).

Tolerances (bf16 serving). The test model's attention is deliberately peaked (q/k x4, lm_head
x12) so that layout errors are glaring; that also amplifies bf16 rounding. Measured on this
machine: vLLM vs HF transformers on a plain ~290-token prompt (no cartridge, no LMCache) differs
by up to ~0.2 on one generated-token logprob (mean ~0.06), HF bf16 vs HF fp32 by up to ~0.09,
vLLM vs HF on the random trained KV below by up to ~0.31 (mean ~0.09), and up to ~0.5 on a
near-tie token of the swapped control (mean ~0.2); a K/V-head swap moves the logprobs by ~9.5
on average. Hence:
* first-k (its KV computed by vLLM itself, as `create` makes it: `tools.engine_kv`), vLLM with
  the cartridge vs the same prompt recomputed by vLLM: same text, max |dlogprob| <=
  FIRST_K_MAX_TOL (measured 0.0000: the bytes are vLLM's own; with HF-computed KV 0.04 on
  AVX-512 and 0.72 on an AVX2-only EPYC, which is why `create` asks vLLM);
* trained, vLLM vs HF given the same KV (teacher-forced on vLLM's tokens): mean |dlogprob| <=
  HF_MEAN_TOL and max <= HF_MAX_TOL, and every vLLM greedy token within HF_MAX_TOL of HF's best;
* negative control, mean |dlogprob| against the unaltered KV's reference >= NEG_MIN_MEAN.
The noise floor (vLLM vs HF on a plain prompt) is measured in the run and printed.
"""

from __future__ import annotations


import pytest
import torch

from e2e_server import CHUNK, MAX_TOKENS, Server  # noqa: F401  (Server: the modules with a server of their own)

from lmcache_cartridge.testing.answers import (  # noqa: F401  (also what test_compose_e2e imports from here)
    HF_MAX_TOL,
    HF_MEAN_TOL,
    hf_teacher_forced,
    max_diff,
    mean_diff,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny", "maker:tiny")]

FIRST_K_MAX_TOL = 0.10   # vLLM + first-k cartridge vs vLLM recompute, per generated token
NEG_MIN_MEAN = 1.0       # a wrong KV (heads swapped) must move the logprobs at least this much
USER_TEXT = "Question: what does the document say about the harbor and the old keeper?"


@pytest.fixture(scope="module")
def server(tiny_server, engine_kv):
    engine_kv(tiny_server.model_dir).launch()  # the first-k test's KV maker starts beside the server
    log = tiny_server.log_text()  # its start-up, whichever module started it
    assert "No supported cpu connector" not in log, tiny_server.log_tail()
    assert "vLLM CPU KV layout verified" in log, tiny_server.log_tail()
    # LMCache's CPU cache and the plugin only: its memory objects hold vLLM's blocks, so every
    # load below (first and repeat hits, stored KV reloaded) is a block copy (cpu_kv.EngineBlocks)
    assert "LMCache memory objects of whole blocks hold vLLM-CPU" in log, tiny_server.log_tail()
    return tiny_server


@pytest.fixture(scope="module")
def hf():
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return load_model(ensure_test_model())


def user_ids(tokenizer) -> list[int]:
    return list(tokenizer(USER_TEXT, add_special_tokens=False)["input_ids"])


def hf_tokens_then_kv(model, token_ids: list[int], kv: torch.Tensor, user: list[int], gen_ids: list[int],
                      logprobs: list[float]) -> tuple[float, float]:
    """vLLM's `logprobs` for `gen_ids` against HF computing `token_ids` at positions 0.. and then
    given `kv` after them (a trained cartridge after computed tokens): (mean, max) |dlogprob|, the
    better of bf16 and fp32. Leaves the model in bf16."""
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv

    means, maxes = [], []
    for dtype in (torch.bfloat16, torch.float32):
        both = torch.cat([compute_prefix_kv(model.to(dtype), list(token_ids)), kv.to(dtype)], dim=2)
        _, ref, _ = hf_teacher_forced(model, both, user, gen_ids, dtype)
        means.append(mean_diff(logprobs, ref))
        maxes.append(max_diff(logprobs, ref))
    model.to(torch.bfloat16)
    return min(means), min(maxes)


def token_ids_of(server: Server, tokenizer, res: dict) -> list[int]:
    """vLLM's generated token ids (the completions API returns token strings)."""
    ids = []
    for tok in res["tokens"]:
        if tok.startswith("token_id:"):
            ids.append(int(tok.split(":", 1)[1]))
        else:
            ids.append(tokenizer.convert_tokens_to_ids(tok))
    return ids


def test_first_k_cartridge_matches_recompute_and_comes_from_lmcache(server, hf, engine_kv, tmp_path):
    """A first-k cartridge as `create` makes it (its KV computed by vLLM itself through LMCache's
    store path, `tools.engine_kv`), served: the plain prompt's answer, token for token and logprob
    for logprob (KV bytes are vLLM's own, so nothing but the load path can move them)."""
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.tools.testmodel import document_text

    model, tok = hf
    cart = create_first_k(server.model_dir, document_text(), max_tokens=2 * CHUNK,
                          model_and_tokenizer=(model, tok), engine=engine_kv(server.model_dir))
    assert len(cart.token_ids) == 2 * CHUNK
    assert cart.provenance["kv_computed_by"]["engine"] == "vllm"
    prompt = cart.token_ids + user_ids(tok)

    ext0 = server.external_tokens()
    base = server.complete(prompt)                      # nothing registered: all computed
    assert server.external_tokens() == ext0

    pack_kv(cart.kv, tmp_path / "fk", cartridge_id="e2e-first-k", model=server.model,
            kind="first_k", token_ids=cart.token_ids, chunk_size=CHUNK)
    server.register(tmp_path / "fk")
    got = server.complete(prompt)
    loaded = server.external_tokens() - ext0
    d = max_diff(base["logprobs"], got["logprobs"])
    print(f"\n[e2e first-k] external tokens {loaded:.0f}, text equal {got['text'] == base['text']}, "
          f"max |dlogprob| {d:.4f}, recompute {base['seconds']:.3f}s vs cartridge {got['seconds']:.3f}s")
    assert loaded == 2 * CHUNK, server.log_tail()     # the 512 cartridge tokens came from LMCache
    # vLLM counts scheduled external tokens even if a load is refused (then recomputed): make
    # sure none was.
    assert "KV load failed" not in server.module_log(), server.log_tail()
    assert got["text"] == base["text"]
    assert d <= FIRST_K_MAX_TOL, (base, got)
    from lmcache_cartridge.vllm import native

    if native.openmp() and server.cpu_kv_threads > 1:  # the worker's OpenMP threads copied it
        # logged once per process, when a copy first splits: an earlier module may have caused it
        assert f"native KV copy split over {server.cpu_kv_threads} threads (OpenMP: True)" in server.log_since(0), \
            server.log_tail()



@pytest.mark.long  # one more start of the maker's server
def test_a_kv_maker_whose_server_died_starts_a_new_one_with_the_same_kv(server, hf, engine_kv):
    """The KV maker is long-lived (a session's, a `create` run's): its server killed (SIGKILL, as
    the OOM killer does), the next prefix starts a new server instead of failing with the dead
    one's exit forever (CI's stop 41: one failed start, 7 errors in later modules), and the new
    server computes the same bytes."""
    import os
    import signal

    from lmcache_cartridge.tools.testmodel import document_text

    _, tok = hf
    maker = engine_kv(server.model_dir)
    ids = list(tok(document_text(), add_special_tokens=False)["input_ids"])[:300]
    before = maker.prefix_kv(ids)
    relaunches, dead = maker.relaunches, maker.server
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(timeout=30)
    after = maker.prefix_kv(ids)
    assert maker.relaunches == relaunches + 1 and maker.server is not dead and maker.server.alive()
    assert after.shape == before.shape == (2, 2, 300, 2, 64)
    assert torch.equal(after, before)

def _trained_kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, CHUNK, 2, 64, generator=g).to(torch.bfloat16)  # [2, L, T, H, D]


def test_trained_cartridge_matches_hf_and_altered_kv_changes_output(server, hf, tmp_path):
    from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv

    model, tok = hf
    user = user_ids(tok)
    vocab = VocabInfo(model.config.vocab_size, (0, 1, 2, 3))
    kv = _trained_kv(7)
    swapped = kv[:, :, :, [1, 0]].contiguous()          # K/V heads swapped: the layout trap

    pack_kv(kv, tmp_path / "tr", cartridge_id="e2e-trained", model=server.model, kind="trained",
            vocab=vocab, chunk_size=CHUNK)
    pack_kv(swapped, tmp_path / "tr-swapped", cartridge_id="e2e-trained-swapped", model=server.model,
            kind="trained", vocab=vocab, chunk_size=CHUNK)
    ids = PackedCartridge(tmp_path / "tr").manifest.token_ids
    ids_sw = PackedCartridge(tmp_path / "tr-swapped").manifest.token_ids
    assert ids != ids_sw
    server.register(tmp_path / "tr")
    server.register(tmp_path / "tr-swapped")

    ext0 = server.external_tokens()
    got = server.complete(ids + user)
    assert server.external_tokens() - ext0 == CHUNK, server.log_tail()
    assert "KV load failed" not in server.module_log(), server.log_tail()
    gen = token_ids_of(server, tok, got)

    greedy_bf16, lp_bf16, best_bf16 = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
    model.to(torch.bfloat16)
    lp = got["logprobs"]
    print(f"\n[e2e trained] vLLM vs HF bf16: max |dlogprob| {max_diff(lp, lp_bf16):.4f} mean "
          f"{mean_diff(lp, lp_bf16):.4f}; vs HF fp32: max {max_diff(lp, lp_fp32):.4f} mean "
          f"{mean_diff(lp, lp_fp32):.4f}; HF bf16 vs fp32 max {max_diff(lp_bf16, lp_fp32):.4f}; "
          f"greedy equal to HF bf16: {gen == greedy_bf16}")
    print(f"[e2e trained] vLLM {[round(x, 3) for x in lp]}\n[e2e trained] HF   {[round(x, 3) for x in lp_bf16]}")
    assert min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)) <= HF_MEAN_TOL
    assert min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32)) <= HF_MAX_TOL
    assert all(b - c <= HF_MAX_TOL for b, c in zip(best_bf16, lp_bf16)), (gen, greedy_bf16)

    # Negative control: the swapped cartridge is loaded too; its output follows ITS KV (close to
    # HF given the swapped KV) and is far from the unaltered KV's reference.
    ext1 = server.external_tokens()
    neg = server.complete(ids_sw + user)
    assert server.external_tokens() - ext1 == CHUNK
    gen_neg = token_ids_of(server, tok, neg)
    _, lp_neg_own, _ = hf_teacher_forced(model, swapped, user, gen_neg, torch.bfloat16)
    _, lp_neg_orig, _ = hf_teacher_forced(model, kv, user, gen_neg, torch.bfloat16)
    own, orig = mean_diff(neg["logprobs"], lp_neg_own), mean_diff(neg["logprobs"], lp_neg_orig)
    print(f"[e2e negative] swapped-heads cartridge: text changed {neg['text'] != got['text']}; mean "
          f"|dlogprob| vs HF(swapped KV) {own:.4f}, vs HF(original KV) {orig:.4f}")
    assert neg["text"] != got["text"]
    assert own <= HF_MEAN_TOL
    assert orig >= NEG_MIN_MEAN


def test_noise_floor_vllm_vs_hf_without_cartridge(server, hf):
    """Reference point for the tolerances: vLLM vs HF on a plain prompt, nothing from LMCache."""
    model, tok = hf
    g = torch.Generator().manual_seed(5)
    prompt = [1] + torch.randint(4, model.config.vocab_size, (CHUNK + 30,), generator=g).tolist()
    ext0 = server.external_tokens()
    got = server.complete(prompt)
    assert server.external_tokens() == ext0
    gen = token_ids_of(server, tok, got)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt + gen[:-1]]))
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1:].float(), dim=-1)
    ref = [float(logp[i, t]) for i, t in enumerate(gen)]
    print(f"\n[e2e noise floor] vLLM vs HF bf16, plain prompt: max |dlogprob| "
          f"{max_diff(got['logprobs'], ref):.4f} mean {mean_diff(got['logprobs'], ref):.4f}")
    assert mean_diff(got["logprobs"], ref) <= HF_MEAN_TOL


def test_kv_stored_by_vllm_reloads_through_cpu_connector(server, hf):
    """from_gpu then to_gpu on the real paged layout: a prompt stored by LMCache (not a cartridge)
    is loaded back on the second request and gives the same output."""
    model, tok = hf
    g = torch.Generator().manual_seed(3)
    prompt = [1] + torch.randint(4, model.config.vocab_size, (CHUNK + 40,), generator=g).tolist()
    ext0 = server.external_tokens()
    first = server.complete(prompt, skip_save=False)
    assert server.external_tokens() == ext0
    second = server.complete(prompt, skip_save=True)
    assert server.external_tokens() - ext0 == CHUNK, server.log_tail()
    d = max_diff(first["logprobs"], second["logprobs"])
    print(f"\n[e2e store/reload] max |dlogprob| {d:.4f}")
    assert second["text"] == first["text"]
    assert d <= FIRST_K_MAX_TOL


def test_engine_survived_and_logged(server):
    assert server.proc.poll() is None
    log = server.module_log()  # this module's requests (a pooled server's log has other modules' too)
    assert "EngineDeadError" not in log and "Traceback" not in log, server.log_tail(120)
    assert "KV load failed" not in log and "refusing vLLM CPU KV layout" not in server.log_text()
    assert "kv_load_failure_policy 'fail' -> 'recompute'" in server.log_text()
