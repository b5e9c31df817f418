"""Synthesise self-study conversations about a document with the model itself (teacher data).

Runs once per training run in the `train` process, before the optimisation loop; its output is
saved in the work directory (`data.pt`, read back with `weights_only=True`) so a resumed run
trains on the same conversations, and while it runs every finished batch is saved too
(`synth/`, `ShardStore`), so a stopped synthesis resumes where it stopped. Follows the paper's
self-study: a window of the document goes into the system prompt (windows spread evenly over
the document, or the document tiled by them: `plan`); the model, given a seed prompt of one of
five types, writes a question (sampled, temperature 0.6); the model answers it greedily with the
window still in context, and per answer token, and per token of the user turn (the question),
we keep its top-k next-token distribution until the kept probability reaches `cover` (the
distillation target).
The student later sees only the question and the answer, after the cartridge.

Three backends follow the same plan (`plan` fixes everything but the model's output): HF
`generate`, one conversation at a time (`HFBackend`, the fallback on CPU), HF `generate` on a
batch of conversations at once (`HFBatchBackend`, the fallback on a GPU), and a vLLM engine with
many in flight (`selfstudy.vllm_synth`).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import atomic_open
from lmcache_cartridge.tools.selfstudy.config import SEED_TYPES, SynthConfig

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
assert tuple(SEED_PROMPTS) == SEED_TYPES, "config.SEED_TYPES names the prompts above, in order"


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
    # The teacher's targets for the last P tokens of the prompt, the same tokens at the end of
    # teacher_prefix and of student_prefix (the user turn from its second token on: the student
    # has no logit for the token right after its cartridge). [P, k]; None in data made before.
    prompt_topk_ids: torch.Tensor | None = None
    prompt_topk_logprobs: torch.Tensor | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"seed_type": self.seed_type, "window": list(self.window), "question": self.question,
             "student_prefix": self.student_prefix, "teacher_prefix": self.teacher_prefix,
             "answer": self.answer, "topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs}
        if self.prompt_topk_ids is not None:
            d.update(prompt_topk_ids=self.prompt_topk_ids, prompt_topk_logprobs=self.prompt_topk_logprobs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Conversation":
        return cls(d["seed_type"], tuple(d["window"]), d["question"], list(d["student_prefix"]),
                   list(d["teacher_prefix"]), list(d["answer"]), d["topk_ids"], d["topk_logprobs"],
                   d.get("prompt_topk_ids"), d.get("prompt_topk_logprobs"))


def trim_repeats(conv: Conversation, n: int) -> Conversation:
    """`conv` with its answer cut where it starts repeating itself: before the first run of `n`
    answer tokens that already occurred earlier in the answer (0: unchanged). A small model's
    greedy answers often loop until the length limit ("The Lost Ship: The Lost Ship: ..."); the
    loop's tokens cost training time and say nothing new about the document. The targets of the
    tokens kept are the teacher's, unchanged; the question's are untouched."""
    if n <= 0:
        return conv
    seen: set[tuple[int, ...]] = set()
    for i in range(len(conv.answer) - n + 1):
        gram = tuple(conv.answer[i:i + n])
        if gram in seen:
            return replace(conv, answer=conv.answer[:i], topk_ids=conv.topk_ids[:i],
                           topk_logprobs=conv.topk_logprobs[:i])
        seen.add(gram)
    return conv


@dataclass(frozen=True)
class Spec:
    """Everything about conversation `index` but the model's output: both backends follow it."""

    index: int
    window: tuple[int, int]   # [start, end) in the document body
    seed_type: str
    seed_prompt: str
    question_seed: int


