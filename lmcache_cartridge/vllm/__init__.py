"""Stage 4, vLLM's side: the glue connector vLLM loads (`--kv-transfer-config`) and the copy
between LMCache's chunks and vLLM's CPU paged KV cache.

Imported only inside vLLM's processes (and by tests and benchmarks).
"""
