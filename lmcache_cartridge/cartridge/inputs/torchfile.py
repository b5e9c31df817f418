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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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
    together no larger than the file (records sharing bytes would count them twice). The pre-1.6
    format (not a zip) is refused too: its storage sizes are not known before it is unpickled.

    The records checked are the ones torch's reader extracts (`central_directory`)."""
    fix = "re-save it with torch.save (torch 1.6 or later)"
    with open(path, "rb") as f:
        records = central_directory(f, str(path))
    for r in records:
        if r.method != 0 or r.compressed != r.size:
            raise CartridgeFormatError(
                f"{path}: record {r.name[:200]!r} of {r.size} bytes in {r.compressed}: the record is "
                f"compressed, which torch.save never does, and torch.load would inflate it whole before any "
                f"check: {fix}")
    total = sum(r.size for r in records)
    if total > file_bytes:
        raise CartridgeFormatError(f"{path}: its records hold {total} bytes, more than the file's {file_bytes} "
                                   f"(records sharing bytes): {fix}")


_EOCD, _EOCD64_LOCATOR, _EOCD64, _CDH = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06", b"PK\x01\x02"
_ZIP64 = 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    """One central directory record: what torch's reader extracts a record by."""

    name: str
    method: int       # 0: stored
    compressed: int   # bytes in the file
    size: int         # bytes once extracted


def central_directory(f: BinaryIO, where: str) -> list[Record]:
    """The records of the zip archive open in `f`, as torch's reader (miniz, behind
    `torch._C.PyTorchFileReader`) finds them: the last end-of-central-directory record in the
    file's last 64 KiB, the zip64 one where its fields overflow, and the directory at the offset
    it gives, `count` records read one by one (at most `MAX_RECORDS`, each bounded by its
    16-bit lengths), never more.

    Zip readers disagree where an archive leaves room to: Python's `zipfile` finds the directory
    by its size back from the end record and reads every record in it, miniz follows the offset
    and reads the declared count. So the directory must end where the end record (or the zip64
    one) begins and hold exactly the declared records, as torch.save writes it: an archive
    whose directories two readers would read differently is refused, not judged on one view."""
    fix = "re-save it with torch.save (torch 1.6 or later)"

    def refuse(why: str) -> CartridgeFormatError:
        return CartridgeFormatError(f"{where}: {why}: {fix}")

    size = f.seek(0, 2)
    tail_at = max(0, size - (1 << 16) - 22)
    f.seek(tail_at)
    tail = f.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise refuse("not a torch.save zip archive (no end of central directory)")
    end = tail[at:at + 22]
    count, cd_size, cd_at = (int.from_bytes(end[10:12], "little"), int.from_bytes(end[12:16], "little"),
                             int.from_bytes(end[16:20], "little"))
    ends_at = tail_at + at  # where the directory must end: the end record, or the zip64 one
    loc = tail[at - 20:at] if at >= 20 else b""
    if loc[:4] == _EOCD64_LOCATOR:  # torch.save writes one always; then its values are the ones read
        ends_at = int.from_bytes(loc[8:16], "little")
        f.seek(ends_at)
        rec = f.read(56)
        if len(rec) < 56 or rec[:4] != _EOCD64:
            raise refuse("a zip64 archive without its zip64 end record")
        count, cd_size, cd_at = (int.from_bytes(rec[32:40], "little"), int.from_bytes(rec[40:48], "little"),
                                 int.from_bytes(rec[48:56], "little"))
        if tail_at + at - 20 != ends_at + 56 + int.from_bytes(rec[4:12], "little") - 44:
            raise refuse("its zip64 end record is not where its locator says")
    elif count == 0xFFFF or cd_size == _ZIP64 or cd_at == _ZIP64:
        raise refuse("a zip64 archive without its zip64 end record locator")
    if count > MAX_RECORDS:  # bounded before any record is read
        raise refuse(f"{count} records, over the {MAX_RECORDS} of any cartridge file")
    if cd_at + cd_size != ends_at:
        raise refuse(f"its central directory ({cd_size} bytes at offset {cd_at}) does not end where its end "
                     f"record begins ({ends_at}): zip readers would read different records from it")
    f.seek(cd_at)
    records = [_record(f, refuse) for _ in range(count)]
    if f.tell() != ends_at:
        raise refuse(f"its central directory holds more than the {count} records it declares")
    return records


