"""Self-study training of cartridges (Cartridges, arXiv 2506.06266, section 4), on maintained pieces.

Runs offline, in the `lmcache-cartridge train` process, on CPU or one CUDA device; nothing here
is on the serving path. The trainable KV is PEFT's `CARTRIDGE` adapter, the model is HF
transformers, conversations are synthesised with transformers' `generate`.

- `synth`: sample document windows, have the model (window in context) write a question from a
  seed prompt type and answer it; keep the teacher's top-k next-token distribution per answer token.
- `objective`: student/teacher log-probs on the answer tokens; the top-k distillation loss and
  the full-vocabulary held-out KL.
- `loop`: the PEFT model with first-k initialisation, the optimisation loop, resumable
  checkpoints and the metrics log.

The packed cartridge and the command line live in `lmcache_cartridge.tools.train`.
"""
