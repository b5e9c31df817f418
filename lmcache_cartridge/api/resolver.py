"""From a request's `cartridges` to the tokens to put first and the registered cartridges to wait for.

Sources a `cartridges` entry names: `s3://bucket/key.pt` (one object in any input format: downloaded once,
converted once), `s3://bucket/prefix/` (listed once: a packed cartridge, whose chunks stay in S3,
or an input directory such as a PEFT adapter or a Tokasaurus directory, downloaded and converted
once), an absolute local
path (`source: "local"`; a `.pt`, an input directory or a packed directory), or a registered id
or label. Clients may only name S3 buckets/prefixes and local directories the deployment allows.

Resolution is cached in memory, per tenant: a repeated request for the same cartridge makes no S3
request, hashes no file and writes nothing to the registry. A cached registration is re-checked
only when another process changed the registry (`PRAGMA data_version`, a read). Refusals of what
an input holds are remembered too (`REFUSAL_SECONDS`): a refused S3 object is not downloaded
again on every request.

Composition ("loaded in order"), every part in request order:
- Token-only and first-k cartridges' ids are placed in order; a first-k cartridge's own KV is used
  where it is exact (it is first, or it extends what precedes it), otherwise its tokens are
  computed after what precedes them (ordinary prefill).
- Trained cartridges compose as in the Cartridges paper: KVs concatenated in request order, each
  keeping the positions it was trained at, the user's tokens after the total length.
- vLLM loads external KV only as a prefix through LMCache's lookup, which serves whole chunks
  keyed by every token before them. So each run of trained KV (with a leading first-k part where
  its KV is exact) starts on a chunk boundary and is registered as one cartridge whose keys are
  chained over the ids before it (`store.composite`, `context_ids`). Tokens vLLM must compute
  before a run (a token-only cartridge, a first-k one that is not exact where it sits, anything
  between trained ones) are computed by a priming request that the gateway sends first
  (`Plan.primes`), which makes LMCache store their chunks; the request itself then finds the
  whole head in LMCache (computed chunks from its CPU tier, trained chunks from the plugin) and
  the instance's readiness rule holds it until all of it is there, never recomputing trained KV.
  A trained cartridge not on a chunk boundary answers 400 with the rule: it cannot be exact.

Runs in the gateway process, on worker threads (blocking I/O); owns its cache, shares the registry.
"""

from __future__ import annotations

from contextlib import contextmanager
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

from lmcache_cartridge.api.requests import CartridgeSpec
from lmcache_cartridge.api.settings import GatewaySettings, RequestError, Tenant
from lmcache_cartridge.cartridge.compat import EngineShape, mismatch
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import opened_beneath
from lmcache_cartridge.store.registration import s3_origin
from lmcache_cartridge.store.registry import Entry, IdOutOfScope, IdTaken, Registry, RegistryError
from lmcache_cartridge.store.s3 import AccessDenied, NotFound, OriginError, TooLarge

OBJECT_SUFFIXES = (".pt", ".pth")  # an s3:// id ending so is one object; otherwise a packed prefix
MAX_CACHED = 4096      # resolutions kept (least recently used dropped first): clients choose the keys
# Entries (files and directories) in one local input directory: its change signature is a walk of
# it on every request, so empty directories cost as much as files.
MAX_LOCAL_ENTRIES = 4096
# How long a refused input (local or S3: not a cartridge, too large, another model's, ...) is
# refused again without being read: a local one is read again as soon as it changes (its key is its
# stat signature), an S3 one at the latest after this, or when force_redownload asks for it.
REFUSAL_SECONDS = 600.0
_REMEMBERED = (400, 413)  # refusals that say what the input's bytes are, not who asked or when

# What a failure below the gateway answers a client: the first row whose class it is an instance
# of (subclasses before their bases), its status and its message (`{what}`: the cartridge the
# client named; `{e}`: the failure's own words). The one table: the resolver's registrations,
# downloads, conversions and compositions and the gateway's request handling all answer by it.
REFUSALS: tuple[tuple[type[Exception], int, str], ...] = (
    (NotFound, 404, "{e}"),
    (AccessDenied, 403, "{e}"),
    (TooLarge, 413, "{e}"),
    (OriginError, 502, "cannot fetch {what}: {e}"),  # the object store failed us, not the client
    (IdOutOfScope, 403, "{e}"),
    (IdTaken, 409, "{e}"),
    (CartridgeError, 400, "{e}"),  # anything else wrong with what the client named
)


