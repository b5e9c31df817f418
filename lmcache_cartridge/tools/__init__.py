"""Stage 6, what users run offline: the `lmcache-cartridge` CLI, first-k creation from text, and
the tiny local test model.
"""
