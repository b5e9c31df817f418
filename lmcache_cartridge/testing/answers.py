"""Questions on the shipped document and the comparison of answers with and without a cartridge:
one reader of vLLM's completions for the demo, the real-model tests and `benchmarks/answers.py`,
and HF given the same KV as the reference a served answer is held to (the e2e tests, `benchmarks/fleet.py`).

A first-k cartridge stands for its document, so "with" must equal "without": same greedy text,
and per generated token the same logprob. `agreement` reports both over a set of questions (the
logprob difference over the tokens both answers share, up to and including the first token where
they part, so a divergence shows as a large difference, never as a silent gap).

Runs in the caller's process (HTTP to a vLLM server or the gateway); owns nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

QUESTION_FORMAT = "\n\nQuestion: {q}\nAnswer:"


@dataclass(frozen=True)
class Question:
    text: str
    fact: str  # what the right answer contains (the document states it): alternatives split by "|"

    def prompt(self) -> str:
        return QUESTION_FORMAT.format(q=self.text)

    def answered_by(self, answer: str) -> bool:
        # whole words: "9" is not in "19"
        return any(re.search(rf"(?<!\w){re.escape(f)}(?!\w)", answer, re.IGNORECASE) for f in self.fact.split("|"))


def questions() -> list[Question]:
    """The questions on the shipped document (`assets/lighthouse_questions.txt`)."""
    text = resources.files("lmcache_cartridge").joinpath("assets/lighthouse_questions.txt").read_text("utf-8")
    out = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            q, fact = line.split("\t")
            out.append(Question(q.strip(), fact.strip()))
    return out


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    seconds: float


def complete(url: str, body: dict[str, Any], timeout: float = 600) -> Answer:
    """POST a greedy completion with per-token logprobs (to vLLM or the gateway) and read it."""
    import httpx

    body = {"temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True, **body}
    t0 = time.perf_counter()
    r = httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=timeout)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:500]}")
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return Answer(c["text"], ids, [float(x) for x in lp["token_logprobs"]], seconds)


@dataclass
class Agreement:
    """How far answers with a cartridge are from those without, over `n` questions."""

    n: int
    equal: int                 # greedy texts equal
    max_dlogprob: float        # largest |logprob difference| of one generated token
    mean_dlogprob: float       # mean over every compared token
    differ: list[int]          # indices of the questions whose texts differ

    def summary(self) -> str:
        return (f"{self.equal}/{self.n} answers equal, max |dlogprob| {self.max_dlogprob:.4f}, "
                f"mean {self.mean_dlogprob:.4f}")


def agreement(base: Sequence[Answer], got: Sequence[Answer]) -> Agreement:
    diffs, differ = [], []
    for i, (a, b) in enumerate(zip(base, got, strict=True)):
        if a.text != b.text:
            differ.append(i)
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            diffs.append(abs(la - lb))
            if ta != tb:
                break
    return Agreement(n=len(base), equal=len(base) - len(differ), max_dlogprob=max(diffs, default=0.0),
                     mean_dlogprob=sum(diffs) / len(diffs) if diffs else 0.0, differ=differ)


# --- HF as the reference for a served answer, given the same KV ---------------------------------
HF_MEAN_TOL = 0.25       # vLLM vs HF given the same KV: mean |dlogprob| over generated tokens
HF_MAX_TOL = 0.6         # ... and the largest single-token difference


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def mean_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def hf_teacher_forced(model, kv: "torch.Tensor", user: list[int], gen_ids: list[int],
                      dtype: "torch.dtype") -> tuple[list[int], list[float], list[float]]:
    """HF given `kv` as past_key_values (positions offset by its length), teacher-forced on
    `gen_ids`: per step the argmax, the logprob of `gen_ids`' token, and the best logprob."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_to_cache

    m = model.to(dtype)
    n = kv.shape[2]
    seq = user + gen_ids[:-1]
    ids = torch.tensor([seq])
    pos = torch.arange(n, n + len(seq)).unsqueeze(0)
    with torch.inference_mode():
        out = m(input_ids=ids, past_key_values=kv_to_cache(kv.to(dtype), m.config), position_ids=pos,
                use_cache=True)
    logp = torch.log_softmax(out.logits[0, len(user) - 1:].float(), dim=-1)
    greedy = logp.argmax(-1).tolist()
    chosen = [float(logp[i, t]) for i, t in enumerate(gen_ids)]
    best = logp.max(-1).values.tolist()
    return greedy, chosen, best
