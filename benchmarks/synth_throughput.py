"""Self-study synthesis throughput, HF `generate` against a vLLM engine on the same cores, and
training steps per second in fp32 against bf16 autocast.

    .venv/bin/python benchmarks/synth_throughput.py [--hf 8] [--vllm 256] [--steps 6] [--dict-logprobs]
        [--compare-dtype bfloat16] [--out benchmarks/results/synth_throughput.json]

The real model (SmolLM2-135M-Instruct, `tools.realmodel`) and document A of the quality
benchmark (1,766 tokens), with `make quality`'s synthesis settings (windows of 384-768 tokens,
questions <= 48 tokens, answers <= 64, top-20 targets, question targets too). Both backends draw
the same plan (`selfstudy.synth.plan`, seed 0); the vLLM engine's start is timed apart from its
conversations. Then a PEFT cartridge student (256 tokens) trains a few steps on the vLLM
conversations (batch 8, question and answer tokens) in fp32 and under bf16 autocast, from the
same start: seconds per step, and how far the autocast loss and gradient are from fp32's.
Never run by the test suite (no timings in tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, percentile, write_result


def train_steps(model, tok, text, convs, steps: int, batch_size: int, autocast: bool):
    """Seconds per step and the first step's loss and gradient, from the first-k start."""
    from lmcache_cartridge.tools.selfstudy.loop import batch_indices, build_student, encoder_of
    from lmcache_cartridge.tools.selfstudy.objective import answer_logprobs, collate, distill_loss

    student = build_student(model, tok, text, 256, 1)
    enc = encoder_of(student)
    opt = torch.optim.Adam([enc.trainable_embedding], lr=2e-3)
    times, first = [], None
    for step in range(steps):
        batch = collate([convs[i] for i in batch_indices(step, len(convs), batch_size, 0)], teacher=False,
                        pad_id=tok.pad_token_id, device="cpu", questions=True)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = distill_loss(answer_logprobs(student, batch), batch)
        loss.backward()
        if first is None:
            first = (float(loss.detach()), enc.trainable_embedding.grad.detach().clone())
        opt.step()
        times.append(time.perf_counter() - t0)
    return times, first, student


