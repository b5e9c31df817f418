"""What moves a trained cartridge's fact accuracy? A quick HF-only probe beside `quality.py`.

`quality.py` serves every arm through vLLM + LMCache + the gateway, which is what users get and what
its table reports; one full run takes an hour. To ask *why* trained cartridges state fewer facts
than the first-k cartridge they start from, many training variants are needed, so this probe
skips serving: it asks document A's questions of HF transformers given each cartridge's KV as
`past_key_values`, with the prompt the gateway builds (`quality.hf_prompt`), greedy, and scores
them with `quality.py`'s own scorer (`fact_found`) and its reference log-likelihood. HF and vLLM
are not bit-identical (bf16 kernels), so a probe's count can differ from the served count by a
question or two: `--check` scores the served cartridges too, to show how close it comes.

Variants are trained with `lmcache-cartridge train` as users run it, reusing the synthesized
conversations of the full run (`data.pt`, so only the optimisation differs), resumable: training a
variant to 25 steps, probing it, then to 50 on the same work directory continues from step 25.

    .venv/bin/python benchmarks/quality_probe.py --check                       # served cartridges
    .venv/bin/python benchmarks/quality_probe.py --lr 2e-3 --steps 25 50 100   # one variant, 3 points
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
import harness.quality as Q
from harness import Arm, Result, machine_info, write_result

WORK = harness.ROOT / ".cache" / "quality" / "quality"
OUT = Q.RESULTS / "probe"  # .json, .md


def probe(model, tok, pb, cart: Path, qs: list, max_tokens: int) -> dict[str, Any]:
    """Facts stated and mean reference log-likelihood of document A's questions under `cart`."""
    kind = json.loads((cart / "manifest.json").read_text())["kind"]
    arm = Q.Arm(cart.name, "first_k" if kind == "first_k" else "trained", ("a",), (cart.name,))  # by directory
    correct, ll = 0, []
    for q in qs:
        kv, ids = Q.hf_prompt(pb, tok, arm, q, cart.parent)
        text = Q.greedy(model, tok, kv, ids, max_tokens)
        correct += Q.fact_found(q.fact, text)
        ll.append(Q.reference_loglik(model, tok, kv, ids, q.answer, q.fact)["ll_answer"])
    return {"cartridge": str(cart), "kind": kind, "facts": correct, "asked": len(qs), "ll_answer": sum(ll) / len(ll)}


def train(model_dir: Path, name: str, lr: float, steps: int, tokens: int, a) -> Path:
    """`lmcache-cartridge train` to `steps` on the full run's conversations (resumes)."""
    carts = a.work / "carts"
    out, work = carts / name, carts / f"{name}.train"
    if not (work / "data.pt").exists():
        work.mkdir(parents=True, exist_ok=True)
        shutil.copy(carts / "tr256.train" / "data.pt", work / "data.pt")
    args = Q.train_args(argparse.Namespace(conversations=128, heldout=8, steps=steps, batch_size=8, lr=lr,
                                           eval_every=1000, save_every=5, question_tokens=48, answer_tokens=64,
                                           window_min=384, window_max=768, seed=0, threads=a.threads))
    cmd = [*harness.CLI, "train", "--model-dir", str(model_dir),
           "--model", str(model_dir), "--text", str(a.work / "doc_a.txt"), "-o", str(out), "--id", f"probe-{name}",
           "--tokens", str(tokens), "--work-dir", str(work), "--overwrite", "-q", *args]
    print("[probe] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out


def write(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """This run's probes so far as a result (`probe.json`, `probe.md`)."""
    arms = [Arm(name=r["variant"], count=r["asked"], figures={"facts": r["facts"], "ll_answer": r["ll_answer"]})
            for r in rows]
    table = ["| variant | facts / asked | mean ll(answer) |", "|---|---:|---:|"]
    table += [f"| {r['variant']} | {r['facts']}/{r['asked']} | {r['ll_answer']:.3f} |" for r in rows]
    write_result(Result(benchmark="quality_probe", machine=machine_info(), parameters=vars(a), arms=arms,
                        details={"rows": rows}), OUT.parent, OUT.name,
                 body="# Quality probe: document A's questions under one cartridge\n\n" + "\n".join(table))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="probe the full run's cartridges (fk256, init256, tr256)")
    ap.add_argument("--lr", type=float, help="train a variant at this learning rate")
    ap.add_argument("--steps", type=int, nargs="*", default=[], help="probe the variant at these step counts")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--work", type=Path, default=WORK, help="the full run's work directory (quality.py --work)")
    a = ap.parse_args(argv)

    import torch

    from lmcache_cartridge.api.prompts import PromptBuilder
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.realmodel import ensure_real_model

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = ensure_real_model()
    model, tok = load_model(model_dir)
    pb = PromptBuilder(tok)
    qs = [q for q in Q.load_questions() if q.doc == "a"]
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        print(f"[probe] {json.dumps(row)}", flush=True)
        rows.append({**row, "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        write(rows, a)

    if a.check:
        for name in ("fk256", "init256", "tr256"):
            record({"variant": f"full run: {name}", **probe(model, tok, pb, a.work / "carts" / name, qs, a.max_tokens)})
    for steps in a.steps:
        t0 = time.perf_counter()
        name = f"probe_lr{a.lr:g}_{a.tokens}"
        cart = train(model_dir, name, a.lr, steps, a.tokens, a)
        model.to(torch.bfloat16)
        kl = (json.loads((cart / "manifest.json").read_text()).get("provenance") or {}).get("heldout_kl") or {}
        record({"variant": f"lr {a.lr:g}, {steps} steps", "lr": a.lr, "steps": steps, "heldout_kl": kl.get("final"),
                "train_s": round(time.perf_counter() - t0), **probe(model, tok, pb, cart, qs, a.max_tokens)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
