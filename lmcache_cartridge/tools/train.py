"""`lmcache-cartridge train`: a trained cartridge for a document by self-study distillation.

Runs offline on an operator's machine (CPU or one CUDA device), never on the serving path. It
owns its work directory (synthesised data, checkpoint, metrics log) and writes its output with
`pack_kv` (kind `trained`) ready for `register`, plus, on request, the PEFT adapter directory.

create -> train -> pack -> register -> serve: the first-k initialisation is the same KV
`create` makes from the document's first tokens (through the chat template's system message);
training then moves every token's KV but the first (the attention sink). A trained cartridge's
length must be a multiple of the serving chunk size: LMCache loads only full chunks and vLLM
would recompute the rest from placeholder tokens, a wrong answer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.stopping import sigterm_as_interrupt
from lmcache_cartridge.tools.selfstudy.config import (AUTOCAST_DTYPES, COSINE_FLOOR, DTYPE_NAMES, INITS,
                                                      LR_SCHEDULES, PAPER_LR, PLACEMENTS, SMALL_MODEL_LR, SYNTH_BATCH,
                                                      LoopConfig, SynthConfig, TrainConfig, one_epoch, parse_seed_types)


# --- command line (tools/cli.py's `train`: its arguments and its command) ----------------------
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d, s = LoopConfig(steps=200), SynthConfig()
    p.add_argument("--model-dir", required=True, help="local HF model directory (the served model)")
    p.add_argument("--text", required=True, help="UTF-8 document to train the cartridge on")
    p.add_argument("-o", "--output", required=True, help="packed cartridge directory to create")
    p.add_argument("--model", help="model name as vLLM's --model, recorded in the manifest (default: --model-dir)")
    p.add_argument("--id", help="cartridge id (default: from the output name)")
    p.add_argument("--tokens", type=int, default=256, help="cartridge length, a multiple of --chunk-size (default 256)")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size of the serving config")
    p.add_argument("--frozen-tokens", type=int, default=1,
                   help="leading tokens kept fixed (the attention sink; default 1)")
    p.add_argument("--init", choices=INITS, default="first_k",
                   help="where the KV starts: first_k, the document's first --tokens tokens (the paper's; default), "
                   "or attention, the whole document's KV, each layer keeping its first --init-first positions "
                   "and the most attended others")
    p.add_argument("--init-first", type=int, default=1, metavar="N",
                   help="with --init attention: leading document tokens kept whatever their rank (default 1, the "
                   "attention sink)")
    p.add_argument("--conversations", type=int, default=256, help="synthesised training conversations")
    p.add_argument("--heldout", type=int, default=16, help="held-out conversations for the KL metric")
    p.add_argument("--steps", type=int, help="optimiser steps (default: one epoch, every conversation once, as the "
                   "paper's scaling runs; more conversations rather than more epochs)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"conversations per step (default {d.batch_size})")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, metavar="N",
                   help=f"conversations per forward pass (default {d.micro_batch}): a step's gradient is "
                   "accumulated over parts of at most N, the same step for any N, with memory bounded by N")
    p.add_argument("--lr", type=float,
                   help=f"Adam learning rate for the KV (default: {SMALL_MODEL_LR:g} for models under 1B parameters, "
                   f"measured on SmolLM2-135M, where the paper's {PAPER_LR:g} erased the facts the first-k start "
                   f"held; {PAPER_LR:g}, the paper's, from 1B up; docs/benchmarks.md)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule,
                   help=f"constant (the paper's; default {d.lr_schedule}) or cosine: from --lr down to "
                   f"{COSINE_FLOOR:g}x --lr at the last step")
    p.add_argument("--anchor", type=float, default=d.anchor, metavar="A",
                   help="after each step move the KV lr*A of the way back to its start (decoupled, as "
                   "AdamW's weight decay), keeping what the window held while training learns beyond it; "
                   "0: off (default %(default)g)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed for synthesis, batches and initialisation (same seed, same cartridge)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help=f"steps between held-out KL evaluations (default {d.eval_every})")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"steps between checkpoints (default {d.save_every})")
    p.add_argument("--window-min", type=int, default=s.window_min, help="document window, tokens (min)")
    p.add_argument("--window-max", type=int, default=s.window_max, help="document window, tokens (max)")
    p.add_argument("--question-tokens", type=int, default=s.question_tokens,
                   help="longest synthesised question, tokens")
    p.add_argument("--answer-tokens", type=int, default=s.answer_tokens, help="longest synthesised answer, tokens")
    p.add_argument("--top-k", type=int, default=s.top_k, help="teacher log-probs kept per scored token")
    p.add_argument("--per-window", type=int, default=s.per_window,
                   help=f"conversations per document window (default {s.per_window})")
    p.add_argument("--window-placement", choices=PLACEMENTS, default=s.placement,
                   help="where the document windows lie: 'even' spreads their starts evenly from the document's "
                   "first token to its last window (a token near either end is in fewer windows); 'tile' cuts "
                   "the document into consecutive windows at random boundaries, again and again, so every "
                   "token is in as many windows (default %(default)s)")
    p.add_argument("--seed-types", default=",".join(s.seed_types), metavar="TYPES",
                   help="seed prompt types the training conversations are drawn from, comma-separated (default: "
                   "all five, the paper's mix: %(default)s); held-out conversations always use all five")
    p.add_argument("--no-question-loss", dest="question_loss", action="store_false",
                   help="score answer tokens only (default: question and answer tokens, the paper's objective)")
    add_engine_arguments(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="training dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--trim-repeats", type=int, default=d.trim_repeats, metavar="N",
                   help="train on each answer up to where it starts repeating itself (before the first run of N "
                   "tokens seen earlier in it); 0: whole answers (default %(default)s)")
    p.add_argument("--autocast", choices=AUTOCAST_DTYPES,
                   help="run each step's forward pass and loss under torch.autocast to this dtype (CPUs with "
                   "bf16 instructions: AMX, AVX-512 BF16; default: off, the training dtype throughout)")
    p.add_argument("--kv-dtype", choices=DTYPE_NAMES, help="packed KV dtype (default: the model's)")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--work-dir", help="data, checkpoint and metrics.jsonl (default: OUTPUT.train); rerun to resume")
    p.add_argument("--adapter-dir", help="also save the PEFT CARTRIDGE adapter here")
    p.add_argument("--label", action="append", help="label (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Who writes the conversations and how (not which: none of these is in the data's fingerprint)."""
    p.add_argument("--synth-backend", default="auto", choices=("auto", "vllm", "hf"),
                   help="who writes the conversations: vllm (an in-process engine, many in flight), hf "
                   "(transformers generate: one at a time on CPU, --synth-batch at a time on CUDA); auto: vllm "
                   "where installed")
    p.add_argument("--synth-batch", type=int, default=SYNTH_BATCH, metavar="N",
                   help="conversations per vLLM engine call, or per HF generate call on CUDA (default %(default)s, "
                   "for two CPU cores; ~1024 on a GPU); vLLM writes the same conversations at any size, HF on "
                   "CUDA the same ones for the same size")
    p.add_argument("--synth-eager", action="store_true",
                   help="run vLLM's synthesis engine without torch.compile and CUDA graphs: a faster start, and "
                   "a step of more sequences than vLLM captures graphs for (512) runs without one anyway")
    p.add_argument("--synth-dtype", choices=("auto", *DTYPE_NAMES),
                   help="dtype vLLM writes the conversations in (default: the checkpoint's, 'auto', except on a "
                   "CPU without native bf16 (AVX2 only: no AVX-512 BF16, no AMX), where float32 is several times "
                   "faster than bf16); the conversations differ only by rounding")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model_dir=Path(args.model_dir), text_path=Path(args.text), output=Path(args.output),
        model_name=args.model, cartridge_id=args.id, tokens=args.tokens, chunk_size=args.chunk_size,
        frozen_tokens=args.frozen_tokens, init=args.init, init_first=args.init_first,
        conversations=args.conversations, heldout=args.heldout,
        synth=SynthConfig(window_min=args.window_min, window_max=args.window_max,
                          question_tokens=args.question_tokens, answer_tokens=args.answer_tokens, top_k=args.top_k,
                          per_window=args.per_window, placement=args.window_placement,
                          seed_types=parse_seed_types(args.seed_types)),
        loop=LoopConfig(steps=args.steps or one_epoch(args.conversations, args.batch_size), batch_size=args.batch_size,
                        micro_batch=args.micro_batch, lr=args.lr, seed=args.seed, eval_every=args.eval_every,
                        save_every=args.save_every, question_loss=args.question_loss, lr_schedule=args.lr_schedule,
                        autocast=args.autocast, trim_repeats=args.trim_repeats, anchor=args.anchor),
        device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, threads=args.threads,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        adapter_dir=Path(args.adapter_dir) if args.adapter_dir else None,
        labels=tuple(args.label or ()), overwrite=args.overwrite, progress=not args.quiet,
        synth_backend=args.synth_backend, synth_batch=args.synth_batch, synth_eager=args.synth_eager,
        synth_dtype=args.synth_dtype,
    )


