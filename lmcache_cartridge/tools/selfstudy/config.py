"""Settings of a self-study run: plain dataclasses, no torch, so the CLI parser stays light.

Read by every part of `train` (one process); the fingerprints decide whether a work directory's
data and checkpoint belong to a run (resume) or not (refused).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lmcache_cartridge.errors import CartridgeError

DTYPE_NAMES = ("bfloat16", "float16", "float32")
# The five seed prompt types of self-study (paper section 4.1; their prompts: `synth.SEED_PROMPTS`).
SEED_TYPES = ("structuring", "summarization", "question", "use_case", "creative")


@dataclass(frozen=True)
class SynthConfig:
    """How conversations are drawn; part of the run's fingerprint (not the backend that draws
    them: HF and vLLM give the same conversations up to rounding, `tests/test_synth_vllm.py`)."""

    window_min: int = 512
    window_max: int = 1024
    question_tokens: int = 64
    answer_tokens: int = 128
    question_temperature: float = 0.6
    top_k: int = 20
    cover: float = 0.99
    # Conversations that share one document window. By default window starts are spread evenly
    # over the document, both ends included, so every part of it is asked about as often
    # (uniform random starts under-sample the ends); sharing a window lets vLLM's prefix cache
    # prefill it once.
    per_window: int = 8
    # Where the windows lie. "even": starts spread evenly from the document's first token to its
    # last window, so a token near either end is in fewer windows than one in the middle (the
    # last ~330 tokens of a 1,766-token document in 19-57% as many). "tile": the document cut
    # into consecutive windows at random boundaries, one cut after another, so every token is
    # in as many windows.
    placement: str = "even"
    # The seed prompt types training conversations are drawn from, uniformly (default: all five,
    # the paper's mix). Held-out conversations always use all five: held-out KL measures the mix.
    seed_types: tuple[str, ...] = SEED_TYPES


PLACEMENTS = ("even", "tile")  # `SynthConfig.placement`'s values
INITS = ("first_k", "attention")  # `TrainConfig.init`'s values (`selfstudy.init`)


def parse_seed_types(spec: str | Sequence[str]) -> tuple[str, ...]:
    """`question,summarization` (or a sequence of names) as `SynthConfig.seed_types`: known
    types only, each once, in `SEED_TYPES` order (the same choice draws the same conversations)."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    unknown = [n for n in names if n not in SEED_TYPES]
    if unknown or not any(names):
        raise CartridgeError(f"--seed-types {','.join(names)!r}: give one or more of {','.join(SEED_TYPES)}, "
                             "comma-separated" + (f" ({', '.join(map(repr, unknown))} is not one)" if unknown else ""))
    return tuple(t for t in SEED_TYPES if t in names)


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    batch_size: int = 8
    # Conversations per forward pass: a step's gradient is accumulated over micro-batches of at
    # most this many, each weighted by its share of the step's scored tokens, so the step is the
    # same for any value (not part of the fingerprint) and memory is bounded by it, not by
    # batch_size (the full-vocabulary log-probs of a batch of 64 ran a 23.5 GiB machine out of memory).
    micro_batch: int = 8
    lr: float | None = None  # None: `default_lr` for the model being trained
    seed: int = 0
    eval_every: int = 25
    save_every: int = 25
    # The paper's objective sums over question and answer tokens (the student learns the
    # document's questions too, not only the answers); False scores answer tokens only.
    question_loss: bool = True
    # "constant" (the paper's) or "cosine": from `lr` down to `lr * COSINE_FLOOR` at the last
    # step, so a long run moves the KV early and settles late instead of drifting from its start.
    lr_schedule: str = "constant"
    # "bfloat16": each step's forward pass and loss under `torch.autocast` (the weights and the
    # KV stay in the training dtype), for CPUs with bf16 instructions (AMX, AVX-512 BF16); None:
    # the training dtype throughout. Held-out KL is computed without it either way.
    autocast: str | None = None
    # Train on each answer up to where it starts repeating itself (`synth.trim_repeats`: cut
    # before the first run of this many tokens seen earlier in the answer); 0: whole answers.
    # Held-out KL is computed on whole answers either way, so it compares across runs.
    trim_repeats: int = 0
    # Pull toward the first-k start: after each Adam step the KV moves `lr * anchor` of the way
    # back to its initial value (AdamW's decoupled weight decay, toward the start instead of
    # zero), so what the window held is kept while the loss moves the KV toward facts beyond it.
    # 0: off (the paper's objective).
    anchor: float = 0.0


LR_SCHEDULES = ("constant", "cosine")
COSINE_FLOOR = 0.1  # the cosine schedule's last rate, as a fraction of the first
AUTOCAST_DTYPES = ("bfloat16",)


def scheduled_lr(lr: float, schedule: str, step: int, steps: int) -> float:
    """The rate for optimiser step `step` (0-based) of `steps`: a pure function of the step, so
    a resumed run continues the same schedule."""
    if schedule == "constant" or steps <= 1:
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use one of {', '.join(LR_SCHEDULES)}")
    done = min(step, steps - 1) / (steps - 1)
    return lr * (COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * done)))


