"""One self-study run end to end: load the model, synthesise (or reload) the data, train (or
resume), export the cartridge's KV, pack it (kind `trained`), save the PEFT adapter.

Runs in the `train` process on CPU or one CUDA device; owns the work directory's `data.pt`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import atomic_open
from lmcache_cartridge.tools.selfstudy.config import INITS, LoopConfig, TrainConfig, check_length, parse_seed_types
from lmcache_cartridge.tools.selfstudy.loop import LoopResult, build_student, encoder_of, learning_rate, run_loop
from lmcache_cartridge.tools.selfstudy.synth import (SEED_TYPES, Conversation, HFBackend, HFBatchBackend, ShardStore,
                                                     synthesize, trim_repeats)

DATA_NAME = "data.pt"
SHARDS_NAME = "synth"  # finished synthesis batches of an unfinished data set (resume)
SYNTH_BACKENDS = ("auto", "vllm", "hf")


@dataclass
class TrainResult:
    manifest: Any
    loop: LoopResult
    adapter_dir: Path | None
    provenance: dict[str, Any]


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


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not (Path(model_dir) / "config.json").is_file():
        raise CartridgeError(f"{model_dir} has no config.json: pass a local HF model directory")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.chat_template is None:
        raise CartridgeError(f"the tokenizer in {model_dir} has no chat template; self-study needs one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def load_for_training(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer): SDPA attention (no FlexAttention, any device), eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


def synth_backend_name(choice: str) -> str:
    """`auto`: vLLM where it is importable (many conversations in flight), else HF `generate`."""
    if choice not in SYNTH_BACKENDS:
        raise CartridgeError(f"--synth-backend must be one of {', '.join(SYNTH_BACKENDS)}, got {choice!r}")
    from lmcache_cartridge.tools.selfstudy.vllm_synth import vllm_available

    if choice == "auto":
        return "vllm" if vllm_available() else "hf"
    if choice == "vllm" and not vllm_available():
        raise CartridgeError("--synth-backend vllm: vLLM is not installed here (use hf, or install "
                             "'lmcache-cartridge[cpu]' / vllm)")
    return choice


def export_kv(student) -> torch.Tensor:
    """The cartridge as canonical KV `[2, L, T, H, D]` from PEFT's prompt embeddings
    (`[T, L*2*H*D]`, per token: layer 0 K, layer 0 V, layer 1 K, ...)."""
    cfg = student.peft_config[student.active_adapter]
    heads = cfg.num_attention_heads  # PEFT sets the KV head count for GQA models
    w = encoder_of(student).weight.detach().float().cpu()
    return w.view(w.shape[0], cfg.num_layers, 2, heads, cfg.token_dim // heads).permute(2, 1, 0, 3, 4).contiguous()


def vllm_backend(cfg: TrainConfig, tokenizer):
    """The run's vLLM synthesis engine, not yet started (it starts on first use)."""
    from lmcache_cartridge.tools.selfstudy.vllm_synth import VllmBackend

    return VllmBackend(cfg.model_dir, tokenizer, cfg.synth, seed=cfg.loop.seed, batch=cfg.synth_batch,
                       enforce_eager=cfg.synth_eager, dtype=cfg.synth_dtype)