def refusal(e: Exception, what: str = "the cartridge") -> RequestError:
    """`e` as the RequestError a client is answered with (`REFUSALS`); a RequestError as it is.
    Anything the table does not name is raised again: it is a fault of ours, not an answer."""
    if isinstance(e, RequestError):
        return e
    for kind, status, message in REFUSALS:
        if isinstance(e, kind):
            return RequestError(status, message.format(what=what, e=e))
    raise e


_REFUSED = tuple(kind for kind, _, _ in REFUSALS)


@contextmanager
def refused_as_http(what: str = "the cartridge"):
    """Raise what the block raises as its `refusal` (the `REFUSALS` table's status and words)."""
    try:
        yield
    except _REFUSED as e:
        raise refusal(e, what) from None


@dataclass(frozen=True)
class Resolved:
    """One cartridge of a request, ready to place: `kind` is tokens, first_k or trained."""

    name: str
    kind: str
    token_ids: tuple[int, ...]
    entry: Entry | None = None      # registered (first_k / trained): what the plugins serve
    manifest: Manifest | None = None


@dataclass(frozen=True)
class Prime:
    """A priming request the gateway sends before the request itself: the first `length` ids of
    the prefix, so that vLLM computes the tokens just before a trained run and LMCache stores
    their chunks (the run's chunk keys are chained after them). `need` leading tokens of it are
    trained KV that must be loaded, never computed (0: none)."""

    length: int
    need: int


@dataclass
class Plan:
    """The token ids to put before the prompt, the registered cartridges whose KV they use, and
    the priming requests that must precede the request (in order)."""

    prefix: list[int] = field(default_factory=list)
    wanted: list[Entry] = field(default_factory=list)
    trained: bool = False
    kv_end: int = 0  # the first kv_end tokens end with trained KV: loaded, never computed
    primes: list[Prime] = field(default_factory=list)
    # (end, recipe) of each composite in the prefix: sent along so an instance on another host
    # builds it in its own registry (`store.composite.recipe`, `vllm.composites`)
    composites: list[tuple[int, dict]] = field(default_factory=list)
    # `keys.SALT_TAG` for the request: the salt of the one first-k cartridge a client brought whose
    # KV it loads ("" for none); the gateway sends it so that its keys match only here
    salt: str = ""

    def recipes(self, upto: int | None = None) -> list[dict]:
        """The recipes of the composites ending by token `upto` (None: all)."""
        return [w for end, w in self.composites if upto is None or end <= upto]


def _salted(p: Resolved) -> bool:
    """Whether `p` is KV a client brought (keyed under its salt: never part of a composite)."""
    return p.entry is not None and bool(p.entry.salt)


@dataclass
class _Cached:
    value: Resolved
    version: int  # registry data_version when last checked


