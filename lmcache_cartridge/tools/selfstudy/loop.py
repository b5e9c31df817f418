"""The optimisation loop: PEFT CARTRIDGE student (first-k or attention initialisation), Adam on the KV only,
resumable checkpoints and a JSON-lines metrics log.

Runs in the `train` process; owns the work directory (`checkpoint.pt`, `metrics.jsonl`). The
batch of step `s` is a pure function of (seed, s), and the checkpoint holds the prompt
embeddings and Adam's state, so a run stopped after step s and resumed computes exactly what
an uninterrupted run computes.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import atomic_open
from lmcache_cartridge.tools.selfstudy.config import LoopConfig, default_lr, scheduled_lr
from lmcache_cartridge.tools.selfstudy.objective import answer_logprobs, collate, distill_loss, kl_sum
from lmcache_cartridge.tools.selfstudy.synth import Conversation, sub_seed

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"


@dataclass
class LoopResult:
    steps: int
    losses: list[float] = field(default_factory=list)           # this process's steps only
    heldout_kl: dict[int, float] = field(default_factory=dict)  # step -> KL, whole run
    step_seconds: list[float] = field(default_factory=list)
    resumed_from: int = 0


def build_student(model, tokenizer, text: str, num_tokens: int, num_frozen: int, init: str = "first_k",
                  init_first: int = 1):
    """PEFT CARTRIDGE adapter over `model`, its KV started as `init` says (`selfstudy.init`):
    `first_k`, the KV of the document's first `num_tokens` tokens (PEFT's
    `initialize_kv_prefix_from_text`: the document as the chat template's system message, as the
    paper's first-k initialisation), or `attention`, the document's first `init_first` positions
    and the most attended others of the whole document's KV."""
    from peft import CartridgeConfig, get_peft_model
    from peft.tuners.cartridge.utils import initialize_kv_prefix_from_past_key_values, initialize_kv_prefix_from_text

    from lmcache_cartridge.tools.selfstudy.init import attention_kv, document_ids

    kv = attention_kv(model, document_ids(tokenizer, text), num_tokens, init_first) if init == "attention" else None
    student = get_peft_model(model, CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_tokens,
                                                    num_frozen_tokens=num_frozen))
    if kv is not None:
        initialize_kv_prefix_from_past_key_values(student, adapter_name=student.active_adapter, past_key_values=kv,
                                                  num_virtual_tokens=num_tokens)
        return student
    try:
        initialize_kv_prefix_from_text(student, tokenizer, text=text, max_length=num_tokens)
    except ValueError as e:
        raise CartridgeError(
            f"first-k initialisation failed ({e}): the document is shorter than the cartridge "
            f"({num_tokens} tokens, chat template included); use a longer document or fewer --tokens"
        ) from e
    return student


def encoder_of(student):
    return student.prompt_encoder[student.active_adapter]


@lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(sub_seed(seed, "epoch", epoch))
    return tuple(torch.randperm(n, generator=g).tolist())


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Examples of step `step` (0-based): consecutive slots of a stream of seeded epoch shuffles."""
    out = []
    for slot in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(slot, n)
        out.append(_epoch_order(n, seed, epoch)[i])
    return out


def accumulate_step(student, convs: list[Conversation], *, micro_batch: int, pad_id: int, questions: bool,
                    autocast_dtype: str | None = None) -> float:
    """Add one step's gradient over `convs` to the cartridge's `.grad` and return the step's loss:
    the mean over all their scored tokens, computed `micro_batch` conversations at a time (each
    part's sum divided by the whole step's count, so the parts add up to one whole step)."""
    parts = [collate(convs[i:i + micro_batch], teacher=False, pad_id=pad_id, device=student.device,
                     questions=questions) for i in range(0, len(convs), micro_batch)]
    count = int(sum(p.mask.sum() for p in parts))
    total = 0.0
    for part in parts:
        with autocast(student.device, autocast_dtype):
            loss = distill_loss(answer_logprobs(student, part), part, count=count)
        loss.backward()
        total += float(loss.detach())
    return total


def heldout_kl(student, convs: list[Conversation], *, pad_id: int, batch_size: int = 8) -> float:
    """Mean full-vocabulary KL(teacher with the window || student with the cartridge) per answer
    token, on conversations never trained on (answer tokens whatever the loss scores, so the
    figure compares across runs)."""
    device = student.device
    base = student.get_base_model()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(convs), batch_size):
            part = convs[i:i + batch_size]
            sb = collate(part, teacher=False, pad_id=pad_id, device=device)
            t = answer_logprobs(base, collate(part, teacher=True, pad_id=pad_id, device=device))
            s = answer_logprobs(student, sb)
            kl, n = kl_sum(t, s, sb.mask)
            total, count = total + kl, count + n
    return total / count


def _atomic_save(obj: Any, path: Path) -> None:
    with atomic_open(path) as f:  # a temp name of its own: two writers of one checkpoint never share one
        torch.save(obj, f)


def save_checkpoint(work_dir: Path, *, fingerprint: str, step: int, student, optimizer) -> None:
    _atomic_save({"version": 1, "fingerprint": fingerprint, "step": step,
                  "prompt_embeddings": encoder_of(student).weight.detach().cpu(),
                  "optimizer": optimizer.state_dict()}, work_dir / CHECKPOINT_NAME)


def load_checkpoint(work_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    path = work_dir / CHECKPOINT_NAME
    if not path.exists():
        return None
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if ck.get("fingerprint") != fingerprint:
        raise CartridgeError(
            f"{path} belongs to a run with other settings (model, document, data or optimiser "
            "settings differ): pass another --work-dir, or delete it to start over"
        )
    return ck


class MetricsLog:
    """`metrics.jsonl`: one object per line, `{"step", "loss", "seconds"}` or `{"step", "heldout_kl"}`.
    Lines after `keep_until` are dropped (that work is redone): the checkpoint's step on resume."""

    def __init__(self, path: Path, keep_until: int) -> None:
        self.path = path
        kept = [r for r in self.read(path) if r["step"] <= keep_until]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def learning_rate(cfg: LoopConfig, student) -> float:
    """`cfg.lr`, or the rate measured for a model of the student's size when none was given."""
    return cfg.lr if cfg.lr is not None else default_lr(sum(p.numel() for p in student.parameters()))


