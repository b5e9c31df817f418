"""How well does the self-study teacher answer with a shorter or longer document window?

Self-study distils the model *with a window of the document in its system prompt* (the teacher)
into the cartridge: a fact the teacher does not state correctly from its window cannot be
learned from it. This asks document A's dev questions (the held-out split is never read) of the
teacher exactly as synthesis prompts it (`synth.system_message` + the question as the user turn,
greedy, `--answer-tokens`), with windows of several lengths that hold the fact's evidence, the
evidence placed near the window's start, middle and end, and scores each answer with
`quality.py`'s `fact_found`. Facts are grouped by where they sit in the document (inside the
first 256 tokens / beyond 512), as in `quality_scale.py`.

    .venv/bin/python benchmarks/teacher_window.py                     # windows 128 256 384 768 and the whole document
    .venv/bin/python benchmarks/teacher_window.py --windows 192 384   # other lengths

Results: benchmarks/results/quality/teacher_window.{md,json}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness
import harness.quality as Q
from harness import Arm, Result, write_result

from lmcache_cartridge.tools.selfstudy.config import SynthConfig
from lmcache_cartridge.tools.selfstudy.synth import chat_ids, document_body, system_message

OUT = Q.RESULTS / "teacher_window"
PLACES = (0.1, 0.5, 0.9)  # where the evidence sits in the window, as a fraction of its length
WHOLE = 0  # a window of length 0 stands for the whole document


def window_for(n: int, pos: int, length: int, place: float) -> tuple[int, int]:
    """A window of `length` tokens of an `n`-token body holding position `pos` at about
    `place` of its length, moved inside the body where it would stick out."""
    if length <= 0 or length >= n:
        return 0, n
    start = min(max(0, pos - round(place * length)), n - length)
    return start, start + length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, nargs="+", default=[128, 256, 384, 768, WHOLE],
                    help="window lengths in tokens (0: the whole document)")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.tools.selfstudy.vllm_synth import VllmBackend

    model_dir = ensure_real_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = Q.document("a")
    body = document_body(tok, text)
    qs = [q for q in Q.load_questions() if q.doc == "a" and q.split == "dev"]
    pos = {q.id: Q.evidence_position(tok, text, q.evidence) for q in qs}
    n = len(body)
    sizes = list(dict.fromkeys(length if 0 < length < n else n for length in a.windows))  # the whole one: n
    asked = []  # (question, window length, place, window, prompt ids)
    for q in qs:
        for size in sizes:
            for place in (PLACES if size < n else (None,)):
                w = window_for(n, pos[q.id], size, place or 0.0)
                ids = chat_ids(tok, [system_message(tok, body, w), {"role": "user", "content": q.question}])
                asked.append((q, size, place, w, ids))

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    cfg = SynthConfig(window_max=n, answer_tokens=a.answer_tokens)
    with VllmBackend(model_dir, tok, cfg) as be:
        params = SamplingParams(temperature=0.0, max_tokens=a.answer_tokens, stop_token_ids=[tok.eos_token_id])
        outs = be.start().generate([TokensPrompt(prompt_token_ids=ids) for *_, ids in asked], params,
                                    use_tqdm=False)
    seconds = time.perf_counter() - t0

    rows = []
    for (q, size, place, w, _), out in zip(asked, outs):
        answer = tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        rows.append({"id": q.id, "bucket": Q.bucket(pos[q.id]), "window_tokens": size,
                     "place": place, "window": list(w), "answer": answer, "correct": Q.fact_found(q.fact, answer)})

    def acc(sel):
        return [sum(r["correct"] for r in sel), len(sel)]

    table = {}
    for size in sizes:
        sel = [r for r in rows if r["window_tokens"] == size]
        table[size] = {b: acc([r for r in sel if r["bucket"] == b]) for _, _, b in Q.POSITION_BUCKETS}
        table[size]["all"] = acc(sel)
    details = {"model": str(model_dir), "document_tokens": n, "questions": len(qs), "split": "dev",
               "places": PLACES, "answer_tokens": a.answer_tokens, "seconds": round(seconds, 1),
               "table": table, "rows": rows}
    arms = [Arm(name=f"window {size}", count=t["all"][1], figures={"facts": t["all"][0]}) for size, t in table.items()]
    lines = [f"Teacher answers to document A's {len(qs)} dev questions by window length "
             f"({n}-token document; evidence at {', '.join(f'{p:.0%}' for p in PLACES)} of the window; "
             f"greedy, {a.answer_tokens} tokens; facts stated / asked)", "",
             "| window (tokens) | all | " + " | ".join(b for _, _, b in Q.POSITION_BUCKETS) + " |",
             "|---:|---:|" + "---:|" * len(Q.POSITION_BUCKETS)]
    for length, t in table.items():
        lines.append(f"| {length}{' (whole)' if length == n else ''} | {t['all'][0]}/{t['all'][1]} | "
                     + " | ".join(f"{t[b][0]}/{t[b][1]}" for _, _, b in Q.POSITION_BUCKETS) + " |")
    write_result(Result(benchmark="teacher_window", machine=harness.machine_info(), parameters=vars(a), arms=arms,
                        details=details), a.out.parent, a.out.stem, body="\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