def run_train(args: argparse.Namespace) -> int:
    from lmcache_cartridge.tools.selfstudy.run import train_cartridge

    cfg = config_from_args(args)
    try:
        res = train_cartridge(cfg)
    except ModuleNotFoundError as e:
        if e.name != "peft":
            raise
        raise CartridgeError("training needs PEFT >= 0.21 (its CARTRIDGE adapter): "
                             "pip install 'lmcache-cartridge[train]'") from None
    m, kl = res.manifest, res.provenance["heldout_kl"]
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    print(f"trained {m.cartridge_id}: {m.num_tokens} tokens, {cfg.loop.steps} steps, "
          f"held-out KL {fmt(kl['init'])} (start) -> {fmt(kl['final'])}, "
          f"{fmt(res.provenance['seconds_per_step'])} s/step -> {cfg.output}"
          + (f"; adapter -> {res.adapter_dir}" if res.adapter_dir else "")
          + f"; metrics: {cfg.work / 'metrics.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="lmcache-cartridge train", description=__doc__.splitlines()[0])
    add_train_arguments(p)
    args = p.parse_args(argv)
    try:
        with sigterm_as_interrupt():  # the synthesis engine stops with the command
            return run_train(args)
    except CartridgeError as e:
        print(f"lmcache-cartridge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