def load_or_synthesize(cfg: TrainConfig, model, tokenizer, text: str, *,
                       backend=None) -> tuple[list[Conversation], list[Conversation]]:
    """The run's conversations: read from the work dir when it holds this run's data, else made
    and saved there (so a resumed run trains on the same data). Batches are saved as they finish
    (`synth/`), so a stopped synthesis resumes. `model`: the HF model for the HF backend (loaded
    here when None and needed); `backend`: one to use instead of `cfg.synth_backend`'s."""
    path = cfg.work / DATA_NAME
    fp = cfg.data_fingerprint(text)
    if path.exists():
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("fingerprint") == fp:
            return ([Conversation.from_dict(d) for d in data["train"]],
                    [Conversation.from_dict(d) for d in data["heldout"]])
    own = None
    if backend is None:
        if synth_backend_name(cfg.synth_backend) == "vllm":
            backend = own = vllm_backend(cfg, tokenizer)
        else:
            device = resolve_device(cfg.device)
            # on CUDA many at once, in the dtype the model is served in (as vLLM would write them)
            batched = device.type == "cuda"
            if model is None:
                model, _ = load_for_training(cfg.model_dir, device,
                                             checkpoint_dtype(cfg.model_dir) if batched else torch.float32)
            backend = HFBatchBackend(model, tokenizer, cfg.synth_batch) if batched else HFBackend(model, tokenizer)
    store = ShardStore(cfg.work / SHARDS_NAME, fp)
    try:
        train = synthesize(backend, tokenizer, text, cfg.synth, count=cfg.conversations, seed=cfg.loop.seed,
                           tag="train", progress=cfg.progress, store=store)
        # held-out from all five seed types on evenly spread windows, whatever training draws from: KL on
        # the conversations a default run sees
        heldout = synthesize(backend, tokenizer, text, replace(cfg.synth, seed_types=SEED_TYPES, placement="even"),
                             count=cfg.heldout, seed=cfg.loop.seed,
                             tag="heldout", exclude_questions={c.question for c in train}, progress=cfg.progress,
                             store=store)
    finally:
        if own is not None:
            own.close()  # the engine's memory and cores go back before training
    cfg.work.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as f:
        torch.save({"fingerprint": fp, "backend": backend.name, "train": [c.to_dict() for c in train],
                    "heldout": [c.to_dict() for c in heldout]}, f)
    store.clear()
    return train, heldout


