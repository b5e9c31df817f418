"""Speed of the GPU path on a random-weight SmolLM2 (the real one's shapes, before its weights are
on the box): batched HF synthesis at the data-scale curve's settings, then fp32 training steps at
batch 8. Usage: python3 benchmarks/device/hf_probe.py MODEL_DIR SYNTH_BATCH (from the checkout's root)."""

import sys
import time

sys.path.insert(0, "benchmarks")

import peft  # noqa: E402
import quality as Q  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lmcache_cartridge.tools.selfstudy.config import SynthConfig  # noqa: E402
from lmcache_cartridge.tools.selfstudy.loop import accumulate_step, build_student, encoder_of  # noqa: E402
from lmcache_cartridge.tools.selfstudy.run import load_tokenizer  # noqa: E402
from lmcache_cartridge.tools.selfstudy.synth import HFBatchBackend, document_body, plan  # noqa: E402

md = sys.argv[1]
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      torch.cuda.get_device_name(0), flush=True)
tok = load_tokenizer(md)
cfg = AutoConfig.from_pretrained(md)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
text = Q.document("a")
body = document_body(tok, text)
sc = SynthConfig(window_min=384, window_max=768, question_tokens=48, answer_tokens=64)  # quality_scale.py's
for B in (64, int(sys.argv[2])):  # the first batch warms up
    specs = [plan(len(body), sc, 0, "train", i, 32768) for i in range(B)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    conv = [c for c in HFBatchBackend(m, tok, batch=B).run(body, sc, specs) if c]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(f"synth batch {B}: {dt:.2f} s, {len(conv) / dt * 60:.0f} conv/min, answer len mean "
          f"{sum(len(c.answer) for c in conv) / len(conv):.1f}, max mem {mem:.1f} GiB", flush=True)
del m
torch.cuda.empty_cache()
mf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
st = build_student(mf, tok, text, 256, 1)
opt = torch.optim.Adam([encoder_of(st).trainable_embedding], lr=2e-3)
ts = []
for step in range(25):
    torch.cuda.synchronize()
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    accumulate_step(st, conv[step * 8:(step + 1) * 8], micro_batch=8, pad_id=tok.pad_token_id, questions=True)
    opt.step()
    torch.cuda.synchronize()
    ts.append(time.perf_counter() - t)
print(f"train step (batch 8, fp32): median {sorted(ts[5:])[len(ts[5:]) // 2] * 1000:.1f} ms", flush=True)
