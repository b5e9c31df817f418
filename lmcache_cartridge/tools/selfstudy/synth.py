"""Synthesise self-study conversations about a document with the model itself (teacher data).

Runs once per training run in the `train` process, before the optimisation loop; its output is
saved in the work directory (`data.pt`, read back with `weights_only=True`) so a resumed run
trains on the same conversations. Follows the paper's self-study: a random window of the
document goes into the system prompt; the model, given a seed prompt of one of five types,
writes a question (sampled, temperature 0.6); the model answers it greedily with the window
still in context, and per answer token we keep its top-k next-token distribution until the kept
probability reaches `cover` (the distillation target). The student later sees only the question
and the answer, after the cartridge.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy.config import SynthConfig

SYSTEM_TEMPLATE = (
    "You are in a conversation about the document below. Answer from its content, without "
    "starting with phrases like \"According to the document\".\n\n<document>\n{window}\n</document>"
)

# Five seed prompt types of self-study (paper section 4.1); wording ours.
SEED_PROMPTS: dict[str, tuple[str, ...]] = {
    "structuring": tuple(
        f"Write a single chat message asking an assistant to put the information in one part of "
        f"the document above into {fmt}, with every date, name and number kept exactly. Name the "
        f"part you mean. Output only the message."
        for fmt in ("JSON", "YAML", "a table", "plain text")
    ),
    "summarization": (
        "Write a single chat message asking an assistant to summarise one clearly named part of "
        "the document above. Output only the message.",
        "Write a single chat message asking for a short summary of the document above, naming "
        "which section to cover. Output only the message.",
    ),
    "question": (
        "Write one question that tests knowledge of the document above. Include the names, dates "
        "or details that make clear what you are asking. Output only the question.",
        "Write one question about the document above that someone could answer without seeing "
        "it only if they knew it well. Output only the question.",
    ),
    "use_case": (
        "Think of a practical task someone could do with the knowledge in the document above, "
        "and write the question or instruction they would ask. Output only that question.",
    ),
    "creative": (
        "Start a creative conversation inspired by the document above: write the opening "
        "question for your partner. Output only the question.",
    ),
}
SEED_TYPES = tuple(SEED_PROMPTS)


@dataclass
class Conversation:
    """One self-study example. Token ids are the model's own; the answer is scored per token."""

    seed_type: str
    window: tuple[int, int]       # [start, end) in the document's tokens after BOS
    question: str
    student_prefix: list[int]     # user turn + assistant header, no BOS (the cartridge owns it)
    teacher_prefix: list[int]     # BOS + system(window) + user turn + assistant header
    answer: list[int]             # the teacher's greedy answer (EOS included when it stopped)
    topk_ids: torch.Tensor        # [len(answer), k] int64
    topk_logprobs: torch.Tensor   # [len(answer), k] float32; -inf beyond the kept mass

    def to_dict(self) -> dict[str, Any]:
        return {"seed_type": self.seed_type, "window": list(self.window), "question": self.question,
                "student_prefix": self.student_prefix, "teacher_prefix": self.teacher_prefix,
                "answer": self.answer, "topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Conversation":
        return cls(d["seed_type"], tuple(d["window"]), d["question"], list(d["student_prefix"]),
                   list(d["teacher_prefix"]), list(d["answer"]), d["topk_ids"], d["topk_logprobs"])


def sub_seed(seed: int, *parts: object) -> int:
    """A stable 63-bit seed for one item (independent of PYTHONHASHSEED and of call order)."""
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def chat_ids(tokenizer, messages: list[dict[str, str]], *, strip_bos: bool = False) -> list[int]:
    """Token ids of `messages` through the model's chat template, with the assistant header."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if strip_bos and ids and ids[0] == tokenizer.bos_token_id:
        ids = ids[1:]
    return ids


def document_body(tokenizer, text: str) -> list[int]:
    """The document's token ids without BOS (windows are cut from these)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def teacher_topk(logits: torch.Tensor, k: int, cover: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs per row, truncated once the kept probability reaches `cover` (the paper's
    target: top-20 until cumulative p >= 0.99). Dropped entries get -inf, i.e. weight 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    p = lp.exp()
    keep = (p.cumsum(-1) - p) < cover  # keep tokens until (and including) the one crossing it
    return ids.to(torch.int64).cpu(), lp.masked_fill(~keep, float("-inf")).cpu()