def _record(f: BinaryIO, refuse) -> Record:
    head = f.read(46)
    if len(head) < 46 or head[:4] != _CDH:
        raise refuse("a damaged central directory record")
    method, compressed, size = (int.from_bytes(head[10:12], "little"), int.from_bytes(head[20:24], "little"),
                                int.from_bytes(head[24:28], "little"))
    n_name, n_extra, n_comment = (int.from_bytes(head[i:i + 2], "little") for i in (28, 30, 32))
    rest = f.read(n_name + n_extra + n_comment)
    if len(rest) < n_name + n_extra + n_comment:
        raise refuse("a damaged central directory record")
    name = rest[:n_name].decode("utf-8", "replace")
    if _ZIP64 in (compressed, size):
        size, compressed = _zip64_sizes(rest[n_name:n_name + n_extra], size, compressed, refuse)
    return Record(name, method, compressed, size)


def _zip64_sizes(extra: bytes, size: int, compressed: int, refuse) -> tuple[int, int]:
    """The sizes a zip64 extra field gives for those the record's own fields overflow (in the
    field's order: the uncompressed size, then the compressed one)."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = int.from_bytes(extra[i:i + 2], "little"), int.from_bytes(extra[i + 2:i + 4], "little")
        body = extra[i + 4:i + 4 + n]
        if tag == 1:
            values = [int.from_bytes(body[j:j + 8], "little") for j in range(0, len(body) - 7, 8)]
            if size == _ZIP64:
                if not values:
                    break
                size = values.pop(0)
            if compressed == _ZIP64:
                if not values:
                    break
                compressed = values.pop(0)
            return size, compressed
        i += 4 + n
    raise refuse("a zip64 record without the zip64 sizes it declares")


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


def _tensors(obj: Any):
    """Every tensor in `obj` (a tree: `plain` refused shared containers), each once."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def plain(obj: Any) -> Any:
    """Replace every ParameterList (at any depth of dicts, lists and tuples) by a list of its
    tensors, read from its parameter table, never by calling the module.

    The walk is linear in the file: a pickle can reference one container many times (`L = [L, L]`
    sixty deep is 2 KB and 2**60 paths), so every container is visited once, and one reached a
    second time is refused (no cartridge format shares containers; everything after this reads
    the result as a tree). Depth is bounded (`MAX_DEPTH`), and so is time (`WALK_SECONDS`)."""
    return _Plain().convert(obj, 0)


MAX_DEPTH = 64          # containers nested deeper are no cartridge
WALK_SECONDS = 30.0     # a walk of a loaded file past this is refused (it is linear: a huge file)


class _Plain:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.deadline = time.monotonic() + WALK_SECONDS

    def convert(self, obj: Any, depth: int) -> Any:
        if not isinstance(obj, (dict, list, tuple, torch.nn.ParameterList)):
            return obj
        if depth > MAX_DEPTH:
            raise CartridgeFormatError(f"containers nested deeper than {MAX_DEPTH} levels")
        if len(obj):  # empty ones hold nothing (and `()` is one shared object)
            self._first_visit(obj)
        if isinstance(obj, torch.nn.ParameterList):
            return parameter_list_items(obj)
        if isinstance(obj, dict):
            return {k: self.convert(v, depth + 1) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.convert(v, depth + 1) for v in obj]
        return tuple(self.convert(v, depth + 1) for v in obj)

    def _first_visit(self, obj: Any) -> None:
        if id(obj) in self.seen:
            raise CartridgeFormatError(
                f"a {type(obj).__name__} referenced more than once in the file (shared or recursive "
                "containers, which no cartridge format has): re-save it with each list and dict once")
        self.seen.add(id(obj))
        if len(self.seen) % 1024 == 0 and time.monotonic() > self.deadline:
            raise CartridgeFormatError(f"its containers took more than {WALK_SECONDS:.0f}s to read: not a cartridge")


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
