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
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy.loop import LoopConfig, LoopResult, build_student, encoder_of, run_loop
from lmcache_cartridge.tools.selfstudy.synth import SEED_TYPES, Conversation, SynthConfig, synthesize

DATA_NAME = "data.pt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    @property
    def work(self) -> Path:
        return self.work_dir or self.output.with_name(self.output.name + ".train")

    def data_fingerprint(self, text: str) -> str:
        return _digest({"model_dir": str(Path(self.model_dir).resolve()),
                        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                        "conversations": self.conversations, "heldout": self.heldout,
                        "synth": asdict(self.synth), "seed": self.loop.seed})

    def fingerprint(self, text: str) -> str:
        loop = {k: v for k, v in asdict(self.loop).items() if k not in ("steps", "eval_every", "save_every")}
        return _digest({"data": self.data_fingerprint(text), "tokens": self.tokens,
                        "frozen_tokens": self.frozen_tokens, "loop": loop})


@dataclass
class TrainResult:
    manifest: Any
    loop: LoopResult
    adapter_dir: Path | None
    provenance: dict[str, Any]


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CartridgeError(f"--device {name}: this torch build or machine has no CUDA device")
    return device


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the model is stored (and served) in."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    return getattr(torch, d) if isinstance(d, str) else d


def load_for_training(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer): SDPA attention (no FlexAttention, any device), eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(model_dir) / "config.json").is_file():
        raise CartridgeError(f"{model_dir} has no config.json: pass a local HF model directory")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.chat_template is None:
        raise CartridgeError(f"the tokenizer in {model_dir} has no chat template; self-study needs one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return model.to(device).eval(), tokenizer


def export_kv(student) -> torch.Tensor:
    """The cartridge as canonical KV `[2, L, T, H, D]` from PEFT's prompt embeddings
    (`[T, L*2*H*D]`, per token: layer 0 K, layer 0 V, layer 1 K, ...)."""
    cfg = student.peft_config[student.active_adapter]
    heads = cfg.num_attention_heads  # PEFT sets the KV head count for GQA models
    w = encoder_of(student).weight.detach().float().cpu()
    return w.view(w.shape[0], cfg.num_layers, 2, heads, cfg.token_dim // heads).permute(2, 1, 0, 3, 4).contiguous()


def load_or_synthesize(cfg: TrainConfig, model, tokenizer, text: str) -> tuple[list[Conversation], list[Conversation]]:
    """The run's conversations: read from the work dir when it holds this run's data, else made
    and saved there (so a resumed run trains on the same data)."""
    path = cfg.work / DATA_NAME
    fp = cfg.data_fingerprint(text)
    if path.exists():
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("fingerprint") == fp:
            return ([Conversation.from_dict(d) for d in data["train"]],
                    [Conversation.from_dict(d) for d in data["heldout"]])
    train = synthesize(model, tokenizer, text, cfg.synth, count=cfg.conversations, seed=cfg.loop.seed,
                       tag="train", progress=cfg.progress)
    heldout = synthesize(model, tokenizer, text, cfg.synth, count=cfg.heldout, seed=cfg.loop.seed,
                         tag="heldout", exclude_questions={c.question for c in train}, progress=cfg.progress)
    cfg.work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"fingerprint": fp, "train": [c.to_dict() for c in train],
                "heldout": [c.to_dict() for c in heldout]}, tmp)
    tmp.replace(path)
    return train, heldout


