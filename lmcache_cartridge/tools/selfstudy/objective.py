"""The training objective: log-probs on the scored tokens, the distillation loss, the held-out KL.

Runs in the `train` process. The student is the PEFT model (cartridge as `past_key_values`,
then the question and answer); the teacher is the bare model with the document window in its
system prompt. Both score the same tokens, the answer's and (the paper's objective, `questions`)
the user turn's, so their distributions are compared position by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_cartridge.tools.selfstudy.synth import Conversation


@dataclass
class Batch:
    """Right-padded sequences `prefix + answer[:-1]`; `positions[b, j]` is the index of the logit
    that predicts scored token j: the last P prompt tokens (with `questions`), then the answer's
    (right padding keeps every real token's position unchanged)."""

    input_ids: torch.Tensor       # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    positions: torch.Tensor       # [B, A]
    mask: torch.Tensor            # [B, A] bool: a real scored token
    topk_ids: torch.Tensor        # [B, A, k]
    topk_logprobs: torch.Tensor   # [B, A, k]


def targets(c: Conversation, questions: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and log-probs of the conversation's scored tokens, in order."""
    if not questions:
        return c.topk_ids, c.topk_logprobs
    if c.prompt_topk_ids is None:
        raise ValueError("these conversations have no question targets (made by an older version): "
                         "synthesise them again, or train on answer tokens only")
    return torch.cat([c.prompt_topk_ids, c.topk_ids]), torch.cat([c.prompt_topk_logprobs, c.topk_logprobs])


def collate(convs: list[Conversation], *, teacher: bool, pad_id: int, device: torch.device | str,
            questions: bool = False) -> Batch:
    """`questions`: score the user turn's tokens (the prompt's last P, `Conversation`) before
    the answer's; their logits sit right before the answer's, so the scored span is contiguous."""
    seqs, spans, tgts = [], [], []
    for c in convs:
        prefix = c.teacher_prefix if teacher else c.student_prefix
        ids, lp = targets(c, questions)
        seqs.append(prefix + c.answer[:-1])
        spans.append((len(prefix) - 1 - (len(ids) - len(c.answer)), len(ids)))
        tgts.append((ids, lp))
    S = max(len(s) for s in seqs)
    A = max(n for _, n in spans)
    k = convs[0].topk_ids.shape[1]
    B = len(convs)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention = torch.zeros((B, S), dtype=torch.long)
    positions = torch.zeros((B, A), dtype=torch.long)
    mask = torch.zeros((B, A), dtype=torch.bool)
    topk_ids = torch.zeros((B, A, k), dtype=torch.long)
    topk_lp = torch.full((B, A, k), float("-inf"))
    for b, (seq, (start, n), (ids, lp)) in enumerate(zip(seqs, spans, tgts)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention[b, : len(seq)] = 1
        positions[b, :n] = torch.arange(start, start + n)
        mask[b, :n] = True
        topk_ids[b, :n] = ids
        topk_lp[b, :n] = lp
    return Batch(*(t.to(device) for t in (input_ids, attention, positions, mask, topk_ids, topk_lp)))


def answer_logprobs(model, batch: Batch) -> torch.Tensor:
    """`[B, A, V]` float32 log-probs of the model at the scored positions."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits
    index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return torch.log_softmax(logits.gather(1, index).float(), dim=-1)


def distill_loss(student_lp: torch.Tensor, batch: Batch, count: int | None = None) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's kept top-k distribution, mean over
    scored tokens (the paper's objective; equal to the top-k KL up to the teacher's entropy).
    `count`: the scored tokens of the whole step when `batch` is one micro-batch of it, so the
    micro-batches' losses add up to the step's mean."""
    picked = student_lp.gather(-1, batch.topk_ids)
    weight = batch.topk_logprobs.exp()  # exp(-inf) = 0: dropped entries weigh nothing
    ce = -(weight * picked).sum(-1)
    return (ce * batch.mask).sum() / (batch.mask.sum() if count is None else count)


def kl_sum(teacher_lp: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Full-vocabulary KL(teacher || student) summed over real answer tokens, and their count."""
    kl = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
    return float((kl * mask).sum()), int(mask.sum())