def autocast(device: torch.device, dtype: str | None):
    """`torch.autocast` to `dtype` on `device`, or nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def pull_toward(kv: torch.nn.Parameter, start: torch.Tensor, share: float) -> None:
    """Move `kv` `share` of the way back to `start` (`--anchor`'s step, after Adam's)."""
    with torch.no_grad():
        kv.lerp_(start.to(kv.dtype), share)


def run_loop(student, train: list[Conversation], heldout: list[Conversation], cfg: LoopConfig, *,
             work_dir: Path, fingerprint: str, pad_id: int, progress: bool = True) -> LoopResult:
    """Train `student`'s cartridge for `cfg.steps` steps in all (resuming from a checkpoint)."""
    from tqdm import tqdm

    work_dir.mkdir(parents=True, exist_ok=True)
    encoder = encoder_of(student)
    base_lr = learning_rate(cfg, student)
    optimizer = torch.optim.Adam([encoder.trainable_embedding], lr=base_lr)
    # the start, taken before a checkpoint is loaded (`build_student` made it from the text)
    start_kv = encoder.trainable_embedding.detach().clone() if cfg.anchor else None
    ck = load_checkpoint(work_dir, fingerprint)
    start = 0
    if ck is not None:
        encoder.load_prompt_embeddings(ck["prompt_embeddings"])
        optimizer.load_state_dict(ck["optimizer"])
        start = int(ck["step"])
    if start > cfg.steps:
        raise CartridgeError(f"the checkpoint in {work_dir} is at step {start}, past --steps {cfg.steps}")
    # without a checkpoint every line is from a try that is redone, step 0's held-out KL included
    log = MetricsLog(work_dir / METRICS_NAME, keep_until=start if ck is not None else -1)
    result = LoopResult(steps=cfg.steps, resumed_from=start)
    result.heldout_kl = {r["step"]: r["heldout_kl"] for r in MetricsLog.read(log.path) if "heldout_kl" in r}

    def evaluate(step: int) -> None:
        kl = heldout_kl(student, heldout, pad_id=pad_id, batch_size=min(cfg.batch_size, cfg.micro_batch))
        result.heldout_kl[step] = kl
        log.write({"step": step, "heldout_kl": kl})

    if start == 0 and heldout:
        evaluate(0)
    bar = tqdm(range(start, cfg.steps), desc="train cartridge", unit="step", disable=not progress,
               initial=start, total=cfg.steps)
    with bar:
        for step in bar:
            convs = [train[i] for i in batch_indices(step, len(train), cfg.batch_size, cfg.seed)]
            t0 = time.perf_counter()
            rate = scheduled_lr(base_lr, cfg.lr_schedule, step, cfg.steps)
            for group in optimizer.param_groups:  # set every step: a resumed run's saved rate is not trusted
                group["lr"] = rate
            optimizer.zero_grad(set_to_none=True)
            value = accumulate_step(student, convs, micro_batch=cfg.micro_batch, pad_id=pad_id,
                                    questions=cfg.question_loss, autocast_dtype=cfg.autocast)
            optimizer.step()
            if start_kv is not None:
                pull_toward(encoder.trainable_embedding, start_kv, rate * cfg.anchor)
            seconds = time.perf_counter() - t0
            done = step + 1
            result.losses.append(value)
            result.step_seconds.append(seconds)
            log.write({"step": done, "loss": value, "seconds": seconds})
            bar.set_postfix(loss=f"{value:.4f}")
            if heldout and (done % cfg.eval_every == 0 or done == cfg.steps):
                evaluate(done)
                bar.set_postfix(loss=f"{value:.4f}", kl=f"{result.heldout_kl[done]:.4f}")
            if done % cfg.save_every == 0 or done == cfg.steps:
                # A stopped run loses at most save_every steps; rerunning the command resumes.
                save_checkpoint(work_dir, fingerprint=fingerprint, step=done, student=student, optimizer=optimizer)
    return result