def plan(n: int, cfg: SynthConfig, seed: int, tag: str, index: int, count: int) -> Spec:
    """Conversation `index` of a stream of `count` over a body of `n` tokens. Conversations come
    in groups of `cfg.per_window` on one window, placed as `cfg.placement` says (`even_window`,
    `tiled_window`). Indexes past the last group (redraws) wrap round."""
    groups = max(1, -(-count // cfg.per_window))
    group = (index // cfg.per_window) % groups
    if cfg.placement == "tile":
        window = tiled_window(n, cfg, seed, tag, group)
    else:
        window = even_window(n, cfg, seed, tag, group, groups)
    rng = random.Random(sub_seed(seed, tag, index))
    seed_type = rng.choice(cfg.seed_types)
    return Spec(index, window, seed_type, rng.choice(SEED_PROMPTS[seed_type]),
                sub_seed(seed, tag, index, "question"))


def even_window(n: int, cfg: SynthConfig, seed: int, tag: str, group: int, groups: int) -> tuple[int, int]:
    """Group `group` of `groups`: window starts spread evenly from the document's first token to
    its last window (both ends included), each window's length drawn in [window_min, window_max]."""
    wrng = random.Random(sub_seed(seed, tag, "window", group))
    length = wrng.randint(min(cfg.window_min, n), min(cfg.window_max, n))
    start = 0 if groups == 1 else round(group * (n - length) / (groups - 1))
    return start, start + length


def tiled_window(n: int, cfg: SynthConfig, seed: int, tag: str, group: int) -> tuple[int, int]:
    """Group `group`: window `group % k` of cut `group // k`, each cut of the document into its
    `k` consecutive windows (`tiling`) drawn anew, so every token is in one window per cut."""
    k = tile_count(n, cfg)
    return tiling(n, cfg, sub_seed(seed, tag, "tiling", group // k))[group % k]


def tile_count(n: int, cfg: SynthConfig) -> int:
    """Windows per cut: the fewest of at most `window_max` tokens that hold `n`."""
    return -(-n // min(cfg.window_max, n))


def tiling(n: int, cfg: SynthConfig, seed: int) -> list[tuple[int, int]]:
    """The document's `n` tokens cut into the fewest consecutive windows of at most `window_max`,
    their lengths drawn at random in [window_min, window_max] (shorter where `n` leaves less)
    and in random order."""
    hi, k = min(cfg.window_max, n), tile_count(n, cfg)
    lo = min(cfg.window_min, n // k)
    rng = random.Random(seed)
    lengths, left = [], n
    for m in range(k, 1, -1):  # each length leaves the windows after it a length in [lo, hi]
        lengths.append(rng.randint(max(lo, left - (m - 1) * hi), min(hi, left - (m - 1) * lo)))
        left -= lengths[-1]
    lengths.append(left)
    rng.shuffle(lengths)
    ends = list(itertools.accumulate(lengths))
    return [(end - length, end) for end, length in zip(ends, lengths)]


def system_message(tokenizer, body: Sequence[int], window: tuple[int, int]) -> dict[str, str]:
    return {"role": "system", "content": SYSTEM_TEMPLATE.format(window=tokenizer.decode(body[window[0]:window[1]]))}


def scored_prompt_tokens(teacher_prefix: Sequence[int], student_prefix: Sequence[int]) -> int:
    """How many prompt tokens both the teacher and the student score: the tokens the two prefixes
    end with in common (the user turn and the assistant header), less the first of the student's
    (predicted by the cartridge's last position, which the student's forward does not compute)."""
    common = 0
    for a, b in zip(reversed(teacher_prefix), reversed(student_prefix)):
        if a != b:
            break
        common += 1
    return max(0, min(common, len(student_prefix) - 1, len(teacher_prefix) - 1))


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
    return ids.to(torch.int64).cpu(), truncate_cover(lp, cover).cpu()


def truncate_cover(lp: torch.Tensor, cover: float) -> torch.Tensor:
    """Rows of log-probs sorted high to low, -inf after the entry that brings the kept
    probability to `cover` (that entry is kept)."""
    p = lp.exp()
    keep = (p.cumsum(-1) - p) < cover
    return lp.float().masked_fill(~keep, float("-inf"))


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, S]` ids and attention mask, each sequence right-aligned (what `generate` continues)."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), S), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, S - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[b, S - len(s):] = 1
    return ids.to(device), mask.to(device)


def _through_eos(tokens: list[int], eos: int) -> list[int]:
    """A batch row's new tokens up to its first EOS, included (the rest is padding after it)."""
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _generate(model, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
              tokenizer, want_logits: bool, past_key_values=None):
    """One prompt's new tokens and, with `want_logits`, their raw logits `[T, V]`.
    `past_key_values`: a cache of `ids[:-1]` already computed (generate prefills the rest)."""
    new, logits = _generate_batch(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  tokenizer=tokenizer, want_logits=want_logits, past_key_values=past_key_values)
    return new[0], (logits[0] if want_logits else None)


def _generate_batch(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int,
                    tokenizer, want_logits: bool, past_key_values=None) -> tuple[list[list[int]], torch.Tensor | None]:
    """Many prompts at once (left-padded): each row's new tokens through its EOS and, with
    `want_logits`, the raw logits `[B, T, V]` (row b's first `len(new[b])` are its own)."""
    device = next(model.parameters()).device
    inp, mask = _left_pad(prompts, tokenizer.pad_token_id, device)
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True,
                                  output_logits=want_logits)
    if past_key_values is not None:
        kwargs["past_key_values"] = past_key_values
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=mask, **kwargs)
    new = [_through_eos(row, tokenizer.eos_token_id) for row in out.sequences[:, inp.shape[1]:].tolist()]
    return new, (torch.stack(out.logits, dim=1) if want_logits else None)


def _prompt_targets_batch(model, prefixes: list[list[int]], scored: list[int], cfg: SynthConfig,
                          pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`prompt_targets`' targets for many teacher prompts in one left-padded forward (no cache:
    `_generate_batch` prefills the answers' prompts itself)."""
    device = next(model.parameters()).device
    ids, mask = _left_pad([p[:-1] for p in prefixes], pad_id, device)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       logits_to_keep=max(max(scored), 1), use_cache=False).logits
    return [last_targets(logits[b], n, cfg) for b, n in enumerate(scored)]


def last_targets(logits: torch.Tensor, n: int, cfg: SynthConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`teacher_topk` of the last `n` rows of one prompt's logits (`[0, k]` tensors when `n` is 0)."""
    if n == 0:
        return torch.zeros((0, cfg.top_k), dtype=torch.int64), torch.zeros((0, cfg.top_k))
    return teacher_topk(logits[-n:], cfg.top_k, cfg.cover)


def synthesize_one(model, tokenizer, body: list[int], cfg: SynthConfig, spec: Spec) -> Conversation | None:
    """One conversation by HF `generate`, fully determined by `spec`. None when the question is empty."""
    system = system_message(tokenizer, body, spec.window)
    q_ids, _ = _generate(model, chat_ids(tokenizer, [system, {"role": "user", "content": spec.seed_prompt}]),
                         max_new_tokens=cfg.question_tokens, temperature=cfg.question_temperature,
                         seed=spec.question_seed, tokenizer=tokenizer, want_logits=False)
    question = tokenizer.decode(q_ids, skip_special_tokens=True).strip()
    if not question:
        return None
    user = {"role": "user", "content": question}
    teacher_prefix = chat_ids(tokenizer, [system, user])
    student_prefix = student_prompt_ids(tokenizer, user)
    # One prefill of the window serves both: the question targets from it, then generate goes on
    # from its cache (the answer costs no second prefill).
    (p_ids, p_lp), cache = prompt_targets(model, teacher_prefix,
                                          scored_prompt_tokens(teacher_prefix, student_prefix), cfg)
    answer, logits = _generate(model, teacher_prefix, max_new_tokens=cfg.answer_tokens, temperature=0.0,
                               seed=0, tokenizer=tokenizer, want_logits=True, past_key_values=cache)
    topk_ids, topk_lp = teacher_topk(logits, cfg.top_k, cfg.cover)
    return Conversation(spec.seed_type, spec.window, question, student_prefix, teacher_prefix, answer,
                        topk_ids, topk_lp, p_ids, p_lp)


def prompt_targets(model, teacher_prefix: list[int], scored: int, cfg: SynthConfig):
    """The teacher's top-k targets for the last `scored` tokens of its prompt, and the KV cache
    of all but the prompt's last token (one forward; row r of it predicts token r + 1, so the
    rows for the last `scored` tokens are the last `scored` of `teacher_prefix[:-1]`)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([teacher_prefix[:-1]], device=device),
                    logits_to_keep=max(scored, 1), use_cache=True)
    return last_targets(out.logits[0], scored, cfg), out.past_key_values


_BUILDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its PromptBuilder


def student_prompt_ids(tokenizer, user: dict[str, str]) -> list[int]:
    """The student's prompt after its cartridge: exactly what the gateway sends after a trained
    cartridge (`api.prompts`: the user turn right after the sink token, no BOS, no default system
    block), so the cartridge is trained on the prompt it will be served with."""
    builder = _BUILDERS.get(tokenizer)
    if builder is None:  # one per tokenizer: making one reads the whole vocabulary (~13 ms here)
        from lmcache_cartridge.api.prompts import PromptBuilder

        builder = _BUILDERS[tokenizer] = PromptBuilder(tokenizer)
    return builder.chat_ids([user], (), after_trained=True)


class Backend(Protocol):
    """Turns specs into conversations (None where the question came out empty)."""

    name: str
    batch: int  # conversations per call (and per saved shard)

    def run(self, body: list[int], cfg: SynthConfig, specs: list[Spec],
            done: Callable[[Conversation | None], None] | None = None) -> list[Conversation | None]:
        """`done` is called with each conversation as it is finished (progress)."""
        ...


class HFBackend:
    """HF transformers `generate`, one conversation at a time: the fallback where vLLM is not
    installed (and the reference the vLLM backend is tested against)."""

    name = "hf"
    batch = 8

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def run(self, body: list[int], cfg: SynthConfig, specs: list[Spec],
            done: Callable[[Conversation | None], None] | None = None) -> list[Conversation | None]:
        out = []
        for s in specs:
            out.append(synthesize_one(self.model, self.tokenizer, body, cfg, s))
            if done is not None:
                done(out[-1])
        return out


class HFBatchBackend:
    """HF transformers `generate` on `batch` conversations at once, left-padded: the fallback on
    a GPU, which one conversation at a time leaves nearly idle. Two rounds per batch, as the vLLM
    backend's: the questions (sampled), then one forward for the question targets and a greedy
    `generate` for the answers and their targets. Answers and targets are `HFBackend`'s up to
    rounding (`tests/test_synth_vllm.py`); the questions are sampled with one seed per batch (its
    first conversation's), so which question a conversation gets depends on the batch it is drawn
    in: the same `--synth-batch` draws the same data, a resumed run included (it resumes at a batch
    boundary)."""

    name = "hf-batch"

    def __init__(self, model, tokenizer, batch: int) -> None:
        self.model, self.tokenizer, self.batch = model, tokenizer, batch

    def run(self, body: list[int], cfg: SynthConfig, specs: list[Spec],
            done: Callable[[Conversation | None], None] | None = None) -> list[Conversation | None]:
        tok = self.tokenizer
        systems = [system_message(tok, body, s.window) for s in specs]
        q_new, _ = _generate_batch(self.model, [chat_ids(tok, [sy, {"role": "user", "content": s.seed_prompt}])
                                                for sy, s in zip(systems, specs)],
                                   max_new_tokens=cfg.question_tokens, temperature=cfg.question_temperature,
                                   seed=specs[0].question_seed, tokenizer=tok, want_logits=False)
        questions = [tok.decode(q, skip_special_tokens=True).strip() for q in q_new]
        live = [i for i, q in enumerate(questions) if q]
        out: list[Conversation | None] = [None] * len(specs)
        if live:
            users = [{"role": "user", "content": questions[i]} for i in live]
            teacher = [chat_ids(tok, [systems[i], u]) for i, u in zip(live, users)]
            student = [student_prompt_ids(tok, u) for u in users]
            prompt = _prompt_targets_batch(self.model, teacher, [scored_prompt_tokens(t, s)
                                                                 for t, s in zip(teacher, student)],
                                           cfg, tok.pad_token_id)
            answers, logits = _generate_batch(self.model, teacher, max_new_tokens=cfg.answer_tokens,
                                              temperature=0.0, seed=0, tokenizer=tok, want_logits=True)
            for row, i in enumerate(live):
                ids, lp = teacher_topk(logits[row, :len(answers[row])], cfg.top_k, cfg.cover)
                out[i] = Conversation(specs[i].seed_type, specs[i].window, questions[i], student[row], teacher[row],
                                      answers[row], ids, lp, *prompt[row])
        if done is not None:
            for c in out:
                done(c)
        return out


class ShardStore:
    """Finished batches of one synthesis stream, saved as they come (`<tag>-<first index>.pt`),
    so a stopped synthesis resumes after its last saved batch. Shards of other settings (another
    fingerprint) are ignored; `clear` removes the directory once the whole data set is saved."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.dir, self.fingerprint = Path(directory), fingerprint

    def load(self, tag: str) -> tuple[list[tuple[int, Conversation]], int]:
        """(index, conversation) pairs saved for `tag` and the next index to try."""
        kept: list[tuple[int, Conversation]] = []
        nxt = 0
        shards = []
        for path in self.dir.glob(f"{tag}-*.pt") if self.dir.is_dir() else ():
            try:
                d = torch.load(path, map_location="cpu", weights_only=True)
            except Exception:  # a shard torn by a kill is redone
                continue
            if d.get("fingerprint") == self.fingerprint and d.get("tag") == tag:
                shards.append(d)
        for d in sorted(shards, key=lambda d: d["first"]):
            if d["first"] != nxt:  # a gap: the rest is redone
                break
            kept += [(i, Conversation.from_dict(c)) for i, c in zip(d["indices"], d["convs"])]
            nxt = d["next"]
        return kept, nxt

    def save(self, tag: str, first: int, nxt: int, items: list[tuple[int, Conversation]]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{tag}-{first:08d}.pt"
        with atomic_open(path) as f:
            torch.save({"fingerprint": self.fingerprint, "tag": tag, "first": first, "next": nxt,
                        "indices": [i for i, _ in items], "convs": [c.to_dict() for _, c in items]}, f)

    def clear(self) -> None:
        if self.dir.is_dir():
            for path in self.dir.iterdir():
                path.unlink()
            self.dir.rmdir()


def synthesize(backend, tokenizer, text: str, cfg: SynthConfig, *, count: int, seed: int, tag: str,
               exclude_questions: set[str] = frozenset(), progress: bool = True,
               store: ShardStore | None = None) -> list[Conversation]:
    """`count` conversations (tag separates the training and held-out streams). Questions in
    `exclude_questions` are redrawn, so held-out questions are never training questions.
    `backend`: a `Backend`, or an HF model (then `HFBackend`). Which conversations are kept
    depends only on their index, not on the backend's batch size or on restarts."""
    from tqdm import tqdm

    if not hasattr(backend, "run"):
        backend = HFBackend(backend, tokenizer)
    body = document_body(tokenizer, text)
    if not body:
        raise ValueError("the document is empty")
    kept, index = store.load(tag) if store is not None else ([], 0)
    kept = [(i, c) for i, c in kept if c.question not in exclude_questions]
    limit = 4 * count + 16
    # smoothing=0: the rate (and ETA) is the average since the start, not of the last update
    # (a batch of vLLM conversations finishes at once).
    with tqdm(total=count, initial=min(len(kept), count), desc=f"self-study {tag} ({backend.name})",
              unit="conv", disable=not progress, dynamic_ncols=True, smoothing=0) as bar:
        while len(kept) < count:
            if index >= limit:
                raise CartridgeError(
                    f"could not synthesise {count} usable {tag} conversations in {index} attempts "
                    "(empty or repeated questions): the model does not follow the seed prompts"
                )
            n = min(backend.batch, limit - index, max(count - len(kept), 1) + (backend.batch // 8))
            specs = [plan(len(body), cfg, seed, tag, i, count) for i in range(index, index + n)]

            def done(c: Conversation | None) -> None:
                if c is not None and c.question not in exclude_questions and bar.n < count:
                    bar.update(1)

            new = [(s.index, c) for s, c in zip(specs, backend.run(body, cfg, specs, done))
                   if c is not None and c.question not in exclude_questions]
            if store is not None:
                store.save(tag, index, index + n, new)
            index += n
            kept += new
            if min(len(kept), count) > bar.n:  # backends that finish a batch at once report here
                bar.update(min(len(kept), count) - bar.n)
    return [c for _, c in kept[:count]]