def _generate(model, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
              tokenizer, want_logits: bool):
    device = next(model.parameters()).device
    inp = torch.tensor([ids], device=device)
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True,
                                  output_logits=want_logits)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), **kwargs)
    new = [int(t) for t in out.sequences[0, len(ids):].tolist()]
    logits = torch.cat(out.logits, dim=0) if want_logits else None
    return new, logits


def synthesize_one(model, tokenizer, body: list[int], cfg: SynthConfig, seed: int, tag: str,
                   index: int) -> Conversation | None:
    """One conversation, fully determined by (seed, tag, index). None when the question is empty."""
    rng = random.Random(sub_seed(seed, tag, index))
    n = len(body)
    length = rng.randint(min(cfg.window_min, n), min(cfg.window_max, n))
    start = rng.randint(0, n - length)
    system = {"role": "system", "content": SYSTEM_TEMPLATE.format(window=tokenizer.decode(body[start:start + length]))}
    seed_type = rng.choice(SEED_TYPES)
    seed_prompt = rng.choice(SEED_PROMPTS[seed_type])

    q_ids, _ = _generate(model, chat_ids(tokenizer, [system, {"role": "user", "content": seed_prompt}]),
                         max_new_tokens=cfg.question_tokens, temperature=cfg.question_temperature,
                         seed=sub_seed(seed, tag, index, "question"), tokenizer=tokenizer, want_logits=False)
    question = tokenizer.decode(q_ids, skip_special_tokens=True).strip()
    if not question:
        return None
    user = {"role": "user", "content": question}
    teacher_prefix = chat_ids(tokenizer, [system, user])
    answer, logits = _generate(model, teacher_prefix, max_new_tokens=cfg.answer_tokens, temperature=0.0,
                               seed=0, tokenizer=tokenizer, want_logits=True)
    topk_ids, topk_lp = teacher_topk(logits, cfg.top_k, cfg.cover)
    return Conversation(seed_type, (start, start + length), question,
                        student_prompt_ids(tokenizer, user), teacher_prefix, answer, topk_ids, topk_lp)


def student_prompt_ids(tokenizer, user: dict[str, str]) -> list[int]:
    """The student's prompt after its cartridge: exactly what the gateway sends after a trained
    cartridge (`api.prompts`: the user turn right after the sink token, no BOS, no default system
    block), so the cartridge is trained on the prompt it will be served with."""
    from lmcache_cartridge.api.prompts import PromptBuilder

    return PromptBuilder(tokenizer).chat_ids([user], (), after_trained=True)


def synthesize(model, tokenizer, text: str, cfg: SynthConfig, *, count: int, seed: int, tag: str,
               exclude_questions: set[str] = frozenset(), progress: bool = True) -> list[Conversation]:
    """`count` conversations (tag separates the training and held-out streams). Questions in
    `exclude_questions` are redrawn, so held-out questions are never training questions."""
    from tqdm import tqdm

    body = document_body(tokenizer, text)
    if not body:
        raise ValueError("the document is empty")
    out: list[Conversation] = []
    index, attempts = 0, 0
    with tqdm(total=count, desc=f"self-study {tag}", unit="conv", disable=not progress) as bar:
        while len(out) < count:
            if attempts >= 4 * count + 16:
                raise CartridgeError(
                    f"could not synthesise {count} usable {tag} conversations in {attempts} attempts "
                    "(empty or repeated questions): the model does not follow the seed prompts"
                )
            conv = synthesize_one(model, tokenizer, body, cfg, seed, tag, index)
            index += 1
            attempts += 1
            if conv is None or conv.question in exclude_questions:
                continue
            out.append(conv)
            bar.update(1)
    return out
