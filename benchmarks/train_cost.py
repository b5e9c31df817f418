"""What `lmcache-cartridge train` costs: synthesis per conversation, optimiser step, held-out eval.

    .venv/bin/python benchmarks/train_cost.py [--model-dir DIR] [--tokens 256] [--batch-size 8]
        [--conversations 32] [--steps 30] [--threads 1] [--device cpu] [--synth-backend hf]
        [--out benchmarks/results/train_cost.json]

Defaults to the tiny peaked test model and the bundled document. Runs the real command
(`train_cartridge`) in a temp dir and splits its wall time: synthesis (question + greedy answer
with top-k logprobs; `--synth-backend hf`, transformers `generate`, as the recorded results, or
vllm: `benchmarks/synth_throughput.py` compares the two), training steps (forward + backward +
Adam over the cartridge's KV), and the rest. Seconds per step also come from the run's own
`metrics.jsonl`. Never run by the test suite (no timings in tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, percentile, write_result


def main() -> None:
    from lmcache_cartridge.tools.selfstudy.config import LoopConfig, SynthConfig, TrainConfig
    from lmcache_cartridge.tools.selfstudy.loop import METRICS_NAME, MetricsLog
    from lmcache_cartridge.tools.selfstudy.run import (
        load_for_training, load_or_synthesize, resolve_device, train_cartridge,
    )
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir")
    p.add_argument("--text")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--heldout", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--window-min", type=int, default=256)
    p.add_argument("--window-max", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--synth-backend", default="hf", choices=("auto", "vllm", "hf"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/train_cost.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = Path(a.model_dir) if a.model_dir else ensure_test_model()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        doc = Path(a.text) if a.text else tmp / "doc.txt"
        if not a.text:
            doc.write_text(document_text())
        cfg = TrainConfig(model_dir=model_dir, text_path=doc, output=tmp / "cart", tokens=a.tokens,
                          conversations=a.conversations, heldout=a.heldout,
                          synth=SynthConfig(window_min=a.window_min, window_max=a.window_max,
                                            question_tokens=a.question_tokens, answer_tokens=a.answer_tokens),
                          loop=LoopConfig(steps=a.steps, batch_size=a.batch_size, eval_every=a.steps,
                                          save_every=a.steps),
                          device=a.device, progress=False, synth_backend=a.synth_backend)
        device = resolve_device(a.device)
        model, tok = load_for_training(model_dir, device, torch.float32 if device.type == "cpu" else torch.bfloat16)
        t0 = time.perf_counter()
        train, heldout = load_or_synthesize(cfg, model if a.synth_backend == "hf" else None, tok, doc.read_text())
        synth_s = time.perf_counter() - t0
        del model
        t0 = time.perf_counter()
        res = train_cartridge(cfg)  # reuses the data just made (same fingerprint)
        total_s = time.perf_counter() - t0
        steps = [r["seconds"] for r in MetricsLog.read(cfg.work / METRICS_NAME) if "seconds" in r]
    out = {
        "model_dir": str(model_dir), "device": str(device), "threads": a.threads, "tokens": a.tokens,
        "batch_size": a.batch_size, "steps": a.steps,
        "conversations": len(train) + len(heldout),
        "answer_tokens_per_conversation": statistics.mean(len(c.answer) for c in train),
        "synth_seconds_per_conversation": synth_s / (len(train) + len(heldout)),
        "seconds_per_step_mean": statistics.mean(steps), "seconds_per_step_median": percentile(steps, 50),
        "step_s": steps,
        "train_command_seconds": total_s,
        "heldout_kl": {str(k): v for k, v in sorted(res.loop.heldout_kl.items())},
    }
    print(json.dumps(out, indent=1))
    path = Path(a.out)
    write_result(Result(benchmark="train_cost", machine=machine_info(), parameters=vars(a),
                        arms=[Arm.from_samples("train step", steps)], details=out),
                 path.parent, path.stem, markdown_file=False)


if __name__ == "__main__":
    main()