def train_cartridge(cfg: TrainConfig) -> TrainResult:
    """Synthesise (or reload) the data, train (or resume), pack the cartridge, save the adapter."""
    import peft
    import transformers

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registration import load_vocab

    check_config(cfg)
    cartridge_id = run_id(cfg)  # refused now, not after training
    # known types, in canonical order: the same choice draws the same conversations
    cfg = replace(cfg, synth=replace(cfg.synth, seed_types=parse_seed_types(cfg.synth.seed_types)))
    text = Path(cfg.text_path).read_text(encoding="utf-8")
    if not text.strip():
        raise CartridgeError(f"{cfg.text_path} is empty: give the document the cartridge should hold")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    kv_dtype = getattr(torch, cfg.kv_dtype) if cfg.kv_dtype else checkpoint_dtype(cfg.model_dir)

    # Synthesis first: a vLLM engine and the training model need not share the memory.
    train, heldout = load_or_synthesize(cfg, None, load_tokenizer(cfg.model_dir), text)
    whole_answer_tokens = sum(len(c.answer) for c in train)
    train = [trim_repeats(c, cfg.loop.trim_repeats) for c in train]
    model, tokenizer = load_for_training(cfg.model_dir, device, dtype)
    student = build_student(model, tokenizer, text, cfg.tokens, cfg.frozen_tokens, cfg.init, cfg.init_first)
    # the rate is fixed before the fingerprint (a resumed run keeps it) and recorded in provenance
    cfg = replace(cfg, loop=replace(cfg.loop, lr=learning_rate(cfg.loop, student)))
    check_anchor(cfg.loop)
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
        "init": cfg.init, **({"init_first": cfg.init_first} if cfg.init == "attention" else {}),
        "num_frozen_tokens": cfg.frozen_tokens,
        "steps": cfg.loop.steps,
        "data": {"source": str(cfg.text_path), "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
                 "conversations": len(train), "heldout_conversations": len(heldout),
                 "answer_tokens": whole_answer_tokens, "answer_tokens_trained": sum(len(c.answer) for c in train),
                 "trim_repeats": cfg.loop.trim_repeats, "seed_types": seed_types,
                 "synth": asdict(cfg.synth)},
        "loss": {"last": result.losses[-1] if result.losses else None,
                 "first": result.losses[0] if result.losses and not result.resumed_from else None},
        "loss_tokens": "question+answer" if cfg.loop.question_loss else "answer",
        "heldout_kl": {"init": kls.get(0), "final": kls.get(cfg.loop.steps)},
        "optimizer": {"name": "Adam", "lr": cfg.loop.lr, "lr_schedule": cfg.loop.lr_schedule, "anchor": cfg.loop.anchor,
                      "batch_size": cfg.loop.batch_size, "seed": cfg.loop.seed},
        "device": str(device), "train_dtype": str(dtype).removeprefix("torch."), "autocast": cfg.loop.autocast,
        "seconds_per_step": (sum(result.step_seconds) / len(result.step_seconds)) if result.step_seconds else None,
        "train_wall_seconds": wall,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }
    manifest = pack_kv(
        export_kv(student), cfg.output,
        cartridge_id=cartridge_id,
        model=cfg.model_name or str(cfg.model_dir), kind="trained",
        vocab=load_vocab(tokenizer),
        chunk_size=cfg.chunk_size, dtype=kv_dtype, provenance=provenance, labels=cfg.labels,
        overwrite=cfg.overwrite, progress=cfg.progress,
    )
    if cfg.adapter_dir is not None:
        student.save_pretrained(str(cfg.adapter_dir))
    return TrainResult(manifest, result, cfg.adapter_dir, provenance)


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any work, settings `train` cannot run."""
    check_length(cfg.tokens, cfg.chunk_size, cfg.frozen_tokens)
    if cfg.output.exists() and not cfg.overwrite:
        raise CartridgeError(f"{cfg.output} already exists (use --overwrite to replace it)")
    if min(cfg.conversations, cfg.loop.batch_size, cfg.loop.micro_batch, cfg.loop.steps) < 1:
        raise CartridgeError("--conversations, --batch-size, --micro-batch and --steps must be positive")
    if cfg.synth_batch < 1:
        raise CartridgeError(f"--synth-batch must be positive (conversations per vLLM engine call), "
                             f"got {cfg.synth_batch}")
    if not 1 <= cfg.synth.window_min <= cfg.synth.window_max:
        raise CartridgeError(f"--window-min {cfg.synth.window_min} and --window-max {cfg.synth.window_max}: give "
                             "a positive minimum no larger than the maximum (tokens of the document per window)")
    if cfg.loop.trim_repeats < 0:
        raise CartridgeError(f"--trim-repeats must be 0 (whole answers) or a positive run length, "
                             f"got {cfg.loop.trim_repeats}")
    if cfg.init not in INITS:
        raise CartridgeError(f"--init {cfg.init!r}: use one of {', '.join(INITS)}")
    if not 1 <= cfg.init_first <= cfg.tokens:
        raise CartridgeError(f"--init-first {cfg.init_first}: give 1 (the sink only) to --tokens {cfg.tokens} "
                             "(the first-k start) leading tokens to keep")
    check_anchor(cfg.loop)  # its sign now; its share of the way back once the rate is known


def check_anchor(loop: LoopConfig) -> None:
    """`--anchor` moves the KV `lr * anchor` of the way back each step: that share must lie in [0, 1]
    (with no rate yet, only the anchor's sign is checked)."""
    if loop.anchor < 0:
        raise CartridgeError(f"--anchor must be 0 (off) or positive, got {loop.anchor:g}")
    if loop.lr is not None and loop.anchor * loop.lr > 1:
        raise CartridgeError(f"--anchor {loop.anchor:g} at --lr {loop.lr:g} would move the KV "
                             f"{loop.anchor * loop.lr:g} of the way back to its start each step; give an anchor "
                             f"in [0, {1 / loop.lr:g}] (0: off)")


def run_id(cfg: TrainConfig) -> str:
    """The id the run's cartridge gets: `--id` (checked) or one made from the output's name."""
    from lmcache_cartridge.cartridge.manifest import id_from_name, validate_id

    return validate_id(cfg.cartridge_id) if cfg.cartridge_id else id_from_name(cfg.output.name)