def build_parser() -> argparse.ArgumentParser:
    from lmcache_cartridge.tools.selfstudy.config import SYNTH_BATCH

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", type=int, default=8, help="conversations by HF generate (0: vLLM only, no training)")
    p.add_argument("--vllm", type=int, default=256, help="conversations by vLLM")
    p.add_argument("--batch", type=int, default=SYNTH_BATCH, help="vLLM conversations per engine call")
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (train --synth-eager)")
    p.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"),
                   help="vLLM's dtype (default: train's choice, `vllm_synth.synth_dtype`: float32 on a CPU "
                   "without native bf16, else the checkpoint's)")
    p.add_argument("--compare-dtype", choices=("auto", "bfloat16", "float32"),
                   help="then the same conversations by a fresh engine in this dtype, side by side")
    p.add_argument("--dict-logprobs", action="store_true",
                   help="first, the same conversations with vLLM's per-position log-prob dicts (its default) "
                   "rather than the flat lists the synthesis asks for: the frontend's CPU side by side")
    p.add_argument("--steps", type=int, default=6, help="training steps per dtype (first one is warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir")
    p.add_argument("--text", default=str(ROOT / "benchmarks/quality/doc_a.txt"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/synth_throughput.json"))
    return p


def vllm_arm(model_dir: Path, tok, cfg, text: str, a: argparse.Namespace) -> tuple[dict, list]:
    """`--vllm` conversations by a fresh vLLM engine, its start timed apart: the figures, and the
    conversations."""
    from lmcache_cartridge.tools.selfstudy.synth import synthesize
    from lmcache_cartridge.tools.selfstudy.vllm_synth import VllmBackend

    backend = VllmBackend(model_dir, tok, cfg, batch=a.batch, block_size=a.block_size, enforce_eager=a.eager,
                          dtype=a.vllm_dtype)
    t0 = time.perf_counter()
    backend.start()
    start_s = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), time.process_time()
    convs = synthesize(backend, tok, text, cfg, count=a.vllm, seed=0, tag="train")
    v_s, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    backend.close()
    return {"conversations": len(convs), "seconds": v_s, "engine_start_seconds": start_s,
            "load_average_after": os.getloadavg()[0],
            "conversations_per_minute": 60 * len(convs) / v_s,
            "conversations_per_minute_with_start": 60 * len(convs) / (v_s + start_s),
            # this process: vLLM's frontend and ours (the engine core is a child process); on a
            # GPU it is what sets the pace
            "frontend_cpu_ms_per_conversation": 1000 * cpu / len(convs),
            "answer_tokens_mean": statistics.mean(len(c.answer) for c in convs),
            "question_targets_mean": statistics.mean(len(c.prompt_topk_ids) for c in convs),
            "engine": dict(backend.stats), "batch": a.batch, "block_size": a.block_size, "dtype": backend.dtype,
            "enforce_eager": a.eager}, convs


def vllm_dict_logprobs_arm(model_dir: Path, tok, cfg, text: str, a: argparse.Namespace) -> dict:
    """`vllm_arm` with vLLM's default per-position log-prob dicts, on a fresh engine of its own."""
    from lmcache_cartridge.tools.selfstudy import vllm_synth

    flat, vllm_synth._flat_logprobs = vllm_synth._flat_logprobs, lambda: {}
    r, _ = vllm_arm(model_dir, tok, cfg, text, a)
    vllm_synth._flat_logprobs = flat
    return r


def hf_arm(model, tok, cfg, text: str, a: argparse.Namespace) -> dict:
    """`--hf` conversations by HF `generate`, after one untimed conversation."""
    from lmcache_cartridge.tools.selfstudy.synth import HFBackend, synthesize

    # One untimed conversation first: the first generate pays one-time set-up (as vLLM's start
    # and warm-up, timed apart).
    synthesize(HFBackend(model, tok), tok, text, cfg, count=1, seed=0, tag="warm-up", progress=False)
    t0 = time.perf_counter()
    h_convs = synthesize(HFBackend(model, tok), tok, text, cfg, count=a.hf, seed=0, tag="train")
    h_s = time.perf_counter() - t0
    return {"conversations": len(h_convs), "seconds": h_s, "dtype": "float32",
            "load_average_after": os.getloadavg()[0],
            "conversations_per_minute": 60 * len(h_convs) / h_s,
            "answer_tokens_mean": statistics.mean(len(c.answer) for c in h_convs)}


def train_arm(model, tok, text: str, convs: list, steps: int) -> dict:
    """`steps` training steps in fp32 and under bf16 autocast from the same start: seconds per
    step, and how far the autocast loss and gradient are from fp32's."""
    fp32_t, (fp32_loss, fp32_grad), _ = train_steps(model, tok, text, convs, steps, 8, autocast=False)
    bf16_t, (bf16_loss, bf16_grad), _ = train_steps(model, tok, text, convs, steps, 8, autocast=True)
    cos = float(torch.nn.functional.cosine_similarity(fp32_grad.flatten(), bf16_grad.flatten(), dim=0))
    rel = float((bf16_grad - fp32_grad).norm() / fp32_grad.norm())
    out = {"batch_size": 8, "cartridge_tokens": 256, "steps_timed": steps - 1,
           "fp32_seconds_per_step": percentile(fp32_t[1:], 50),
           "bf16_autocast_seconds_per_step": percentile(bf16_t[1:], 50),
           "first_step_loss": {"fp32": fp32_loss, "bf16_autocast": bf16_loss},
           "gradient_cosine": cos, "gradient_relative_error": rel,
           "fp32_step_s": fp32_t[1:], "bf16_autocast_step_s": bf16_t[1:]}
    out["fp32_steps_per_second"] = 1 / out["fp32_seconds_per_step"]
    out["bf16_autocast_steps_per_second"] = 1 / out["bf16_autocast_seconds_per_step"]
    return out


def main() -> None:
    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.tools.selfstudy.config import SynthConfig
    from lmcache_cartridge.tools.selfstudy.run import load_for_training, load_tokenizer

    a = build_parser().parse_args()
    torch.set_num_threads(a.threads)
    model_dir = Path(a.model_dir) if a.model_dir else ensure_real_model()
    text = Path(a.text).read_text()
    cfg = SynthConfig(window_min=384, window_max=768, question_tokens=48, answer_tokens=64)
    tok = load_tokenizer(model_dir)
    out: dict = {"torch_threads": a.threads, "model": str(model_dir), "document": Path(a.text).name,
                 "synth": cfg.__dict__}

    # vLLM first (it holds its own process); then HF on the same cores.
    # The load average beside each phase: another job on the same cores slows either backend.
    out["load_average_before"] = os.getloadavg()[0]
    if a.dict_logprobs:  # vLLM's default containers first
        out["vllm_dict_logprobs"] = vllm_dict_logprobs_arm(model_dir, tok, cfg, text, a)
        print(json.dumps(out["vllm_dict_logprobs"], indent=1), flush=True)
    out["vllm"], v_convs = vllm_arm(model_dir, tok, cfg, text, a)
    print(json.dumps(out["vllm"], indent=1), flush=True)
    if a.compare_dtype:
        other = argparse.Namespace(**{**vars(a), "vllm_dtype": a.compare_dtype})
        out["vllm_compare_dtype"], c_convs = vllm_arm(model_dir, tok, cfg, text, other)
        out["dtype_speedup"] = (out["vllm"]["conversations_per_minute"]
                                / out["vllm_compare_dtype"]["conversations_per_minute"])
        out["same_answers"] = sum(x.answer == y.answer for x, y in zip(v_convs, c_convs))
        print(json.dumps(out["vllm_compare_dtype"], indent=1), f"{out['dtype_speedup']:.2f}x", flush=True)
    if not a.hf:  # vLLM alone (settings trials)
        write(out, a)
        return

    model, _ = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    out["hf"] = hf_arm(model, tok, cfg, text, a)
    out["speedup"] = out["vllm"]["conversations_per_minute"] / out["hf"]["conversations_per_minute"]
    out["speedup_with_engine_start"] = (
        out["vllm"]["conversations_per_minute_with_start"] / out["hf"]["conversations_per_minute"]
    )
    print(json.dumps(out["hf"], indent=1), f"speedup {out['speedup']:.1f}x", flush=True)
    out["train"] = train_arm(model, tok, text, v_convs, a.steps)
    print(json.dumps(out["train"], indent=1))
    write(out, a)

def write(out: dict, a: argparse.Namespace) -> None:
    """The run as the harness's result: one arm per backend (conversations), training steps by precision."""
    arms = [Arm(name=f"synth {k}", count=out[k]["conversations"],
                figures={"conversations_per_minute": out[k]["conversations_per_minute"]})
            for k in ("vllm", "vllm_compare_dtype", "vllm_dict_logprobs", "hf") if k in out]
    if "train" in out:
        arms += [Arm.from_samples(f"train step {k}", out["train"][f"{k}_step_s"]) for k in ("fp32", "bf16_autocast")]
    path = Path(a.out)
    write_result(Result(benchmark="synth_throughput", machine={**machine_info(), "torch_threads": a.threads},
                        parameters=vars(a), arms=arms, details=out), path.parent, path.stem, markdown_file=False)


if __name__ == "__main__":
    main()
