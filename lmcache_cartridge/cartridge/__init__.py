"""Stage 1, the cartridge itself: input formats, the manifest and packed format, chunk keys,
tensor-parallel head slices, and whether a cartridge fits an engine.

Pure data: nothing here opens a network connection or knows about a running server. Every later
stage imports from here; this package imports nothing from a later stage.
"""
