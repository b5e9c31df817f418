"""The quality suite's data and scoring, shared by `quality.py`, `quality_probe.py`,
`quality_scale.py`, `teacher_window.py` and `tests/test_quality_scoring.py`: the documents and
questions (`benchmarks/quality/`), fact matching, the arms, making first-k and init cartridges,
training one, asking through the gateway, the HF reference log-likelihood and greedy decoding
with a cartridge's KV. `benchmarks/quality.py`'s docstring says what each arm is. Runs in the
benchmark's process; the servers and trainers it starts are its children.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from harness import CLI, ROOT
from harness.stats import percentile

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


def make_first_k(model_dir: Path, carts: Path, sizes: tuple[int, ...] = (256, 512)) -> None:
    """First-k cartridges of document A (`fk<size>`, one per size), KV computed by vLLM
    (`create`'s default), one maker."""
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.engine_kv import EngineKVMaker

    todo = [k for k in sizes if not (carts / f"fk{k}" / "manifest.json").exists()]
    if not todo:
        return
    with EngineKVMaker(model_dir, carts.parent / "kv-maker") as maker:
        for k in todo:
            made = create_first_k(model_dir, document("a"), max_tokens=k, engine=maker)
            pack_kv(made.kv, carts / f"fk{k}", cartridge_id=f"qa-fk{k}", model=str(model_dir), kind="first_k",
                    token_ids=made.token_ids, chunk_size=CHUNK, provenance=made.provenance, overwrite=True)


def init_suffix(init: str, first: int = 1) -> str:
    """The name suffix of a start other than first-k (`train --init attention`): `_attn`, or
    `_attn<first>` where it keeps the document's first `first` tokens; empty for first-k."""
    return "" if init == "first_k" else "_attn" + ("" if first == 1 else str(first))


def make_init(model_dir: Path, carts: Path, tokens: int = 256, init: str = "first_k", first: int = 1) -> None:
    """The KV training starts from (`train --init`: PEFT's first-k initialisation by default),
    packed as a trained cartridge: `init<tokens>`; `init<tokens>_attn` for the attention start,
    `init<tokens>_attn<first>` for one keeping the first `first` tokens."""
    import torch

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registration import load_vocab
    from lmcache_cartridge.tools.selfstudy.loop import build_student
    from lmcache_cartridge.tools.selfstudy.run import export_kv, load_for_training

    name = f"init{tokens}" + init_suffix(init, first)
    out = carts / name
    if (out / "manifest.json").exists():
        return
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    student = build_student(model, tok, document("a"), tokens, 1, init=init, init_first=first)
    pack_kv(export_kv(student), out, cartridge_id="qa-" + name.replace("_", "-"), model=str(model_dir),
            kind="trained", vocab=load_vocab(tok), chunk_size=CHUNK, dtype=torch.bfloat16, overwrite=True,
            provenance={"method": f"{init}_init_of_self_study", "steps": 0})


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
    cmd = [*CLI, "train", "--model-dir", str(model_dir),
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
                  a: argparse.Namespace, *, mp: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Every arm's questions through the gateway to one vLLM on LMCache: the in-process plugin,
    or with `mp` LMCache's MP mode (vLLM on `LMCacheMPConnector`, the cartridge L2 adapter in its
    own `lmcache server`)."""
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import GatewayThread, MpVllmServer, VllmServer, lmcache_config

    registry_db = work / "registry.db"
    registry_db.unlink(missing_ok=True)
    registry = Registry(registry_db)
    ids = sorted({c for arm in the_arms for c in arm.cartridges})
    entries = [registry.register(cartridge_dir(carts, c)) for c in ids]
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    if mp:
        server = MpVllmServer(work / "vllm", str(model_dir), registry=registry_db, cache_dir=cache, max_model_len=4096)
    else:
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


def cartridge_dir(carts: Path, cid: str) -> Path:
    """The directory under `carts` of the cartridge registered as `cid`: by the names this module
    gives (`_dir_of`), else the one whose manifest carries that id (`train --id`)."""
    direct = carts / _dir_of(cid)
    if (direct / "manifest.json").exists():
        return direct
    for man in sorted(carts.glob("*/manifest.json")):
        if json.loads(man.read_text()).get("cartridge_id") == cid:
            return man.parent
    raise FileNotFoundError(f"no cartridge {cid!r} under {carts}")


def _dir_of(cid: str) -> str:
    """The directory under the work dir's `carts/` of a registered id (another name: itself):
    `qa-fk<N>` -> `fk<N>`, `qa-init<N>` -> `init<N>`, `qa-tr<N>` -> `tr<N>`, `qb-tr<N>` -> `trb<N>`,
    a suffix kept (`qa-init512-attn` -> `init512_attn`)."""
    m = re.fullmatch(r"q([ab])-(fk|init|tr)(\d+)((?:-[a-z0-9]+)*)", cid)
    if not m:
        return cid
    doc, kind, n, suffix = m.groups()
    return f"{kind}{'b' if doc == 'b' else ''}{n}{suffix.replace('-', '_')}"


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
            "ttft_p50_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
            # what HF scored is what vLLM was sent: its prompt length (no cartridge; the streamed
            # usage), or every cartridge token loaded from LMCache (vLLM's counter, per arm)
            "prompt_tokens_match": all(r.get("prompt_tokens_match", True) for r in rows),
            "cartridge_tokens_loaded": all(r["arm_external_tokens"] == r["arm_expected_external"] for r in rows)}


def greedy(model, tok, kv, ids: list[int], max_tokens: int) -> str:
    """Greedy continuation of `ids` after `kv` (None: none), stopping at the end-of-turn token."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_to_cache

    past = None if kv is None else kv_to_cache(kv.to(model.dtype).clone(), model.config)
    pos = 0 if kv is None else int(kv.shape[2])
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    out: list[int] = []
    step = list(ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            r = model(input_ids=torch.tensor([step]), past_key_values=past,
                      position_ids=torch.arange(pos, pos + len(step)).unsqueeze(0), use_cache=True)
            past, pos = r.past_key_values, pos + len(step)
            nxt = int(r.logits[0, -1].argmax())
            if nxt in stop:
                break
            out.append(nxt)
            step = [nxt]
    return tok.decode(out, skip_special_tokens=True)
