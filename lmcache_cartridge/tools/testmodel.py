"""A tiny Llama with random weights and a locally trained tokenizer, built on demand and cached.

Tests and the demo need a real HF/vLLM-loadable model without a model hub. Random weights alone
make attention nearly uniform, so a KV cache injected in the wrong layout (K/V swapped, heads
permuted, positions shifted) would still produce almost the same logits and bugs would hide.
We therefore scale q/k projections and the LM head so attention and next-token choices are
peaked: layout errors then change the argmax.

Run `python -m lmcache_cartridge.tools.testmodel` to build the default model and print its path.
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
    peak_q_k_scale: float = PEAK_Q_K_SCALE
    peak_lm_head_scale: float = PEAK_LM_HEAD_SCALE
    recipe_version: int = RECIPE_VERSION

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size {self.vocab_size} is too small: byte-level BPE needs at least "
                f"{256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)"
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


def build_tokenizer(vocab_size: int, max_length: int = 8192):
    """Train the byte-level BPE tokenizer (deterministic: same text and settings, same ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpora = [[document_text()]]
    # Larger vocabularies need more text to learn enough merges; add filler only then.
    corpora += [[document_text(), extra_text(n)] for n in (2_000, 20_000)]
    for corpus in corpora:
        tok = Tokenizer(models.BPE(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
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
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(
                f"tokenizer trainer put {special!r} at id {tok.token_to_id(special)}, not {i}"
            )
    # BOS on single texts by default (like Llama); add_special_tokens=False leaves it out.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def llama_config(params: BuildParams):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=params.vocab_size,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        head_dim=params.hidden_size // params.num_heads,
        max_position_embeddings=params.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        dtype="bfloat16",
    )


def build_model(params: BuildParams):
    """Random-init Llama (fp32, seeded), with peaked q/k and LM head, cast to bfloat16."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(params.seed)
    model = LlamaForCausalLM(llama_config(params)).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(params.peak_q_k_scale)
            layer.self_attn.k_proj.weight.mul_(params.peak_q_k_scale)
        model.lm_head.weight.mul_(params.peak_lm_head_scale)
    return model.to(torch.bfloat16).eval()


def read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text("utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _write_model(directory: Path, params: BuildParams) -> None:
    build_tokenizer(params.vocab_size, params.max_position_embeddings).save_pretrained(directory)
    build_model(params).save_pretrained(directory, safe_serialization=True)
    # Written last: its presence means every other file is complete.
    (directory / MARKER_NAME).write_text(json.dumps(asdict(params), indent=1) + "\n", "utf-8")


def ensure_test_model(
    root: Path | None = None,
    *,
    name: str = "tiny-llama",
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 1024,
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """Return `root/name`, building it first unless it already holds this exact model.

    Builds go to a temp dir beside the target and are renamed into place, so concurrent
    processes (vLLM scheduler, workers, pytest-xdist) never see a half-written model. A cached
    model built with other params is replaced.
    """
    params = BuildParams(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
    params.validate()
    root = Path(root) if root is not None else models_dir()
    target = root / name
    wanted = asdict(params)
    if read_marker(target) == wanted:
        return target

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; servers may run as another user.
        _write_model(tmp, params)
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
                except FileNotFoundError:
                    pass
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(
            f"could not install the test model at {target}: other processes keep replacing it "
            "with builds of different parameters; give each configuration its own `name`"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    print(ensure_test_model())


if __name__ == "__main__":
    main()
