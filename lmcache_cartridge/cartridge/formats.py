"""Reading cartridge *input* files (the formats people hand us): the stable import path.

The readers live in `lmcache_cartridge.cartridge.inputs` (one module per maker's format); this
module keeps `load_input`, `parse_object`, `safe_torch_load` and `LoadedCartridge` importable
from where the CLI, the gateway and users already import them. Runs in whichever process calls it.
"""

from lmcache_cartridge.cartridge.inputs import (  # noqa: F401
    FORMATS,
    LoadedCartridge,
    load_input,
    parse_object,
    safe_torch_load,
    same_model,
)

__all__ = ["FORMATS", "LoadedCartridge", "load_input", "parse_object", "safe_torch_load", "same_model"]