# Adam's learning rate for the cartridge's KV by model size, as measured: on SmolLM2-135M the
# paper's 2e-2 erased within 25 steps the facts the first-k start held (8 of 40 -> 3) while 2e-3
# kept them and reached almost the same held-out KL (docs/benchmarks.md, answer quality; chosen
# on the dev questions). Models of 1B-8B keep the paper's rate (its runs; not measured here).
SMALL_MODEL_PARAMS = 1_000_000_000
SMALL_MODEL_LR = 2e-3
PAPER_LR = 2e-2


def default_lr(num_params: int) -> float:
    """The learning rate `train` uses when none is given, for a model of `num_params` parameters."""
    return SMALL_MODEL_LR if num_params < SMALL_MODEL_PARAMS else PAPER_LR


def one_epoch(conversations: int, batch_size: int) -> int:
    """Steps that visit every training conversation once (the paper's scaling runs: one epoch
    over fresh conversations, none reused)."""
    return max(1, -(-conversations // batch_size))


SYNTH_BATCH = 128  # conversations per vLLM engine call by default: enough for a few CPU cores


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Fields marked in `fingerprint` decide the data and the optimisation:
    a work directory can only be resumed with the same values (steps may grow)."""

    model_dir: Path
    text_path: Path
    output: Path
    model_name: str | None = None          # vLLM's --model string (default: model_dir)
    cartridge_id: str | None = None
    tokens: int = 256                      # cartridge length (multiple of chunk_size)
    chunk_size: int = 256
    frozen_tokens: int = 1
    init: str = "first_k"                  # where the KV starts (`INITS`, `selfstudy.init`)
    init_first: int = 1                    # `attention`: leading tokens kept whatever their rank
    conversations: int = 256
    heldout: int = 16
    synth: SynthConfig = field(default_factory=SynthConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(steps=200))
    device: str = "auto"
    dtype: str | None = None               # training dtype (default float32 on CPU, bfloat16 on CUDA)
    kv_dtype: str | None = None            # packed KV dtype (default: the checkpoint's dtype)
    threads: int | None = None
    work_dir: Path | None = None           # default: OUTPUT.train beside the output
    adapter_dir: Path | None = None
    labels: tuple[str, ...] = ()
    overwrite: bool = False
    progress: bool = True
    synth_backend: str = "auto"            # auto | vllm | hf (see selfstudy.backends)
    synth_batch: int = SYNTH_BATCH         # conversations per vLLM engine call (the same data at any size)
    synth_eager: bool = False              # vLLM without torch.compile and CUDA graphs (a faster start)
    synth_dtype: str | None = None         # vLLM's dtype for synthesis (default: `vllm_synth.synth_dtype`)

    @property
    def work(self) -> Path:
        return self.work_dir or self.output.with_name(self.output.name + ".train")

    def data_fingerprint(self, text: str) -> str:
        synth = asdict(self.synth)
        if tuple(synth["seed_types"]) == SEED_TYPES:
            del synth["seed_types"]  # data drawn from all five before the option stay reusable
        if synth["placement"] == "even":
            del synth["placement"]  # likewise for data drawn before windows could be tiled
        return _digest({"model_dir": str(Path(self.model_dir).resolve()),
                        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                        "conversations": self.conversations, "heldout": self.heldout,
                        "synth": synth, "seed": self.loop.seed})

    def fingerprint(self, text: str) -> str:
        # a resumed run may change these: steps may grow, and the others leave every step as it is
        resumable = ("steps", "eval_every", "save_every", "micro_batch")
        loop = {k: v for k, v in asdict(self.loop).items() if k not in resumable}
        if loop["lr_schedule"] == "constant":
            del loop["lr_schedule"]  # checkpoints of runs from before the option stay resumable
        else:
            loop["steps"] = self.loop.steps  # the schedule depends on the run's length
        for name, off in (("autocast", None), ("trim_repeats", 0), ("anchor", 0.0)):
            if loop[name] == off:
                del loop[name]  # likewise: runs without them keep their fingerprint
        run = {"data": self.data_fingerprint(text), "tokens": self.tokens, "frozen_tokens": self.frozen_tokens,
               "loop": loop}
        if self.init != "first_k":
            run["init"] = self.init  # first-k runs keep their fingerprint
            if self.init_first != 1:
                run["init_first"] = self.init_first
        return _digest(run)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def check_length(tokens: int, chunk_size: int, frozen: int) -> None:
    """Refuse before any work what `pack_kv` would refuse after it (same rule, same advice)."""
    if tokens <= 0 or tokens % chunk_size:
        lower = tokens - tokens % chunk_size
        options = " or ".join(str(n) for n in (lower, lower + chunk_size) if n > 0)
        raise CartridgeError(
            f"--tokens {tokens} is not a multiple of the serving chunk size {chunk_size}: LMCache "
            f"loads only full chunks and would recompute the rest from placeholder tokens. Use {options}."
        )
    if not 0 <= frozen < tokens:
        raise CartridgeError(f"--frozen-tokens must be in [0, {tokens}), got {frozen}")
