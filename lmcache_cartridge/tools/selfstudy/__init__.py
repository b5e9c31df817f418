"""Self-study training of cartridges (Cartridges, arXiv 2506.06266, section 4), on maintained pieces.

Runs offline, in the `lmcache-cartridge train` process, on CPU or one CUDA device; nothing here
is on the serving path. The trainable KV is PEFT's `CARTRIDGE` adapter, the model is HF
transformers, conversations are synthesised with transformers' `generate`.

- `config`: the run's settings and fingerprints (no torch: the CLI parser imports it).
- `synth`: sample document windows, have the model (window in context) write a question from a
  seed prompt type and answer it; keep the teacher's top-k next-token distribution per answer token.
- `objective`: student/teacher log-probs on the answer tokens; the top-k distillation loss and
  the full-vocabulary held-out KL.
- `init`: where the KV starts: the document's first k tokens (the paper's), or the most
  attended positions of the whole document's KV.
- `loop`: the PEFT model with its start, the optimisation loop, resumable checkpoints and the
  metrics log.

- `run`: one run end to end, ending in the packed cartridge (`pack_kv`, kind `trained`).

The command line lives in `lmcache_cartridge.tools.train`.
"""
