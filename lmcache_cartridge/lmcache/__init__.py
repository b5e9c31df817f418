"""Stage 3, LMCache's side: the storage plugin LMCache builds in each engine, its settings, and
the serving state it publishes for other processes.

Imports `cartridge` and `store` (and LMCache); nothing here imports vLLM.
"""
