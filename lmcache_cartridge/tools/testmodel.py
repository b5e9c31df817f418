"""Tiny models with random weights and a locally trained tokenizer, built on demand and cached:
one per family the project serves, each with its family's own conventions.

* `llama` (the default, `tiny-llama`): the tokenizer prepends BOS `<s>`, separate LM head, no
  attention biases, a plain `[role]: text` chat template. `head_dim` may be given explicitly
  (config `head_dim` != hidden_size / num_heads), as Llama-3-style configs allow.
* `qwen2` (`tiny-qwen2`): like Qwen2/Qwen2.5: the tokenizer adds no BOS (`bos_token` is None,
  while the config still names `<|endoftext|>` as bos_token_id, as Qwen's does), q/k/v attention
  biases (random, non-zero), tied input/output embeddings, and Qwen2-Instruct's ChatML template
  (`<|im_start|>role ... <|im_end|>`, eos `<|im_end|>`).

Tests and the demo need a real HF/vLLM-loadable model without a model hub. Random weights alone
make attention nearly uniform, so a KV cache injected in the wrong layout (K/V swapped, heads
permuted, positions shifted) would still produce almost the same logits and bugs would hide.
We therefore scale q/k projections and the logits so attention and next-token choices are
peaked: layout errors then change the argmax. (Llama scales its LM head; with tied embeddings
that would also scale the input embeddings, so Qwen2 scales the final norm's weight instead: the
same logits, untouched inputs.)

Runs offline, in tests, the demo and benchmarks; the files belong to the cache dir it writes.
Run `python -m lmcache_cartridge.tools.testmodel [--family qwen2]` to build one and print its path.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from lmcache_cartridge.paths import models_dir

PEAK_Q_K_SCALE = 4.0
PEAK_LM_HEAD_SCALE = 12.0

MARKER_NAME = "build_params.json"
# Bump when the build recipe changes, so cached models made by an older recipe are rebuilt.
RECIPE_VERSION = 1

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3: BpeTrainer assigns specials first.

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}[{{ message['role'] }}]: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]:{% endif %}"
)

# Qwen2's specials (Qwen2TokenizerFast: <|endoftext|> is pad and the base model's eos,
# <|im_end|> the chat eos; no BOS, no UNK) and Qwen2-Instruct's chat template, verbatim.
QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """A model family's tokenizer conventions: its special tokens (ids 0.. in this order) and
    which of them is BOS / EOS / PAD / UNK (None: the family has none)."""

    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    unk: str | None
    chat_template: str

    def id_of(self, token: str | None) -> int | None:
        return None if token is None else self.specials.index(token)


FAMILIES = {
    "llama": Family("llama", SPECIAL_TOKENS, BOS, EOS, PAD, UNK, CHAT_TEMPLATE),
    "qwen2": Family("qwen2", (QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END), None, QWEN_IM_END,
                    QWEN_ENDOFTEXT, None, QWEN_CHAT_TEMPLATE),
}
QWEN2_ATTN_BIAS_STD = 0.5  # random q/k/v biases: HF initialises them to zero, which tests nothing


@dataclass(frozen=True)
class BuildParams:
    """Everything that determines the built files; equal params mean a reusable cached build."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int
    family: str = "llama"
    head_dim: int | None = None  # None: hidden_size // num_heads (written to the config either way)
    peak_q_k_scale: float = PEAK_Q_K_SCALE
    peak_lm_head_scale: float = PEAK_LM_HEAD_SCALE
    recipe_version: int = RECIPE_VERSION

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {sorted(FAMILIES)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
                " (or give head_dim)"
            )
        if self.head_dim is not None and self.family == "qwen2":
            # vLLM's Qwen2 derives head_dim from hidden_size / num_heads and ignores the config's.
            raise ValueError("an explicit head_dim is a Llama-family option (vLLM's Qwen2 ignores it)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        specials = len(FAMILIES[self.family].specials)
        if self.vocab_size < 256 + specials:
            raise ValueError(
                f"vocab_size {self.vocab_size} is too small: byte-level BPE needs at least "
                f"{256 + specials} (256 bytes + special tokens)"
            )


def document_text() -> str:
    """The bundled sample document (also the tokenizer's training text)."""
    return resources.files("lmcache_cartridge").joinpath("assets/document.txt").read_text("utf-8")


_WORDS = (
    "the a an of to and in on at by for with from over under after before while because "
    "ship boat sea wave wind storm light lamp tower keeper rock island harbour coast reef "
    "night morning evening winter summer year day hour week month weather fog rain snow "
    "old new small large bright dark cold warm quiet loud long short high low early late "
    "sailor captain crew fisherman village family letter book log record chart map lens "
    "turned watched wrote carried built burned kept found lost saw heard said climbed "
    "slowly quickly always never often sometimes again still almost nearly every each "
    "north south east west mainland strait channel bay cliff beach stone glass iron oil "
    "clock bell signal flash beam mirror prism engine pump rope ladder door window stair"
).split()


_SYLLABLES = (
    "ba be bi bo bu ca ce co cu da de di do du fa fe fi fo ga ge go gu ha he hi ho la le li lo lu "
    "ma me mi mo mu na ne ni no nu pa pe pi po ra re ri ro ru sa se si so su ta te ti to tu va ve "
    "vi vo wa we wi ya yo za ze ar er ir or ur an en in on un al el il ol st sh th ch tr pr gr"
).split()


def extra_text(num_sentences: int, seed: int = 0) -> str:
    """Deterministic filler English, for vocab sizes the bundled document alone cannot fill.

    BPE can learn at most one merge per extra character of each distinct word, so besides
    common words it uses invented ones (joined syllables), as many as the sentences need.
    """
    rng = random.Random(seed)
    invented = ["".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(num_sentences)]
    pool = list(_WORDS) * 4 + invented
    sentences = []
    for _ in range(num_sentences):
        words = rng.choices(pool, k=rng.randint(6, 16))
        sentences.append(" ".join(words).capitalize() + ".")
    return "\n".join(sentences)


def build_tokenizer(vocab_size: int, max_length: int = 8192, family: str = "llama"):
    """Train the byte-level BPE tokenizer (deterministic: same text and settings, same ids), with
    the family's special tokens and BOS behaviour (`llama`: BOS on single texts, like Llama;
    `qwen2`: nothing added, like Qwen2's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[family]
    corpora = [[document_text()]]
    # Larger vocabularies need more text to learn enough merges; add filler only then.
    corpora += [[document_text(), extra_text(n)] for n in (2_000, 20_000)]
    for corpus in corpora:
        tok = Tokenizer(models.BPE(unk_token=fam.unk))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(fam.specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus, trainer=trainer)
        if tok.get_vocab_size() == vocab_size:
            break
    else:
        raise ValueError(
            f"could not train a tokenizer with vocab_size {vocab_size} (got "
            f"{tok.get_vocab_size()}): choose a smaller vocab_size"
        )
    for i, special in enumerate(fam.specials):
        if tok.token_to_id(special) != i:
            raise RuntimeError(
                f"tokenizer trainer put {special!r} at id {tok.token_to_id(special)}, not {i}"
            )
    if fam.bos is not None:
        # BOS on single texts by default (like Llama); add_special_tokens=False leaves it out.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A",
            pair=f"{fam.bos} $A {fam.bos} $B",
            special_tokens=[(fam.bos, fam.id_of(fam.bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)  # as Qwen2's tokenizer.json
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos,
        eos_token=fam.eos,
        unk_token=fam.unk,
        pad_token=fam.pad,
        additional_special_tokens=[t for t in fam.specials if t not in (fam.bos, fam.eos, fam.pad, fam.unk)] or None,
        chat_template=fam.chat_template,
        model_max_length=max_length,
    )


def _geometry(params: BuildParams) -> dict:
    """The HF config fields both families take from the params (bf16, the checkpoints' dtype)."""
    return dict(
        vocab_size=params.vocab_size,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        max_position_embeddings=params.max_position_embeddings,
        dtype="bfloat16",
    )


def llama_config(params: BuildParams):
    from transformers import LlamaConfig

    return LlamaConfig(
        **_geometry(params),
        head_dim=params.attn_head_dim,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )


def qwen2_config(params: BuildParams):
    """Qwen2's shape: tied embeddings, q/k/v biases (built into Qwen2Attention), no sliding window;
    `bos_token_id` names <|endoftext|> as Qwen's configs do, though the tokenizer adds no BOS."""
    from transformers import Qwen2Config

    fam = FAMILIES["qwen2"]
    return Qwen2Config(
        **_geometry(params),
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=fam.id_of(QWEN_ENDOFTEXT),
        eos_token_id=fam.id_of(fam.eos),
        pad_token_id=fam.id_of(fam.pad),
    )


def build_model(params: BuildParams):
    """Random-init model of the family (fp32, seeded), with peaked q/k and logits, cast to bf16."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(params.seed)
    if params.family == "qwen2":
        model = Qwen2ForCausalLM(qwen2_config(params)).float()
    else:
        model = LlamaForCausalLM(llama_config(params)).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(params.peak_q_k_scale)
            layer.self_attn.k_proj.weight.mul_(params.peak_q_k_scale)
            if params.family == "qwen2":
                for proj in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, proj).bias.normal_(0.0, QWEN2_ATTN_BIAS_STD)
        if params.family == "qwen2":  # tied: scale the logits through the final norm, not the embeddings
            model.model.norm.weight.mul_(params.peak_lm_head_scale)
        else:
            model.lm_head.weight.mul_(params.peak_lm_head_scale)
    return model.to(torch.bfloat16).eval()


def marker(params: BuildParams) -> dict:
    """The marker's content. Options at their defaults are left out, so models built before the
    option existed (same files) stay valid."""
    d = asdict(params)
    for key, default in (("family", "llama"), ("head_dim", None)):
        if d[key] == default:
            del d[key]
    return d


def read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text("utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _write_model(directory: Path, params: BuildParams) -> None:
    build_tokenizer(params.vocab_size, params.max_position_embeddings, params.family).save_pretrained(directory)
    build_model(params).save_pretrained(directory, safe_serialization=True)
    # Written last: its presence means every other file is complete.
    (directory / MARKER_NAME).write_text(json.dumps(marker(params), indent=1) + "\n", "utf-8")


def ensure_test_model(
    root: Path | None = None,
    *,
    family: str = "llama",
    name: str | None = None,
    head_dim: int | None = None,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 1024,
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """Return `root/name` (default `tiny-<family>`), building it first unless it already holds
    this exact model (`ensure_model` of these params)."""
    params = BuildParams(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        family=family,
        head_dim=head_dim,
    )
    return ensure_model(params, root, name)


def ensure_model(params: BuildParams, root: Path | None = None, name: str | None = None) -> Path:
    """Return `root/name` (default `tiny-<family>`), building the model of `params` first unless
    the directory already holds it.

    Builds go to a temp dir beside the target and are renamed into place, so concurrent
    processes (vLLM scheduler, workers, pytest-xdist) never see a half-written model. A cached
    model built with other params is replaced.
    """
    params.validate()
    name = name or f"tiny-{params.family}"
    root = Path(root) if root is not None else models_dir()
    wanted = marker(params)
    return install_model_dir(root, name, wanted, lambda d: _write_model(d, params))


# Published geometries served with vLLM's `--load-format dummy` (random weights made by vLLM at
# start: no weights on disk, no download): the config of meta-llama/Llama-3.1-8B and
# Llama-3.2-1B (their `config.json`), positions capped at what the benchmarks use. Their KV per
# token is what a user's model moves: 128 KiB (8B) and 32 KiB (1B) in bf16.
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}
SHAPE_TOKENIZER_VOCAB = 8192  # the local tokenizer's; the model's embedding is the shape's (larger)


def ensure_shape_model(shape: str, root: Path | None = None, max_position_embeddings: int = 40960) -> Path:
    """`root/shape-<shape>`: a `config.json` of a published model's geometry and a local tokenizer,
    no weights: for vLLM's `--load-format dummy` only (HF transformers cannot load it). Prompts
    use token ids below the tokenizer's vocabulary (`SHAPE_TOKENIZER_VOCAB`)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {sorted(SHAPES)}")
    geo = SHAPES[shape]
    wanted = {"shape": shape, **geo, "max_position_embeddings": max_position_embeddings,
              "tokenizer_vocab": SHAPE_TOKENIZER_VOCAB, "recipe_version": RECIPE_VERSION}

    def write(d: Path) -> None:
        build_tokenizer(SHAPE_TOKENIZER_VOCAB, max_position_embeddings).save_pretrained(d)
        LlamaConfig(vocab_size=geo["vocab_size"], hidden_size=geo["hidden_size"],
                    intermediate_size=geo["intermediate_size"], num_hidden_layers=geo["num_layers"],
                    num_attention_heads=geo["num_heads"], num_key_value_heads=geo["num_kv_heads"],
                    head_dim=geo["head_dim"], max_position_embeddings=max_position_embeddings,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=geo["tie_word_embeddings"],
                    bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
                    pad_token_id=SPECIAL_TOKENS.index(PAD), dtype="bfloat16").save_pretrained(d)
        (d / MARKER_NAME).write_text(json.dumps(wanted, indent=1) + "\n", "utf-8")

    root = Path(root) if root is not None else models_dir()
    return install_model_dir(root, f"shape-{shape}", wanted, write)


def install_model_dir(root: Path, name: str, wanted: dict, write) -> Path:
    """`root/name`, written by `write(dir)` unless its marker already reads `wanted`.

    `write` fills a temp dir beside the target and must write the marker last; the dir is then
    renamed into place, so concurrent processes (vLLM scheduler, workers, pytest-xdist) never see
    a half-written model. A cached model with another marker is replaced. Shared by the tiny test
    models and the real model (`tools.realmodel`)."""
    target = root / name
    if read_marker(target) == wanted:
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; servers may run as another user.
        write(tmp)
        for _ in range(3):
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                # Target exists: another process won the race (use its copy), or a stale or
                # different build sits there (move it aside, then retry).
                if read_marker(target) == wanted:
                    return target
                stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
                try:
                    os.rename(target, stale / name)
                except FileNotFoundError:  # another process moved it first
                    pass
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(
            f"could not install the model at {target}: other processes keep replacing it "
            "with builds of different parameters; give each configuration its own `name`"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="build (once) a tiny test model and print its directory")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    print(ensure_test_model(family=ap.parse_args(argv).family))


if __name__ == "__main__":
    main()