def train_cartridge(cfg: TrainConfig) -> TrainResult:
    """Synthesise (or reload) the data, train (or resume), pack the cartridge, save the adapter."""
    import peft
    import transformers

    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv

    check_length(cfg.tokens, cfg.chunk_size, cfg.frozen_tokens)
    if cfg.output.exists() and not cfg.overwrite:
        raise CartridgeError(f"{cfg.output} already exists (use --overwrite to replace it)")
    if cfg.conversations < 1 or cfg.loop.batch_size < 1 or cfg.loop.steps < 1:
        raise CartridgeError("--conversations, --batch-size and --steps must be positive")
    text = Path(cfg.text_path).read_text(encoding="utf-8")
    if not text.strip():
        raise CartridgeError(f"{cfg.text_path} is empty: give the document the cartridge should hold")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype] if cfg.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    kv_dtype = DTYPES[cfg.kv_dtype] if cfg.kv_dtype else checkpoint_dtype(cfg.model_dir)

    model, tokenizer = load_for_training(cfg.model_dir, device, dtype)
    train, heldout = load_or_synthesize(cfg, model, tokenizer, text)
    student = build_student(model, tokenizer, text, cfg.tokens, cfg.frozen_tokens)
    t0 = time.time()
    result = run_loop(student, train, heldout, cfg.loop, work_dir=cfg.work, fingerprint=cfg.fingerprint(text),
                      pad_id=tokenizer.pad_token_id, progress=cfg.progress)
    wall = time.time() - t0

    kls = result.heldout_kl
    seed_types = {t: sum(c.seed_type == t for c in train) for t in SEED_TYPES}
    provenance: dict[str, Any] = {
        "method": "self_study",
        "base_model": getattr(model.config, "_name_or_path", None) or str(cfg.model_dir),
        "model_dir": str(cfg.model_dir),
        "init": "first_k",
        "num_frozen_tokens": cfg.frozen_tokens,
        "steps": cfg.loop.steps,
        "data": {"source": str(cfg.text_path), "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
                 "conversations": len(train), "heldout_conversations": len(heldout),
                 "answer_tokens": sum(len(c.answer) for c in train), "seed_types": seed_types,
                 "synth": asdict(cfg.synth)},
        "loss": {"last": result.losses[-1] if result.losses else None,
                 "first": result.losses[0] if result.losses and not result.resumed_from else None},
        "heldout_kl": {"init": kls.get(0), "final": kls.get(cfg.loop.steps)},
        "optimizer": {"name": "Adam", "lr": cfg.loop.lr, "batch_size": cfg.loop.batch_size, "seed": cfg.loop.seed},
        "device": str(device), "train_dtype": str(dtype).removeprefix("torch."),
        "seconds_per_step": (sum(result.step_seconds) / len(result.step_seconds)) if result.step_seconds else None,
        "train_wall_seconds": wall,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }
    manifest = pack_kv(
        export_kv(student), cfg.output,
        cartridge_id=cfg.cartridge_id or _default_id(cfg.output),
        model=cfg.model_name or str(cfg.model_dir), kind="trained",
        vocab=VocabInfo(len(tokenizer), tuple(tokenizer.all_special_ids)),
        chunk_size=cfg.chunk_size, dtype=kv_dtype, provenance=provenance, labels=cfg.labels,
        overwrite=cfg.overwrite, progress=cfg.progress,
    )
    if cfg.adapter_dir is not None:
        student.save_pretrained(str(cfg.adapter_dir))
    return TrainResult(manifest, result, cfg.adapter_dir, provenance)


def _default_id(path: Path) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", path.name).strip("-.") or "cartridge"


# --- command line (the lead wires `train` in tools/cli.py with these two) ----------------------
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d, s = LoopConfig(steps=200), SynthConfig()
    p.add_argument("--model-dir", required=True, help="local HF model directory (the served model)")
    p.add_argument("--text", required=True, help="UTF-8 document to train the cartridge on")
    p.add_argument("-o", "--output", required=True, help="packed cartridge directory to create")
    p.add_argument("--model", help="model name as vLLM's --model, recorded in the manifest (default: --model-dir)")
    p.add_argument("--id", help="cartridge id (default: from the output name)")
    p.add_argument("--tokens", type=int, default=256, help="cartridge length, a multiple of --chunk-size (default 256)")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size of the serving config")
    p.add_argument("--frozen-tokens", type=int, default=1, help="leading tokens kept fixed (the attention sink; default 1)")
    p.add_argument("--conversations", type=int, default=256, help="synthesised training conversations")
    p.add_argument("--heldout", type=int, default=16, help="held-out conversations for the KL metric")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--window-min", type=int, default=s.window_min, help="document window, tokens (min)")
    p.add_argument("--window-max", type=int, default=s.window_max, help="document window, tokens (max)")
    p.add_argument("--question-tokens", type=int, default=s.question_tokens)
    p.add_argument("--answer-tokens", type=int, default=s.answer_tokens)
    p.add_argument("--top-k", type=int, default=s.top_k, help="teacher log-probs kept per answer token")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="training dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--kv-dtype", choices=sorted(DTYPES), help="packed KV dtype (default: the model's)")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--work-dir", help="data, checkpoint and metrics.jsonl (default: OUTPUT.train); rerun to resume")
    p.add_argument("--adapter-dir", help="also save the PEFT CARTRIDGE adapter here")
    p.add_argument("--label", action="append", help="label (repeatable)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model_dir=Path(args.model_dir), text_path=Path(args.text), output=Path(args.output),
        model_name=args.model, cartridge_id=args.id, tokens=args.tokens, chunk_size=args.chunk_size,
        frozen_tokens=args.frozen_tokens, conversations=args.conversations, heldout=args.heldout,
        synth=SynthConfig(window_min=args.window_min, window_max=args.window_max,
                          question_tokens=args.question_tokens, answer_tokens=args.answer_tokens, top_k=args.top_k),
        loop=LoopConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        eval_every=args.eval_every, save_every=args.save_every),
        device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, threads=args.threads,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        adapter_dir=Path(args.adapter_dir) if args.adapter_dir else None,
        labels=tuple(args.label or ()), overwrite=args.overwrite, progress=not args.quiet,
    )


def run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    res = train_cartridge(cfg)
    m, kl = res.manifest, res.provenance["heldout_kl"]
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    print(f"trained {m.cartridge_id}: {m.num_tokens} tokens, {cfg.loop.steps} steps, "
          f"held-out KL {fmt(kl['init'])} (first-k) -> {fmt(kl['final'])}, "
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
        return run_train(args)
    except CartridgeError as e:
        print(f"lmcache-cartridge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
