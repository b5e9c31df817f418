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
MAX_INPUT_BYTES = 32 << 30  # one input file; a cartridge of a 70B model at 8k tokens is ~2.5 GB
MAX_RECORDS = 1 << 16  # records in one .pt archive (torch.save writes one per storage, and a few more)


def safe_torch_load(path: str | Path) -> Any:
    """`torch.load` that can only build tensors, plain containers and ParameterLists; tensors
    saved on CUDA are mapped to CPU. ParameterLists come back as plain lists of tensors."""
    path = Path(path)
    if not path.is_file():
        raise CartridgeFormatError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise CartridgeFormatError(f"{path}: {size} bytes, over the {MAX_INPUT_BYTES}-byte limit of one input")
    check_archive(path, size)
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
    obj = plain(obj)
    check_tensor_sizes(obj, size, str(path))
    return obj


def check_archive(path: Path, file_bytes: int) -> None:
    """Refuse a `.pt` whose records could be larger in memory than on disk, before torch reads any:
    torch.load inflates a compressed record whole (a 128 KiB record of zeros becomes 128 MiB, and
    `check_tensor_sizes` runs only after). torch.save writes a zip archive of stored
    (uncompressed) records, so that is what is read: every record stored, and all of them
    together no larger than the file (records sharing bytes would count them twice). Read from
    the archive's central directory, the one torch's reader extracts records by. The pre-1.6
    format (not a zip) is refused too: its storage sizes are not known before it is unpickled."""
    import zipfile

    fix = "re-save it with torch.save (torch 1.6 or later)"
    declared = _declared_records(path)
    if declared is None:
        raise CartridgeFormatError(f"{path}: not a torch.save zip archive (no end of central directory): {fix}")
    if declared > MAX_RECORDS:  # zipfile holds an object per record: bounded before it reads them
        raise CartridgeFormatError(f"{path}: {declared} records, over the {MAX_RECORDS} of any cartridge file: "
                                   f"{fix}")
    try:
        with zipfile.ZipFile(path) as z:
            records = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise CartridgeFormatError(f"{path}: not a torch.save zip archive ({_first_line(e)}): {fix}") from None
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size:
            raise CartridgeFormatError(
                f"{path}: record {r.filename[:200]!r} of {r.file_size} bytes in {r.compress_size}: the record is "
                f"compressed, which torch.save never does, and torch.load would inflate it whole before any "
                f"check: {fix}")
    total = sum(r.file_size for r in records)
    if total > file_bytes:
        raise CartridgeFormatError(f"{path}: its records hold {total} bytes, more than the file's {file_bytes} "
                                   f"(records sharing bytes): {fix}")


_EOCD, _EOCD64_LOCATOR, _EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"


def _declared_records(path: Path) -> int | None:
    """How many records a zip archive's end of central directory declares (the zip64 record's
    count where the classic one overflows), None where there is none: read from the file's last
    64 KiB, as zip readers find it, before anything parses the directory."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        tail_at = max(0, size - (1 << 16) - 22)
        f.seek(tail_at)
        tail = f.read()
        at = tail.rfind(_EOCD)
        if at < 0 or len(tail) - at < 22:
            return None
        count = int.from_bytes(tail[at + 10:at + 12], "little")
        if count != 0xFFFF:
            return count
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _EOCD64_LOCATOR:
            return None
        f.seek(int.from_bytes(tail[loc + 8:loc + 16], "little"))
        record = f.read(56)
    if len(record) < 40 or record[:4] != _EOCD64:
        return None
    return int.from_bytes(record[32:40], "little")


def check_tensor_sizes(obj: Any, file_bytes: int, where: str) -> None:
    """Refuse tensors that would grow when materialised: torch.load restores sizes and strides as
    saved, so a 1.5 KB file can hold a zero-stride view of a billion elements, and the first
    `.contiguous()` or dtype cast allocates gigabytes. Every tensor must fit in its own storage,
    and all tensors together in about the file's size (views may share a storage, not repeat it)."""
    total = 0
    for t in _tensors(obj):
        logical = t.numel() * t.element_size()
        stored = t.untyped_storage().nbytes()
        if logical > stored or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise CartridgeFormatError(
                f"{where}: a tensor of shape {tuple(t.shape)} with strides {tuple(t.stride())} is a view "
                f"larger than the {stored} bytes it holds (broadcast or zero strides): re-save it with "
                "`.contiguous()` tensors")
        total += logical
    if total > 2 * file_bytes + (1 << 20):
        raise CartridgeFormatError(f"{where}: its tensors hold {total} bytes, more than the file's {file_bytes} "
                                   "(views repeating one storage): re-save it with `.contiguous()` tensors")


def _tensors(obj: Any, depth: int = 0):
    if depth > 64:
        raise CartridgeFormatError("containers nested deeper than 64 levels")
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)


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