class Resolver:
    """Turns cartridge specs into `Resolved` cartridges and a request's list into a `Plan`."""

    def __init__(self, settings: GatewaySettings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.engine = EngineShape.partial(model_names=(settings.model, *settings.accept_models),
                                          chunk_size=settings.chunk_size)
        self.stats: Counter[str] = Counter()  # s3_objects, s3_lists, s3_manifests, hashes, conversions, registrations
        self._cache: OrderedDict[tuple, _Cached] = OrderedDict()  # bounded: MAX_CACHED
        self._forced: OrderedDict[str, float] = OrderedDict()  # origin -> last honoured force_redownload
        self._refused: OrderedDict[tuple, tuple[RequestError, float]] = OrderedDict()  # key -> (why, when)
        self._locks: dict[tuple, list] = {}  # key -> [lock, users]: only while resolutions of it run
        self._guard = threading.Lock()
        self._vocab = None

    # --- one cartridge ------------------------------------------------------------------------
    def resolve(self, spec: CartridgeSpec, tenant: Tenant | None = None) -> Resolved:
        """Blocking (file reads, S3 downloads, conversion): the app calls it from a worker thread.
        `tenant`: the scope of the client's key (None: the gateway's own roots, every id)."""
        try:
            where = self._where(spec)
            if where == "s3":
                self._allowed_s3(spec.id, tenant)
            # Every key carries the tenant: what a resolution decides (which label, whether the id
            # a manifest claims is the tenant's to register) is decided for one tenant's scope.
            scope = tenant.name if tenant is not None else None
            if where == "local":  # allowed or not, decided before anything under it is touched
                path = self._allowed_local(spec.id, tenant)
                origin = str(path)  # one entry per file, not per spelling
                key = (where, origin, self._signature(path, tenant), scope)
            elif where == "s3":  # s3://b/p and s3://b/p/ name the same prefix: one cache entry
                origin = s3_origin(spec.id)
                key = (where, origin, None, scope)
            else:  # a label names different cartridges in different tenants' views
                key = (where, spec.id, scope)
            if spec.force_redownload and where != "registry":  # an id or label: once it names an entry
                self._allow_forced(origin)
            with self._keyed(key):
                if not spec.force_redownload:
                    hit = self._hit(key)
                    if hit is not None:
                        if where == "registry":
                            self._visible(hit.entry, spec.id, tenant)
                        return hit
                if where == "registry":
                    value = self._registry(spec, tenant)
                    self._check(value)
                else:
                    value = self._read_input(where, spec, tenant, key[:3])
                self._remember(key, value)
                return value
        except (RequestError, CartridgeError):
            raise
        except (OSError, ValueError) as e:  # unreadable file, NUL byte, name too long, bad URI ...
            raise RequestError(400, f"cannot use cartridge {spec.id[:200]!r}: {type(e).__name__}: {e}") from None

    @contextmanager
    def _keyed(self, key: tuple):
        """Resolutions of one key run one at a time; the lock exists only while some run (the
        number of keys clients can make is not bounded, the locks held at once are)."""
        with self._guard:
            held = self._locks.setdefault(key, [threading.Lock(), 0])
            held[1] += 1
        try:
            with held[0]:
                yield
        finally:
            with self._guard:
                held[1] -= 1
                if held[1] == 0:
                    del self._locks[key]

    def _remember(self, key: tuple, value: Resolved) -> None:
        """Cache `value` under `key`, the least recently used entry dropped past MAX_CACHED."""
        with self._guard:
            self._cache[key] = _Cached(value, self.registry.data_version())
            self._cache.move_to_end(key)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)

    def _where(self, spec: CartridgeSpec) -> str:
        explicit = "source" in spec.model_fields_set
        cid = spec.id
        if cid.startswith("s3://"):
            if explicit and spec.source == "local":
                raise RequestError(400, f"{cid[:200]!r} is an S3 URI but source is 'local'")
            return "s3"
        if cid.startswith("/"):
            if explicit and spec.source == "s3":
                raise RequestError(400, f"{cid[:200]!r} is a local path but source is 's3'; send source 'local'")
            return "local"
        if "://" in cid:
            raise RequestError(400, f"{cid[:200]!r}: only s3:// URIs, absolute local paths and registered ids "
                                    "are understood")
        if explicit and spec.source == "local":
            raise RequestError(400, f"local cartridge id must be an absolute path, got {cid[:200]!r}")
        return "registry"

    def _allow_forced(self, origin: str) -> None:
        """A forced refetch of the cartridge read from `origin` (a resolved local path, an s3://
        URI, a registry entry's `source_uri`), if none was honoured in the last
        `force_redownload_interval` seconds: each one makes every instance drop its copies and
        read the origin again. Keyed by the origin, not the spelling: an id, its labels and its
        path share one limit (a converted input is checked for its input and its packed
        directory, the registered cartridge's origin: `_converted`)."""
        import time

        interval = self.settings.force_redownload_interval
        if interval <= 0:
            raise RequestError(403, "force_redownload is disabled on this gateway")
        now = time.monotonic()
        with self._guard:
            last = self._forced.get(origin)
            if last is not None and now - last < interval:
                raise RequestError(429, f"force_redownload of this cartridge was honoured {now - last:.0f}s ago; "
                                        f"at most once every {interval:.0f}s", retry_after=interval - (now - last))
            self._forced[origin] = now
            self._forced.move_to_end(origin)
            while len(self._forced) > MAX_CACHED:
                self._forced.popitem(last=False)

    def _read_input(self, where: str, spec: CartridgeSpec, tenant: Tenant | None, input_key: tuple) -> Resolved:
        """`_local` or `_s3` and the engine check (`_check`), with their refusals remembered: an
        input refused for what its bytes are (`_REMEMBERED`) is refused again from memory, without
        a read or a download, until it changes (a local input's key is its stat signature),
        `REFUSAL_SECONDS` pass, or force_redownload asks for it again (at most once per interval:
        `_allow_forced`)."""
        import time

        now = time.monotonic()
        if not spec.force_redownload:
            with self._guard:
                refused = self._refused.get(input_key)
            if refused is not None and now - refused[1] < REFUSAL_SECONDS:
                raise RequestError(refused[0].status, str(refused[0]))
        try:
            value = {"s3": self._s3, "local": self._local}[where](spec, tenant)
            self._check(value)
            return value
        except RequestError as e:
            if e.status in _REMEMBERED:
                with self._guard:
                    self._refused[input_key] = (e, now)
                    self._refused.move_to_end(input_key)
                    while len(self._refused) > MAX_CACHED:
                        self._refused.popitem(last=False)
            raise

    def _allowed_local(self, name: str, tenant: Tenant | None = None) -> Path:
        """`name` with every symlink resolved, if it lies under an allowed local root (the
        tenant's, if any); else 403. Only the path's own components are looked at (no walk, no read)."""
        resolved = Path(name).resolve()
        roots = tenant.local_roots if tenant is not None else self.settings.local_roots
        if not any(resolved.is_relative_to(root.resolve()) for root in roots):
            raise RequestError(403, f"{name[:200]} is outside the directories this gateway may read")
        return resolved

    def _allowed_s3(self, uri: str, tenant: Tenant | None) -> None:
        from lmcache_cartridge.store.s3 import parse_s3_uri

        try:
            bucket, key = parse_s3_uri(uri)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        roots = tenant.s3_roots if tenant is not None else self.settings.s3_roots
        if not any(_s3_allowed(root, bucket, key) for root in roots):
            raise RequestError(403, f"{uri[:200]} is outside the S3 buckets/prefixes this gateway may read")

    @staticmethod
    def _visible(entry: Entry | None, name: str, tenant: Tenant | None) -> None:
        """A registered cartridge the tenant may not name answers as a missing one (404, the
        same words): which ids exist is not its business."""
        if tenant is not None and (entry is None or not tenant.may_name(entry.id)):
            raise RequestError(404, f"no cartridge with id or label {name[:200]!r}")

    def _signature(self, path: Path, tenant: Tenant | None = None) -> tuple:
        """What changes when a local input changes (stat only: no reading, no hashing). A
        directory is walked, at most MAX_LOCAL_ENTRIES entries of any kind, and every file in it
        must resolve under an allowed root too (a symlink to anywhere else is refused before it
        is read)."""
        try:
            if not path.is_dir():
                files = [path]
            else:
                files = []
                for n, q in enumerate(path.rglob("*")):
                    if n >= MAX_LOCAL_ENTRIES:
                        raise RequestError(400, f"{path} holds more than {MAX_LOCAL_ENTRIES} entries (files and "
                                                "directories): an input directory is a cartridge's few files")
                    if q.is_symlink() or q.is_file():
                        self._allowed_local(str(q), tenant)
                        files.append(q)
                files.sort()
            return tuple((str(q), st.st_ino, st.st_size, st.st_mtime_ns) for q in files for st in [q.stat()])
        except (OSError, ValueError):
            return ()  # missing or unreadable: resolution says why

    def _hit(self, key: tuple) -> Resolved | None:
        with self._guard:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            return None
        v = cached.value
        if v.entry is None:
            return v
        version = self.registry.data_version()
        if version == cached.version:
            return v
        current = self.registry.get(v.entry.id)  # someone else changed the registry: re-check (a read)
        if current is None or current.path != v.entry.path or current.content_hash != v.entry.content_hash:
            with self._guard:
                self._cache.pop(key, None)
            return None
        cached.value, cached.version = replace(v, entry=current), version
        return cached.value

    def _check(self, r: Resolved) -> None:
        if r.manifest is not None:
            why = mismatch(r.manifest, self.engine)
            if why:
                raise RequestError(400, f"cartridge {r.name!r} cannot be served here: {why}")
        elif r.token_ids:
            size = self.vocab().vocab_size
            bad = [t for t in r.token_ids if not 0 <= t < size]
            if bad:
                raise RequestError(400, f"cartridge {r.name!r} has token ids outside the model's vocabulary "
                                        f"of {size} (e.g. {bad[0]}): was it made with another tokenizer?")

    def vocab(self):
        if self._vocab is None:
            from lmcache_cartridge.store.registration import load_vocab

            self._vocab = load_vocab(self.settings.tokenizer)
        return self._vocab

    def _register(self, directory: str | Path, source_uri: str, *, force: bool, client: bool,
                  tenant: Tenant | None, expect_id: str | None = None, catalog: str = "") -> Entry:
        """Register what a client named, under the claim rules every registration for a client
        passes, a re-registration too: never an id another origin holds, never one outside the
        tenant's ids, and (`expect_id`) never another id than the entry's own."""
        with refused_as_http():
            entry = self.registry.register(directory, source_uri=source_uri, force_redownload=force,
                                           replace_origin=False, client=client, may_claim=_claims(tenant),
                                           expect_id=expect_id, catalog=catalog)
        self.stats["registrations"] += 1
        return entry

    def _registered(self, name: str, directory: Path, source_uri: str, force: bool,
                    tenant: Tenant | None) -> Resolved:
        entry = self._register(directory, source_uri, force=force, client=True, tenant=tenant)
        m = Manifest.load(entry.path)
        return Resolved(name, m.kind, tuple(m.token_ids), entry, m)

    def _registry(self, spec: CartridgeSpec, tenant: Tenant | None = None) -> Resolved:
        try:
            entry = self.registry.resolve(spec.id, visible=tenant.may_name if tenant is not None else None)
        except RegistryError as e:
            raise RequestError(404, str(e)) from None
        self._visible(entry, spec.id, tenant)
        if spec.force_redownload:  # servers drop their cached copies and read the origin again
            self._allow_forced(entry.source_uri)  # per origin, however it is spelled (id, labels, path)
            # what a client brought stays a client's, a catalog's its catalog's; the manifest may
            # have been rewritten since
            entry = self._register(entry.path, entry.source_uri, force=True, client=entry.client, tenant=tenant,
                                   expect_id=entry.id, catalog=entry.catalog)
        m = Manifest.load(entry.path)
        return Resolved(entry.id, m.kind, tuple(m.token_ids), entry, m)

    def _local(self, spec: CartridgeSpec, tenant: Tenant | None = None) -> Resolved:
        resolved = self._allowed_local(spec.id, tenant)
        if resolved.is_dir() and (resolved / MANIFEST_NAME).is_file():
            return self._registered(spec.id, resolved, str(resolved), spec.force_redownload, tenant)
        if not resolved.exists():
            raise RequestError(404, f"no cartridge at {spec.id}")
        from lmcache_cartridge.store.registration import content_digest

        self.stats["hashes"] += 1
        if resolved.is_dir():
            return self._converted(spec, resolved, content_digest(resolved), resolved.name, tenant)
        # the file checked is the file read: opened once beneath its root, read through that descriptor
        roots = tenant.local_roots if tenant is not None else self.settings.local_roots
        root = next(r.resolve() for r in roots if resolved.is_relative_to(r.resolve()))
        with opened_beneath(resolved, root) as (pinned, beside):
            return self._converted(spec, pinned, content_digest(pinned), resolved.name, tenant,
                                   named=resolved, beside=beside)

    def _converted(self, spec: CartridgeSpec, path: Path, digest: str, name: str,
                   tenant: Tenant | None = None, named: Path | None = None, beside: Path | None = None) -> Resolved:
        """Convert the input at `path`; `named` (the path a client named, where `path` is its open
        file) names it, `beside` (its open directory) holds the files read beside it."""
        from lmcache_cartridge.store.registration import convert_input

        self.stats["conversions"] += 1
        with refused_as_http():
            out = convert_input(path, digest, self.settings.cache_dir, model=self.settings.model,
                                chunk_size=self.settings.chunk_size, vocab=self.vocab,
                                name=Path(name).stem if path.is_file() else name, named=named, beside=beside,
                                model_dir=self.settings.model if Path(self.settings.model).is_dir()
                                else self.settings.tokenizer)
        if out.packed_dir is None:
            self._budget(path)
            return Resolved(spec.id, "tokens", tuple(out.token_ids))
        if spec.force_redownload:  # the registered cartridge's own origin: its id may have been forced
            self._allow_forced(str(out.packed_dir))
        resolved = self._registered(spec.id, out.packed_dir, str(out.packed_dir), spec.force_redownload, tenant)
        self._budget(out.packed_dir, path)
        return resolved

    def _budget(self, *using: Path) -> None:
        """Keep what clients made us store within `max_cache_bytes` (`store.cache_budget`),
        never evicting what this resolution uses (`using`: its conversion, its download)."""
        from lmcache_cartridge.store.cache_budget import AREAS, enforce

        cache = Path(self.settings.cache_dir)
        keep = tuple(cache / area / Path(p).relative_to(cache / area).parts[0]
                     for p in using for area in AREAS if (cache / area) in Path(p).parents)
        enforce(cache, self.registry, self.settings.max_cache_bytes, keep=keep)

    @staticmethod
    def _dropped_if_refused(downloaded: Path, convert):
        """`convert()`; if it refuses the input (4xx), the downloaded copy under the cache dir's
        `objects/` is deleted: refused bytes must not stay on disk for good."""
        try:
            return convert()
        except RequestError as e:
            if 400 <= e.status < 500:
                import shutil

                shutil.rmtree(downloaded, ignore_errors=True)
            raise

    def _s3(self, spec: CartridgeSpec, tenant: Tenant | None = None) -> Resolved:
        from lmcache_cartridge.store.registration import fetch_s3_dir, fetch_s3_object, register_s3
        from lmcache_cartridge.store.s3 import S3Settings, parse_s3_uri

        key = parse_s3_uri(spec.id)[1]  # checked against the allowed roots by `resolve`
        with refused_as_http(spec.id):
            settings = S3Settings.from_mapping(self.settings.s3)
            if key.endswith(OBJECT_SUFFIXES):
                obj = fetch_s3_object(spec.id, settings, self.settings.cache_dir, force=spec.force_redownload)
                self.stats["s3_objects"] += obj.downloaded
                return self._dropped_if_refused(obj.path.parent, lambda: self._converted(
                    spec, obj.path, obj.sha256, obj.path.name, tenant))
            listed = fetch_s3_dir(spec.id, settings, self.settings.cache_dir, force=spec.force_redownload)
            self.stats["s3_lists"] += 1
            if not listed.packed:  # an input directory (PEFT adapter, Tokasaurus, ...): converted once
                self.stats["s3_objects"] += listed.downloaded
                return self._dropped_if_refused(listed.path.parent, lambda: self._converted(
                    spec, listed.path, listed.digest, listed.uri.rsplit("/", 1)[-1], tenant))
            self.stats["s3_manifests"] += 1
            entry = register_s3(self.registry, spec.id, self.settings.cache_dir, settings,
                                force_redownload=spec.force_redownload, engine=self.engine, replace_origin=False,
                                client=True, may_claim=_claims(tenant))
            self.stats["registrations"] += 1
        m = Manifest.load(entry.path)
        return Resolved(spec.id, m.kind, tuple(m.token_ids), entry, m)

    # --- a request's list ----------------------------------------------------------------------
    def plan(self, parts: list[Resolved]) -> Plan:
        """Place `parts` in request order (the rules in this module's docstring).

        The "KV head" is every part up to and including the last trained one (`_kv_runs`): its
        trained KV is loaded, never computed; tokens between are computed by priming requests.
        The parts after it are placed as tokens (`_tail`)."""
        last = max((i for i, p in enumerate(parts) if p.kind == "trained"), default=-1)
        plan = Plan()
        if last >= 0:
            placed, runs = self._kv_runs(parts[:last + 1])
            plan = Plan(placed, [], trained=True, kv_end=len(placed))
            previous_end = 0  # where the KV the previous run loads ends (0: no run before)
            from lmcache_cartridge.store.composite import recipe

            for start, run in runs:
                end = start + sum(len(p.token_ids) for p in run)
                if len(run) == 1 and not start:
                    plan.wanted.append(run[0].entry)
                else:
                    plan.wanted.append(self._composite(run, placed[:start])[0])
                    plan.composites.append((end, recipe([p.entry for p in run], start)))
                if start:  # tokens before it are computed: a priming request stores their chunks
                    plan.primes.append(Prime(start, previous_end))
                previous_end = end
        return self._tail(plan, parts[last + 1:])

    @staticmethod
    def _tail(plan: Plan, parts: list[Resolved]) -> Plan:
        """Token-only and first-k parts after the KV head: their ids in order; a first-k
        cartridge's own KV where it is exact (it extends what precedes it), else prefilled.

        KV a client brought (`Entry.salt`) is loaded only as the request's one KV cartridge: the
        salt tags every key of the request, and no other cartridge's keys carry it. Elsewhere
        its tokens are computed (exact for first-k, as every prefill)."""
        for p in parts:
            ids = list(p.token_ids)
            if p.kind == "first_k" and ids[:len(plan.prefix)] == plan.prefix:
                plan.prefix = ids  # it extends what precedes it: its own KV is exact here
                if _salted(p):
                    if not plan.wanted:
                        plan.wanted.append(p.entry)
                        plan.salt = p.entry.salt
                elif not plan.salt:  # under a salt its keys would not match: computed
                    plan.wanted.append(p.entry)
            else:
                plan.prefix += ids  # plain tokens after what precedes them: vLLM computes them
        return plan

    def _kv_runs(self, parts: list[Resolved]) -> tuple[list[int], list[tuple[int, list[Resolved]]]]:
        """The head's token ids and its KV runs `(start, parts)`: maximal runs of cartridges whose
        KV, concatenated, is loaded at `start`; between runs, tokens vLLM computes.

        Trained parts keep the positions they were trained at (the Cartridges paper's
        composition). A first-k part is used where its KV is exact: it is first or extends the
        ids placed before it, with no trained part before (its KV then covers them all);
        otherwise its ids are computed like a token-only cartridge's. A run without a trained
        part before computed tokens is computed too (its chunks would share LMCache keys with
        them). Every run starts on a chunk boundary; else 400 saying why (docs/request-api.md)."""
        chunk = self.settings.chunk_size
        runs: list[tuple[int, list[Resolved]]] = []
        placed: list[int] = []   # token ids placed so far
        kv_end = -1              # where the last run's KV ends (-1: no run yet)
        for p in parts:
            ids = list(p.token_ids)
            if not ids:
                continue  # an empty token-only cartridge places nothing
            if p.kind == "first_k" and not _salted(p) and not any(q.kind == "trained" for _, r in runs for q in r) \
                    and ids[:len(placed)] == placed:
                runs, placed, kv_end = [(0, [p])], ids, len(ids)  # exact: covers all before it
                continue
            if p.kind != "trained":
                placed += ids  # computed by vLLM after what precedes it (priming, if before a run)
                continue
            if len(placed) % chunk:
                raise RequestError(400, f"trained cartridge {p.name!r} would start at token {len(placed)}, not "
                                        f"a multiple of the chunk size {chunk}: LMCache serves KV in whole "
                                        f"chunks keyed by the prompt's tokens, so the chunk holding its first "
                                        "tokens would also hold the tokens before it and be computed from "
                                        "placeholder ids. Make the tokens before it a multiple of "
                                        f"{chunk} (e.g. a first-k cartridge of whole chunks), or list the "
                                        "trained cartridge first")
            if kv_end == len(placed):
                runs[-1][1].append(p)  # extends the run before it
            else:
                runs = [(s, r) for s, r in runs if any(q.kind == "trained" for q in r)]  # else computed
                runs.append((len(placed), [p]))
            placed += ids
            kv_end = len(placed)
        return placed, runs

    def _composite(self, parts: list[Resolved], context_ids: list[int]) -> tuple[Entry, Manifest]:
        from lmcache_cartridge.store.composite import register_composite

        key = ("composite", tuple((p.entry.id, p.entry.content_hash, p.entry.source_uri) for p in parts),
               tuple(context_ids))
        with self._keyed(key):
            hit = self._hit(key)
            if hit is not None:
                return hit.entry, hit.manifest
            with refused_as_http():
                entry, m = register_composite(self.registry, [(p.entry, p.manifest) for p in parts],
                                              self.settings.cache_dir, context_ids)
            self.stats["registrations"] += 1
            self._remember(key, Resolved(entry.id, "trained", tuple(m.token_ids), entry, m))
            return entry, m


def _claims(tenant: Tenant | None):
    """The ids a registration for `tenant`'s client may give (None: an operator's key, any)."""
    return tenant.may_name if tenant is not None else None


def _s3_allowed(root: str, bucket: str, key: str) -> bool:
    """Is `s3://bucket/key` under `root` ("bucket" or "bucket/prefix", as given to --allow-s3)?"""
    rb, _, rp = root.removeprefix("s3://").strip("/").partition("/")
    return rb == bucket and (not rp or key == rp or key.startswith(rp + "/"))
