"""Reading `.pt` files without running pickle code.

Runs wherever an input is read (CLI, gateway). Every `.pt` goes through `torch.load(...,
weights_only=True)`, torch's restricted unpickler, which builds only tensors and plain
containers. The Cartridges authors' `TrainableCache.save()` pickles `torch.nn.ParameterList`
objects; that one class is added through torch's documented allow-list
(`torch.serialization.safe_globals`, for this load only). Its parameters are rebuilt by
`torch._utils._rebuild_parameter`, which weights_only already allows. Any other global (a
function, `os.system`, a custom class) is still refused, inside a ParameterList or not.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeFormatError

# Exactly what a TrainableCache checkpoint needs beyond weights_only's defaults.
EXTRA_SAFE_GLOBALS: tuple[type, ...] = (torch.nn.ParameterList,)

MAX_LAYERS = 4096  # a ParameterList longer than any model is a malformed (or hostile) file


def safe_torch_load(path: str | Path) -> Any:
    """`torch.load` that can only build tensors, plain containers and ParameterLists; tensors
    saved on CUDA are mapped to CPU. ParameterLists come back as plain lists of tensors."""
    path = Path(path)
    if not path.is_file():
        raise CartridgeFormatError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(list(EXTRA_SAFE_GLOBALS)):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        raise CartridgeFormatError(
            f"{path}: refused to load: the file holds pickled objects other than tensors, plain "
            f"containers and torch.nn.ParameterList (it could run code on load). Re-save it with "
            f"tensors, lists, dicts, ints and strings only. Detail: {_first_line(e)}"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, TypeError, KeyError) as e:
        raise CartridgeFormatError(f"{path}: not a readable torch file ({_first_line(e)})") from None
    return plain(obj)


def plain(obj: Any) -> Any:
    """Replace every ParameterList (at any depth of dicts, lists and tuples) by a list of its
    tensors, read from its parameter table, never by calling the module."""
    if isinstance(obj, torch.nn.ParameterList):
        return parameter_list_items(obj)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    return obj


def parameter_list_items(pl: torch.nn.ParameterList) -> list[torch.Tensor]:
    params = vars(pl).get("_parameters")
    size = vars(pl).get("_size", 0)
    if not isinstance(params, dict) or not isinstance(size, int) or not 0 <= size <= MAX_LAYERS:
        raise CartridgeFormatError("malformed ParameterList in the file")
    missing = [i for i in range(size) if not isinstance(params.get(str(i)), torch.Tensor)]
    if missing or len(params) != size:
        raise CartridgeFormatError(
            f"malformed ParameterList in the file: {size} entries declared, tensors found for "
            f"{sorted(params)[:8]}"
        )
    return [params[str(i)].detach() for i in range(size)]


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    # torch's message leads with generic advice; the specific reason is the WeightsUnpickler line.
    specific = [ln.strip() for ln in lines if "GLOBAL" in ln or "global" in ln.split(":")[0]]
    return (specific or lines or [type(e).__name__])[0]
