"""Does a trained cartridge learn what lies beyond its window with more self-study data? The
data-scale curve beside `quality.py`.

For each scale (conversations synthesised per run), `lmcache-cartridge train` trains document A's
256-token (and, with `--tokens 256 512`, 512-token) cartridge for one epoch over fresh
conversations, synthesised by vLLM, as users run it. Each cartridge is asked document A's 40
questions by HF transformers given its KV (the gateway's prompt, greedy, `quality.py`'s scorer:
`quality_probe.probe`'s method, within a question or two of the served counts), and scored by
where each question's fact sits in the document (inside the 256-token window, 256-512, beyond
512). First-k cartridges (vLLM's KV), training's step 0 and the whole document in the prompt
(ICL) are asked the same way beside them.

The coverage report says, per fact, how often the training data carried it: in how many
conversations the fact's evidence lay inside the teacher's window, the synthesised question
stated the fact, and the teacher's answer stated it. A fact the answers never state cannot be
distilled into the cartridge, whatever the scale.

No choice here reads the held-out split: the learning rate (`--lr`, default 2e-3) was chosen on
the dev split (docs/benchmarks.md), and both splits are only reported.

    .venv/bin/python benchmarks/quality_scale.py --scales 128 1024          # make quality-scale's first points
    .venv/bin/python benchmarks/quality_scale.py --scales 4096              # the next point (resumable)
    .venv/bin/python benchmarks/quality_scale.py --scales 8192 --no-baselines --lr-schedule cosine
                                            # the same conversations, a decaying rate (arm trained_256_n8192_cos)
    .venv/bin/python benchmarks/quality_scale.py --scales 2048 --no-baselines --answer-tokens 256
                                            # longer teacher answers (arm trained_256_n2048_a256)
    .venv/bin/python benchmarks/quality_scale.py --scales 2048 --no-baselines --answer-tokens 256 --trim-repeats 16
                                            # the same, answers cut where they loop (arm trained_256_n2048_a256_t16)
    .venv/bin/python benchmarks/quality_scale.py --scales 1024 --no-baselines --autocast bfloat16
                                            # training steps under bf16 autocast (arm trained_256_n1024_bf16)
    .venv/bin/python benchmarks/quality_scale.py --scales 2048 --no-baselines --seed-types question,summarization
                                            # conversations from two seed types only (arm trained_256_n2048_seeds-su-qu)
    .venv/bin/python benchmarks/quality_scale.py --scales --tokens 1024
                                            # the baselines only, first-k 1024 added (arm first_k_1024)
    .venv/bin/python benchmarks/quality_scale.py --no-baselines --serve trained_1024_n2048
                                            # that arm served, both LMCache modes, beside its probe
    .venv/bin/python benchmarks/quality_scale.py --scales 2048 --tokens 512 --init attention --init-first 256
                                            # the attention start keeping 256 first tokens (arms
                                            # init_512_attn256, trained_512_n2048_attn256)
    .venv/bin/python benchmarks/quality_scale.py --scales 2048 --tokens 512 --no-baselines --epochs 2
                                            # a second pass over the same conversations, continuing
                                            # the one-epoch run (arm trained_512_n2048_e2)

Everything is cached in `--work` (default .cache/quality/scale): rerun to resume; results are
merged into `--out`.json/.md (default benchmarks/results/quality/scale), also while another run
writes them (each run keeps the others' arms).

A scale too large for the CPU trains on a GPU machine (`benchmarks/gpu_scale.sh`: `--train-only
--device cuda`, HF + PEFT where vLLM is not installed); its cartridge, metrics and coverage come
back into the work directory, and the same command here (without `--train-only`) asks its
questions as it asks every other arm's: a cartridge already in the work directory is not trained
again.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
import harness.quality as Q
from harness import Arm, Result, load_payload, write_result

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy.config import (AUTOCAST_DTYPES, INITS, LR_SCHEDULES, PLACEMENTS, SEED_TYPES,
                                                      SYNTH_BATCH, one_epoch, parse_seed_types)

WORK = harness.ROOT / ".cache" / "quality" / "scale"
OUT = Q.RESULTS / "scale"
BUCKETS = [name for _, _, name in Q.POSITION_BUCKETS]
assert BUCKETS[-1] == ">=512"  # the table's last bucket column, where `far_facts` follows


ANSWER_TOKENS = 64  # the curve's answer length; other lengths are other arms
LR = 2e-3  # the curve's learning rate (chosen on the dev split); other rates are other arms
BATCH = 8  # the curve's conversations per step; other batch sizes are other arms
WINDOWS = (384, 768)  # the curve's teacher windows (tokens, min and max); others are other sets of conversations


# Two letters per seed prompt type, for names, in SEED_TYPES order: `_seeds-su-qu` is summarization
# and question only.
SEED_CODES = {"structuring": "st", "summarization": "su", "question": "qu", "use_case": "uc", "creative": "cr"}
assert tuple(SEED_CODES) == SEED_TYPES


def scale_key(n: int, answer_tokens: int, seed_types: tuple[str, ...] = SEED_TYPES,
              windows: tuple = WINDOWS, seed: int = 0) -> str:
    """One set of conversations: `8192`; `2048_a256` for answers of up to 256 tokens;
    `2048_w128-256` for teacher windows of 128-256 tokens; `2048_tile` for windows that tile
    the document (`windows` (min, max, "tile"); train's --window-placement); `2048_seeds-su-qu`
    for conversations drawn from some seed types only; `2048_s1` for another draw (train's
    --seed picks the windows, seed prompts and samples)."""
    lo, hi, *placement = windows
    return (f"{n}" + ("" if answer_tokens == ANSWER_TOKENS else f"_a{answer_tokens}")
            + ("" if (lo, hi) == WINDOWS else f"_w{lo}-{hi}") + "".join(f"_{p}" for p in placement if p != "even")
            + ("" if tuple(seed_types) == SEED_TYPES else "_seeds-" + "-".join(SEED_CODES[t] for t in seed_types))
            + (f"_s{seed}" if seed else ""))


def scale_title(key: str) -> str:
    """`2048_a256_w128-256_seeds-su-qu` as "2048 conversations, answers up to 256 tokens,
    windows of 128-256 tokens, seed types summarization, question"."""
    n, *parts = key.split("_")
    names = {c: t for t, c in SEED_CODES.items()}
    words = [f"{n} conversations"]
    for part in parts:
        if part.startswith("seeds-"):
            words.append("seed types " + ", ".join(names[c] for c in part.removeprefix("seeds-").split("-")))
        elif re.fullmatch(r"s\d+", part):
            words.append(f"seed {part[1:]}")
        elif part == "tile":
            words.append("windows tiling the document")
        elif part.startswith("w"):
            words.append(f"windows of {part[1:]} tokens")
        elif part.startswith("a"):
            words.append(f"answers up to {part[1:]} tokens")
    return ", ".join(words)


def run_name(tokens: int, n: int, schedule: str, answer_tokens: int = ANSWER_TOKENS,
             autocast: str | None = None, trim_repeats: int = 0, seed_types: tuple[str, ...] = SEED_TYPES,
             lr: float = LR, batch_size: int = BATCH,
             windows: tuple = WINDOWS, question_loss: bool = True, anchor: float = 0.0, init: str = "first_k",
             init_first: int = 1, epochs: int = 1, seed: int = 0, frozen: int = 1) -> str:
    """The cartridge's name in the work directory (`tr256_n8192`; `_a256` for answers of up to
    256 tokens, `_w128-256` for teacher windows of 128-256 tokens, `_seeds-su-qu` for
    conversations from some seed types only, `_lr0.004` for another rate than the curve's,
    `_b64` for 64 conversations per step, `_ans` for a loss over answer tokens only (the curve's
    scores question and answer tokens), `_anc10` for a pull toward the first-k start, `_cos`
    for a cosine schedule, `_t16` for answers trimmed where they repeat a run of 16 tokens,
    `_bf16` for steps under bf16 autocast, `_attn` for the attention start instead of first-k,
    `_attn256` for the attention start keeping the first 256 tokens, `_f256` for the first 256
    positions kept fixed (the curve's: the attention sink only), `_e2` for two epochs over the
    conversations; `_s1` in the conversations' key for another draw: `scale_key`)."""
    return (f"tr{tokens}_n{scale_key(n, answer_tokens, seed_types, windows, seed)}" + ("" if lr == LR else f"_lr{lr:g}")
            + ("" if batch_size == BATCH else f"_b{batch_size}") + ("" if question_loss else "_ans")
            + (f"_anc{anchor:g}" if anchor else "")
            + ("" if schedule == "constant" else f"_{schedule[:3]}")
            + (f"_t{trim_repeats}" if trim_repeats else "") + ("" if autocast is None else "_bf16")
            + Q.init_suffix(init, init_first) + ("" if frozen == 1 else f"_f{frozen}")
            + ("" if epochs == 1 else f"_e{epochs}"))


def windows(a: argparse.Namespace) -> tuple:
    """The teacher windows of `a`: (min, max), and their placement unless the curve's ("even")."""
    return (a.window_min, a.window_max) + (() if a.window_placement == "even" else (a.window_placement,))


def conversations_key(n: int, a: argparse.Namespace) -> str:
    """The key of the conversations `a`'s settings synthesise at scale `n` (`scale_key`)."""
    return scale_key(n, a.answer_tokens, a.seed_types, windows(a), a.seed)


def data_run(n: int, a: argparse.Namespace) -> str:
    """The run that synthesises the conversations of `a`'s settings at scale `n` (the curve's
    256-token cartridge); other runs on them copy its data."""
    return run_name(256, n, "constant", a.answer_tokens, seed_types=a.seed_types, windows=windows(a), seed=a.seed)


# What a run's name adds after its conversations' key: training settings only (`run_name`).
TRAINING_SUFFIXES = r"(_lr[0-9.e+-]+|_b\d+|_ans|_anc[0-9.e+-]+|_cos|_t\d+|_bf16|_attn\d*|_f\d+|_e\d+)*"


def data_of(carts: Path, n: int, a: argparse.Namespace) -> Path | None:
    """The synthesised conversations of `a`'s settings at scale `n` already in `carts`: the data
    run's, else those of any run on the same conversations (another rate, anchor, ...), else None."""
    key = conversations_key(n, a)
    for work in [carts / f"{data_run(n, a)}.train", *sorted(carts.glob("tr*.train"))]:
        m = re.fullmatch(r"tr\d+_n(.+?)" + TRAINING_SUFFIXES + r"\.train", work.name)
        if m and m.group(1) == key and (work / "data.pt").exists():
            return work / "data.pt"
    return None


def coverage_key(run: str, n: int, a: argparse.Namespace, reports: dict[str, Any]) -> str | None:
    """The key under which run `run` (at scale `n`, settings `a`) reports its conversations'
    coverage: the data run's always, another run's only while no report on them exists."""
    key = conversations_key(n, a)
    return key if run == data_run(n, a) or key not in reports else None


def continue_run(carts: Path, name: str, work: Path, a: argparse.Namespace) -> None:
    """`--epochs E` at a constant rate continues the run of the same settings with the most epochs
    under E from its last checkpoint (train resumes a work directory whose steps grew; the batch
    of a step is a pure function of the seed and the step, so the result is a run of E epochs
    from the start): its data, checkpoint and metrics copied into `work`, its training time kept
    in `wall_before_s`. Nothing where `work` has a checkpoint already or no such run exists."""
    if a.epochs == 1 or a.lr_schedule != "constant" or (work / "checkpoint.pt").exists():
        return
    base = name.removesuffix(f"_e{a.epochs}")
    runs = [carts / f"{base}{'' if e == 1 else f'_e{e}'}.train" for e in range(a.epochs - 1, 0, -1)]
    src = next((r for r in runs if (r / "checkpoint.pt").exists()), None)
    if src is None:
        return
    work.mkdir(parents=True, exist_ok=True)
    for f in ("data.pt", "checkpoint.pt", "metrics.jsonl"):
        shutil.copy(src / f, work / f)
    walls = [float((src / f).read_text()) for f in ("wall_s", "wall_before_s") if (src / f).exists()]
    if walls:
        (work / "wall_before_s").write_text(f"{sum(walls):.1f}")


def train(model_dir: Path, carts: Path, n: int, tokens: int, a: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """One epoch over `n` fresh conversations (`train`'s default steps; `--epochs`); other runs on the same
    conversations (512 tokens, another rate, anchor or schedule, trimmed answers, autocast) reuse
    the data of a run on the same conversations (`data_of`: same scale, answer length, windows and
    seed types)."""
    name = run_name(tokens, n, a.lr_schedule, a.answer_tokens, a.autocast, a.trim_repeats, a.seed_types, a.lr,
                    a.batch_size, windows(a), a.question_loss, a.anchor, a.init,
                    a.init_first, a.epochs, a.seed, a.frozen_tokens)
    out, work = carts / name, carts / f"{name}.train"
    if not (out / "manifest.json").exists():
        continue_run(carts, name, work, a)
        first = None if (work / "data.pt").exists() else data_of(carts, n, a)
        if first is not None:
            work.mkdir(parents=True, exist_ok=True)
            shutil.copy(first, work / "data.pt")
        text = carts.parent / "doc_a.txt"
        text.write_text(Q.document("a"), encoding="utf-8")
        cmd = [*harness.CLI, "train", "--model-dir", str(model_dir),
               "--model", str(model_dir), "--text", str(text), "-o", str(out), "--id", f"qa-{name}".replace("_", "-"),
               "--tokens", str(tokens), "--work-dir", str(work), "--overwrite", "-q",
               "--conversations", str(n), "--heldout", str(a.heldout), "--batch-size", str(a.batch_size),
               "--lr", str(a.lr), "--lr-schedule", a.lr_schedule, "--anchor", str(a.anchor), "--init", a.init,
               "--init-first", str(a.init_first), "--frozen-tokens", str(a.frozen_tokens),
               "--steps", str(a.epochs * one_epoch(n, a.batch_size)),
               "--eval-every", str(max(1, n // a.batch_size // 4)), "--save-every", "10",
               "--question-tokens", str(a.question_tokens), "--answer-tokens", str(a.answer_tokens),
               "--window-min", str(a.window_min), "--window-max", str(a.window_max),
               "--window-placement", a.window_placement, "--seed", str(a.seed),
               "--synth-backend", a.synth_backend, "--synth-batch", str(a.synth_batch), "--device", a.device,
               # the curve trains in fp32 on every device (train's CUDA default is bf16)
               "--dtype", "float32"] + (["--synth-eager"] if a.synth_eager else []) \
            + (["--threads", str(a.threads)] if a.threads else []) \
            + (["--autocast", a.autocast] if a.autocast else []) + ["--trim-repeats", str(a.trim_repeats)] \
            + ["--seed-types", ",".join(a.seed_types)] + ([] if a.question_loss else ["--no-question-loss"])
        print("[scale] " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        (work / "wall_s").write_text(f"{time.perf_counter() - t0:.1f}")
    summary = Q._train_summary(out, work)
    wall = work / "wall_s"
    before = work / "wall_before_s"  # a continued run's time includes its first epochs'
    summary["wall_s"] = (round(float(wall.read_text()) + (float(before.read_text()) if before.exists() else 0.0), 1)
                         if wall.exists() else None)
    return out, summary


def cartridge_hash(cart: Path) -> str:
    """The cartridge's identity: its manifest's `content_hash` (made from its chunks' sha256)."""
    return json.loads((cart / "manifest.json").read_text())["content_hash"]


def asked_from(result: dict[str, Any] | None, content_hash: str) -> bool:
    """Whether an arm's recorded answers came from the cartridge of this `content_hash`. A result
    kept from another machine or another draw of conversations (a fresh work directory trains
    its cartridge again under the same name) or one that recorded no hash is not."""
    return result is not None and result.get("content_hash") == content_hash


def ask_all(model, tok, pb, arm: Q.Arm, carts: Path, qs: list[Q.Question], pos: dict[str, int],
            max_tokens: int) -> dict[str, Any]:
    """Every question of `qs` under `arm`: rows and facts stated per split and position bucket."""
    rows = []
    for q in qs:
        kv, ids = Q.hf_prompt(pb, tok, arm, q, carts)
        text = Q.greedy(model, tok, kv, ids, max_tokens)
        ll = Q.reference_loglik(model, tok, kv, ids, q.answer, q.fact)
        rows.append({"id": q.id, "split": q.split, "bucket": Q.bucket(pos[q.id]), "text": text,
                     "correct": Q.fact_found(q.fact, text), **ll})
    return {"rows": rows, **tally(rows)}


def add_loglik(model, tok, pb, arm: Q.Arm, carts: Path, qs: list[Q.Question], result: dict[str, Any]) -> None:
    """The reference answers' log-likelihoods for rows asked before they were recorded."""
    by_id = {q.id: q for q in qs}
    for r in result["rows"]:
        if "ll_answer" not in r:
            q = by_id[r["id"]]
            kv, ids = Q.hf_prompt(pb, tok, arm, q, carts)
            r.update(Q.reference_loglik(model, tok, kv, ids, q.answer, q.fact))
    result.update(tally(result["rows"]))


def ll_fact(rows: list[dict[str, Any]]) -> float | None:
    """Mean log-likelihood per token of the reference facts of `rows` (None before it was recorded)."""
    xs = [r["ll_fact"] for r in rows if "ll_fact" in r]
    return round(sum(xs) / len(xs), 3) if xs else None


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def count(sel):
        return [sum(r["correct"] for r in sel), len(sel)]

    return {"facts": count(rows), "dev": count([r for r in rows if r["split"] == "dev"]),
            "heldout": count([r for r in rows if r["split"] == "heldout"]),
            "by_position": {b: count([r for r in rows if r["bucket"] == b]) for b in BUCKETS},
            # mean log-likelihood per token of the reference fact's tokens: moves before a fact is stated
            "ll_fact_by_position": {b: ll_fact([r for r in rows if r["bucket"] == b]) for b in BUCKETS}}


SERVE_MODES = ("plugin", "mp")  # LMCache's in-process storage plugin, and its MP server


def served_tally(rows: list[dict[str, Any]], got: list[dict[str, Any]], qs: list[Q.Question]) -> dict[str, Any]:
    """Served answers (`got`, one per question) scored as the probe's `rows` are (`fact_found`), by
    split and position, with the questions where served and probe disagree and the cartridge
    tokens vLLM took from LMCache for the arm (its own counter)."""
    facts = {q.id: q.fact for q in qs}
    probe = {r["id"]: r for r in rows}
    served = [{**probe[g["id"]], "text": g["text"], "correct": Q.fact_found(facts[g["id"]], g["text"])} for g in got]
    t = tally(served)
    return {"facts": t["facts"], "dev": t["dev"], "heldout": t["heldout"], "by_position": t["by_position"],
            "differ": [r["id"] for r in served if r["correct"] != probe[r["id"]]["correct"]],
            "cartridge_tokens_loaded": got[0].get("arm_external_tokens") if got else None,
            "answers": {r["id"]: r["text"] for r in served}}


COVERAGE_NAME = "coverage.json"  # beside the run's data.pt: the report, kept where the data cannot travel


def coverage(tok, data_pt: Path, qs: list[Q.Question], pos: dict[str, int]) -> dict[str, Any]:
    """Per fact: conversations whose window held its evidence, whose question or answer stated it.
    Computed once from `data_pt` and kept beside it (`COVERAGE_NAME`): a run trained on another
    machine brings back the report, not its data."""
    kept = data_pt.with_name(COVERAGE_NAME)
    if kept.exists():
        return json.loads(kept.read_text())
    report = coverage_of(tok, data_pt, qs, pos)
    kept.write_text(json.dumps(report))
    return report


def coverage_of(tok, data_pt: Path, qs: list[Q.Question], pos: dict[str, int]) -> dict[str, Any]:
    import torch

    data = torch.load(data_pt, map_location="cpu", weights_only=True)["train"]
    body_offset = 0  # windows index the document body (no BOS), as `evidence_position` does
    answers = [tok.decode(d["answer"], skip_special_tokens=True) for d in data]
    out = {}
    for q in qs:
        p = pos[q.id] - body_offset
        out[q.id] = {"bucket": Q.bucket(pos[q.id]), "split": q.split,
                     "in_window": sum(d["window"][0] <= p < d["window"][1] for d in data),
                     "question": sum(Q.fact_found(q.fact, d["question"]) for d in data),
                     "answer": sum(Q.fact_found(q.fact, t) for t in answers)}
    return {"conversations": len(data), "facts": out, "by_seed_type": by_seed_type(data, answers, qs, pos)}


def by_seed_type(data: list[dict[str, Any]], answers: list[str], qs: list[Q.Question],
                 pos: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per seed prompt type, over the dev facts beyond 512 tokens only (a choice of seed types
    may read it; the held-out facts stay unread): conversations, (conversation, fact) pairs whose
    window held the fact's evidence, and how many of those answers stated the fact."""
    dev = [q for q in qs if q.split == "dev" and Q.bucket(pos[q.id]) == ">=512"]
    out = {t: {"conversations": 0, "windows": 0, "answer": 0} for t in SEED_TYPES}
    for d, text in zip(data, answers):
        row = out[d["seed_type"]]
        row["conversations"] += 1
        for q in dev:
            if d["window"][0] <= pos[q.id] < d["window"][1]:
                row["windows"] += 1
                row["answer"] += Q.fact_found(q.fact, text)
    return out


def first_k_sizes(a: argparse.Namespace) -> tuple[int, ...]:
    """The first-k baselines' sizes: 256 and 512 tokens, and every trained size (`--tokens`), so
    each trained cartridge has the first-k cartridge of its own size beside it."""
    return tuple(sorted({256, 512, *a.tokens}))


def attention_starts(a: argparse.Namespace) -> tuple[int, ...]:
    """Sizes whose attention start (`train --init attention`, step 0) is a baseline: each trained
    size of an `--init attention` run."""
    return tuple(sorted(set(a.tokens))) if a.init == "attention" else ()


def arm_source(name: str) -> tuple[str, str | None]:
    """(kind, cartridge id) an arm answers from: `first_k_<N>` -> first-k `qa-fk<N>`, `init_<N>` ->
    `qa-init<N>` (`init_<N>_attn` -> `qa-init<N>-attn`), `icl` -> none, `trained_<rest>` -> the
    trained cartridge `tr<rest>`."""
    if name == "icl":
        return "icl", None
    if name.startswith("first_k_"):
        return "first_k", "qa-fk" + name.removeprefix("first_k_")
    if name.startswith("init_"):
        return "trained", "qa-init" + name.removeprefix("init_").replace("_", "-")
    return "trained", "tr" + name.removeprefix("trained_")


def kv_sizes(model_dir: Path, tok, pb, qs: list[Q.Question], carts: Path) -> dict[str, int]:
    """What the KV column needs: bytes of bf16 KV per token (K and V, every layer, as `create`
    and `train` pack this model's) and ICL's KV in tokens: the prompt its questions share (the
    system message holding document A), as `quality.py` counts it."""
    from harness.serving import model_info

    icl = Q.Arm("icl", "icl", ("a",))
    shared = Q._common_prefix([Q.hf_prompt(pb, tok, icl, q, carts)[1] for q in qs[:2]]) - 1
    return {"kv_bytes_per_token": model_info(model_dir)["kv_bytes_per_token_bf16"], "icl_tokens": shared}


def kv_tokens(arm: str, icl_tokens: int | None) -> int | None:
    """Tokens of KV an arm answers from: the cartridge's length (`first_k_512`, `init_256`,
    `trained_512_n1024...`), or for ICL the prompt its questions share (`kv_sizes`)."""
    if arm == "icl":
        return icl_tokens
    m = re.match(r"(?:first_k|init|trained)_(\d+)", arm)
    return int(m.group(1)) if m else None


def kv_mib(arm: str, meta: dict[str, Any]) -> str:
    n = kv_tokens(arm, meta.get("icl_tokens"))
    per = meta.get("kv_bytes_per_token")
    return f"{n * per / 2**20:.1f}" if n and per else ""


def machine(m: dict[str, Any]) -> str:
    return f"{m.get('cpu')}, {m.get('nproc')} cores, torch {m.get('torch')}, vLLM {m.get('vllm')}"


# Where a 1,024-token cartridge's window ends: the >=512 column also counts, in brackets, the
# facts past it (the document's last ~740 tokens, where ICL's answers come from).
FAR = 1024


def far_facts(r: dict[str, Any], meta: dict[str, Any]) -> str:
    """' (stated/asked)' for the questions whose evidence lies past `FAR` tokens (positions from
    `meta['evidence_positions']`; blank for a result written without them)."""
    pos = meta.get("evidence_positions") or {}
    far = [row for row in r.get("rows", ()) if pos and pos.get(row["id"], 0) >= FAR]
    return f" ({sum(bool(row['correct']) for row in far)}/{len(far)})" if far else ""


def loaded_tokens(served: dict[str, Any]) -> str:
    n = served.get("cartridge_tokens_loaded")
    return f"{n:,.0f}" if n else ""


def served_section(res: dict[str, Any]) -> list[str]:
    """The arms asked through vLLM + LMCache + the gateway (`--serve`) beside the HF probe."""
    rows = [(name, mode, r, s) for name, r in res["arms"].items() for mode, s in (r.get("served") or {}).items()]
    if not rows:
        return []
    out = ["", "## Served: vLLM + LMCache + the gateway, against the HF probe", "",
           "| arm | LMCache mode | probe facts | served facts | dev | held-out | <256 | 256-512 | >=512 | "
           "questions where they differ | cartridge tokens loaded |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, mode, r, s in rows:
        cells = [f"{c[0]}/{c[1]}" for c in (r["facts"], s["facts"], s["dev"], s["heldout"],
                                             *(s["by_position"][b] for b in BUCKETS))]
        out.append(f"| {name} | {mode} | " + " | ".join(cells)
                   + f" | {', '.join(s['differ']) or 'none'} | {loaded_tokens(s)} |")
    return out


def markdown(res: dict[str, Any]) -> str:
    def f(c):
        return f"{c[0]}/{c[1]}"

    def ll(r, b):
        x = (r.get("ll_fact_by_position") or {}).get(b)
        return "" if x is None else f"{x:.2f}"

    def dev_ll(r, b):  # the split a choice of settings may read
        x = ll_fact([row for row in r.get("rows", ()) if row["split"] == "dev" and row["bucket"] == b])
        return "" if x is None else f"{x:.2f}"

    def wall(t):  # a run trained on a GPU says so (its wall time is that machine's)
        return f"{t.get('wall_s') or ''}" + (f" ({t['device']})" if str(t.get("device")).startswith("cuda") else "")

    lines = [f"# Data scale: {res['meta']['command']}", "",
             f"{machine(res['meta']['machine'])}; lr {LR:g}, batch {BATCH} (where an arm's name says no "
             "other: `_lr`, `_b`), loss over question and answer tokens (`_ans`: answers only), no pull toward "
             "the start (`_anc<A>`: `train --anchor A`), first-k start (`_attn`: `train --init attention`), "
             "the first position fixed (`_f<N>`: `train --frozen-tokens N`), "
             "one epoch (`_e<E>`: E), the conversations of seed 0 (`_s<S>`: `train --seed S`); "
             f"HF probe of document A's 40 questions (greedy); >=512 (>={FAR}): the facts past 512 tokens, "
             f"in brackets those past {FAR:,}.", "",
             f"| arm | KV MiB | conversations | facts | dev | held-out | <256 | 256-512 | >=512 (>={FAR}) | "
             "LL fact <256 / >=512 | dev LL fact <256 / >=512 | held-out KL init -> final | train wall s |",
             "|---|" + "---:|" * 12]
    for name, r in res["arms"].items():
        t = r.get("training") or {}
        kl = t.get("heldout_kl") or {}
        klt = f"{kl.get('init'):.3f} -> {kl.get('final'):.3f}" if kl.get("init") is not None else ""
        lines.append(f"| {name} | {kv_mib(name, res['meta'])} | {r.get('conversations', '')} | "
                     f"{f(r['facts'])} | {f(r['dev'])} | {f(r['heldout'])} | "
                     + " | ".join(f(r["by_position"][b]) for b in BUCKETS) + far_facts(r, res["meta"])
                     + f" | {ll(r, '<256')} / {ll(r, '>=512')} | {dev_ll(r, '<256')} / {dev_ll(r, '>=512')} | "
                     f"{klt} | {wall(t)} |")
    lines += served_section(res)
    for key, cov in sorted(res.get("coverage", {}).items(), key=lambda kv: (int(kv[0].split("_")[0]), kv[0])):
        facts = cov["facts"]
        lines += ["", f"## Coverage at {scale_title(key)} (facts beyond 512 tokens)", "",
                  "| question | window held the evidence | question stated the fact | answer stated the fact |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {qid} ({c['split']}) | {c['in_window']} | {c['question']} | {c['answer']} |"
                  for qid, c in facts.items() if c["bucket"] == ">=512"]
        beyond = [c for c in facts.values() if c["bucket"] == ">=512"]
        lines.append(f"| **{len(beyond)} facts** | {sum(c['in_window'] for c in beyond)} | "
                     f"{sum(c['question'] for c in beyond)} | {sum(c['answer'] for c in beyond)} |")
        if cov.get("by_seed_type"):
            lines += ["", "By seed prompt type, dev facts beyond 512 tokens only:", "",
                      "| seed type | conversations | window held a fact's evidence | answer stated it | rate |",
                      "|---|---:|---:|---:|---:|"]
            lines += [f"| {t} | {r['conversations']} | {r['windows']} | {r['answer']} | "
                      f"{r['answer'] / r['windows'] if r['windows'] else 0:.3f} |"
                      for t, r in cov["by_seed_type"].items() if r["conversations"]]
    return "\n".join(lines) + "\n"


def train_only(model_dir: Path, carts: Path, qs: list[Q.Question], a: argparse.Namespace) -> int:
    """`--train-only`: each scale's cartridges trained and its coverage report written, nothing asked."""
    from lmcache_cartridge.tools.selfstudy.run import load_tokenizer

    tok = load_tokenizer(model_dir)
    pos = {q.id: Q.evidence_position(tok, Q.document("a"), q.evidence) for q in qs}
    for n in a.scales:
        for tokens in a.tokens:
            cart, summary = train(model_dir, carts, n, tokens, a)
            if cart.name == data_run(n, a):
                coverage(tok, carts / f"{cart.name}.train" / "data.pt", qs, pos)
            print(f"[scale] trained {cart.name}: {summary['steps']} steps, held-out KL {summary['heldout_kl']}, "
                  f"{summary['wall_s']} s", flush=True)
    return 0


def seed_types_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_seed_types(text)
    except CartridgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", type=int, nargs="*", default=[128, 1024],
                    help="conversations per trained arm (none: the baselines only, e.g. first-k of a new --tokens)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256])
    ap.add_argument("--lr", type=float, default=LR,
                    help=f"train's --lr (default {LR:g}, the curve's; another names its arms _lr<rate>)")
    ap.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                    help="train's --lr-schedule (a cosine run's arm and cartridge are named with _cos)")
    ap.add_argument("--autocast", choices=AUTOCAST_DTYPES,
                    help="train's --autocast (arms and cartridges named with _bf16; the same conversations)")
    ap.add_argument("--trim-repeats", type=int, default=0, metavar="N",
                    help="train's --trim-repeats (arms and cartridges named with _tN; the same conversations)")
    ap.add_argument("--seed-types", type=seed_types_arg, default=SEED_TYPES, metavar="TYPES",
                    help="train's --seed-types (other conversations: arms, cartridges and coverage named "
                    "with _seeds-<codes>, two letters per type)")
    ap.add_argument("--anchor", type=float, default=0.0, metavar="A",
                    help="train's --anchor: a pull toward the first-k start (arms and cartridges named with "
                    "_anc<A>; the same conversations)")
    ap.add_argument("--init", choices=INITS, default="first_k",
                    help="train's --init: where the KV starts (arms and cartridges named with _attn for "
                    "'attention'; the same conversations)")
    ap.add_argument("--init-first", type=int, default=1, metavar="N",
                    help="train's --init-first (with --init attention; _attn<N> where not 1)")
    ap.add_argument("--frozen-tokens", type=int, default=1, metavar="N",
                    help="train's --frozen-tokens: the first N positions kept at their start (_f<N> where not "
                         "1; the same conversations)")
    ap.add_argument("--epochs", type=int, default=1, metavar="E",
                    help="passes over the conversations (train's --steps: E epochs; arms and cartridges named "
                    "with _e<E>; the same conversations)")
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--no-question-loss", dest="question_loss", action="store_false",
                    help="train's --no-question-loss: score answer tokens only (arms and cartridges named with "
                    "_ans; the same conversations)")
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--question-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                    help=f"longest teacher answer (another length than {ANSWER_TOKENS} names its arms _a<N>)")
    ap.add_argument("--window-min", type=int, default=WINDOWS[0])
    ap.add_argument("--window-max", type=int, default=WINDOWS[1])
    ap.add_argument("--window-placement", choices=PLACEMENTS, default="even",
                    help="train's --window-placement ('tile' names the conversations and arms _tile)")
    ap.add_argument("--seed", type=int, default=0,
                    help="train's --seed: another draw of conversations and batches (named _s<seed>)")
    ap.add_argument("--synth-backend", default="auto", choices=("auto", "vllm", "hf"))
    ap.add_argument("--synth-batch", type=int, default=SYNTH_BATCH,
                    help="train's --synth-batch: conversations per vLLM engine call (1024 on a GPU)")
    ap.add_argument("--synth-eager", action="store_true", help="train's --synth-eager (a faster engine start)")
    ap.add_argument("--device", default="auto", help="train's --device (auto: cuda where present)")
    ap.add_argument("--train-only", action="store_true",
                    help="train the scales' cartridges and write their coverage reports, ask nothing (a GPU "
                    "machine's part: benchmarks/gpu_scale.sh)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for training (0: torch's default)")
    ap.add_argument("--probe-threads", type=int, default=1, help="torch threads for asking the questions (one "
                    "thread per greedy step avoids OpenMP spinning when other jobs share the cores)")
    ap.add_argument("--no-baselines", action="store_true", help="skip first-k, step 0 and ICL")
    ap.add_argument("--loglik", action="store_true", help="no training: add the reference log-likelihoods to the "
                    "arms already asked (their cartridges still in the work directory) and rewrite the report")
    ap.add_argument("--serve", nargs="+", default=[], metavar="ARM",
                    help="no training: ask these arms (asked by the probe already) through vLLM + LMCache + the "
                    "gateway in both LMCache modes (plugin, MP), and record the facts stated beside the probe's")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=OUT)
    return ap


class ScaleRun:
    """One run's asking, phase by phase (`main` calls them in order): the result so far and this
    run's meta (`__init__`), the baselines' cartridges and the model (`load`), then either the
    reference log-likelihoods added to the arms already asked (`add_logliks`), or the baselines
    asked (`ask_baselines`) and each scale trained and asked (`train_and_ask`). Each arm asked is
    saved at once (`probe`): a run stopped midway resumes. Saving merges into the file as it is
    then, so runs side by side (a baseline asked while a long scale trains) keep each other's arms."""

    def __init__(self, a: argparse.Namespace, argv: list[str] | None, model_dir: Path, carts: Path,
                 qs: list[Q.Question]) -> None:
        self.a, self.model_dir, self.carts, self.qs = a, model_dir, carts, qs
        path = a.out.with_suffix(".json")
        # a result of either shape
        self.res = res = load_payload(path) if path.exists() else {"arms": {}, "coverage": {}}
        res.pop("machine", None)
        self.written: dict[str, set[str]] = {"arms": set(), "coverage": set()}  # what this run asked
        command = [".venv/bin/python", "benchmarks/quality_scale.py", *(argv or sys.argv[1:])]
        res["meta"] = {"command": " ".join(command),
                       "machine": harness.machine_info(), "lr": a.lr, "batch_size": a.batch_size,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def save(self) -> None:
        """The result as it stands, JSON and markdown, to `--out`: the file's arms and coverage as
        they are now (another run's included), with this run's in their place."""
        res, a = self.res, self.a
        path = a.out.with_suffix(".json")
        if path.exists():
            now = load_payload(path)
            for key, mine in self.written.items():
                res[key] = {**now.get(key, {}), **{k: res[key][k] for k in mine}}
        arms = [Arm(name=n, count=r["facts"][1], figures={"facts": r["facts"][0]}) for n, r in res["arms"].items()
                if "facts" in r]
        details = {**res, "meta": {k: v for k, v in res["meta"].items() if k != "machine"}}
        write_result(Result(benchmark="quality_scale", machine=res["meta"]["machine"], parameters=vars(a), arms=arms,
                            details=details), a.out.parent, a.out.stem, body=markdown(res))

    def load(self) -> None:
        """The baselines' cartridges (unless `--no-baselines`), the model, its prompt builder, and
        where each question's evidence lies in document A."""
        from lmcache_cartridge.api.prompts import PromptBuilder
        from lmcache_cartridge.cartridge.model_kv import load_model

        if not self.a.no_baselines:
            Q.make_first_k(self.model_dir, self.carts, first_k_sizes(self.a))
            Q.make_init(self.model_dir, self.carts)
            for tokens in attention_starts(self.a):
                Q.make_init(self.model_dir, self.carts, tokens, init="attention", first=self.a.init_first)
        self.model, self.tok = load_model(self.model_dir)
        self.pb = PromptBuilder(self.tok)
        self.res["meta"].update(kv_sizes(self.model_dir, self.tok, self.pb, self.qs, self.carts))
        self.pos = {q.id: Q.evidence_position(self.tok, Q.document("a"), q.evidence) for q in self.qs}
        self.res["meta"]["evidence_positions"] = self.pos

    def probe(self, name: str, arm: Q.Arm, **extra) -> None:
        """Every question under `arm`, recorded as arm `name` (with `extra` beside), and saved."""
        t0 = time.perf_counter()
        r = ask_all(self.model, self.tok, self.pb, arm, self.carts, self.qs, self.pos, self.a.max_tokens)
        m = self.res["meta"]["machine"]  # per arm: one file gathers runs from different CPUs
        self.res["arms"][name] = {**r, **extra, "probe_s": round(time.perf_counter() - t0, 1),
                                  "machine": {k: m[k] for k in ("cpu", "cpu_flags") if k in m}}
        self.written["arms"].add(name)
        print(f"[scale] {name}: facts {r['facts']} by position {r['by_position']}", flush=True)
        self.save()

    def add_logliks(self) -> None:
        """`--loglik`: the reference answers' log-likelihoods added to every arm already asked."""
        for name, r in self.res["arms"].items():
            kind, cid = arm_source(name)
            add_loglik(self.model, self.tok, self.pb, Q.Arm(name, kind, ("a",), (cid,) if cid else ()), self.carts,
                       self.qs, r)
            self.written["arms"].add(name)
            print(f"[scale] {name}: LL of the facts by position {r['ll_fact_by_position']}", flush=True)

    def serve(self) -> None:
        """`--serve`: the named arms (asked by the probe already) through vLLM + LMCache + the
        gateway, in both LMCache modes, scored as the probe is and recorded under `served`."""
        arms = []
        for name in self.a.serve:
            if name not in self.res["arms"]:
                raise CartridgeError(f"arm {name!r} has not been asked here: run its scale first "
                                     f"(asked: {', '.join(self.res['arms'])})")
            kind, cid = arm_source(name)
            if cid:  # the probe names a cartridge by its directory, a request by its registered id
                cid = json.loads((self.carts / Q._dir_of(cid) / "manifest.json").read_text())["cartridge_id"]
            arms.append(Q.Arm(name, kind, ("a",), (cid,) if cid else ()))
        for mode in SERVE_MODES:
            work = self.carts.parent / f"serve-{mode}"
            work.mkdir(parents=True, exist_ok=True)
            answers = Q.serve_and_ask(self.model_dir, work, self.carts, arms, self.qs, self.a, mp=mode == "mp")
            for arm in arms:
                r = self.res["arms"][arm.name]
                r.setdefault("served", {})[mode] = s = served_tally(r["rows"], answers[arm.name], self.qs)
                self.written["arms"].add(arm.name)
                print(f"[scale] {arm.name} served ({mode}): facts {s['facts']} (probe {r['facts']}), differ on "
                      f"{s['differ']}", flush=True)
            self.save()

    def ask_baselines(self) -> None:
        """First-k, step 0 and ICL, each unless already asked (nothing with `--no-baselines`)."""
        if self.a.no_baselines:
            return
        for name in [f"first_k_{k}" for k in first_k_sizes(self.a)] + ["init_256"] \
                + [f"init_{k}" + Q.init_suffix("attention", self.a.init_first) for k in attention_starts(self.a)]:
            if name not in self.res["arms"]:
                kind, cid = arm_source(name)
                self.probe(name, Q.Arm(name, kind, ("a",), (cid,)))
        if "icl" not in self.res["arms"]:
            self.probe("icl", Q.Arm("icl", "icl", ("a",)))

    def train_and_ask(self) -> None:
        """Each scale's cartridges trained (or found trained), the coverage of their conversations
        (from the data run, or from the first run on them), and each cartridge asked unless its
        arm was asked from this very cartridge (`asked_from`)."""
        a, res = self.a, self.res
        for n in a.scales:
            for tokens in a.tokens:
                cart, summary = train(self.model_dir, self.carts, n, tokens, a)
                name = "trained_" + cart.name.removeprefix("tr")
                key = coverage_key(cart.name, n, a, res["coverage"])
                if key:
                    res["coverage"][key] = coverage(self.tok, self.carts / f"{cart.name}.train" / "data.pt",
                                                    self.qs, self.pos)
                    self.written["coverage"].add(key)
                content = cartridge_hash(cart)
                if not asked_from(res["arms"].get(name), content):
                    self.probe(name, Q.Arm(name, "trained", ("a",), (cart.name,)), content_hash=content,
                               conversations=n, training=summary,
                               lr=a.lr, lr_schedule=a.lr_schedule, answer_tokens=a.answer_tokens,
                               autocast=a.autocast, trim_repeats=a.trim_repeats, seed_types=list(a.seed_types),
                               batch_size=a.batch_size, question_loss=a.question_loss, anchor=a.anchor,
                               init=a.init, init_first=a.init_first, frozen_tokens=a.frozen_tokens)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    import torch

    from lmcache_cartridge.tools.realmodel import ensure_real_model

    torch.set_num_threads(a.probe_threads)  # this process only asks; training runs in `train` subprocesses
    carts = a.work.resolve() / "carts"
    carts.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_real_model()
    qs = [q for q in Q.load_questions() if q.doc == "a"]
    if a.train_only:
        return train_only(model_dir, carts, qs, a)
    run = ScaleRun(a, argv, model_dir, carts, qs)
    run.load()
    if a.loglik:
        run.add_logliks()
    elif a.serve:
        run.serve()
    else:
        run.ask_baselines()
        run.train_and_ask()
    run.save()
    print(a.out.with_suffix(".md").read_text())
    return 0

if __name__ == "__main__":
    sys.exit(main())
