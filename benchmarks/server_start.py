"""What a vLLM server start costs, by how the server computes, side by side on one machine.

    .venv/bin/python benchmarks/server_start.py [--model tiny|real] [--rounds 2] [--out DIR]

One vLLM-CPU server at a time, as the tests, the demo and `create` start it
(`testing.launch.VllmServer` with LMCache + the cartridge plugin + `CartridgeConnector`), per mode:

- `compiled (cold cache)`: vLLM's default compiled model (torch.compile, inductor), with an empty
  inductor cache: what the first start on a machine costs;
- `compiled`: the same with the cache the first start left (`paths.inductor_cache_dir`, shared
  by every server we start): every later start;
- `compiled (AOT on)`: vllm-cpu's own default (`VLLM_USE_AOT_COMPILE=1`: it saves an AOT artifact
  and fails to load it at the next start, so it compiles again from the inductor cache);
- `eager` (`--enforce-eager`) and `ci` (`VLLM_CPU_CI_ENV=1`: dynamo with the eager backend, no
  warm-up): the cheaper starts vLLM offers.

For each: seconds from launch to a healthy `/health`, then two completions of a 700-token prompt
(greedy, 16 tokens; the first pays any lazy compilation), and the largest |dlogprob| against
the `compiled` mode's answer (0 means the same kernels). Rounds alternate the modes' order.
Results: `server_start.{json,md}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import urllib.request
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, percentile, write_result

PROMPT_TOKENS = 700
MODES = {  # name -> (extra env, extra args, fresh inductor cache)
    "compiled (cold cache)": ({}, (), True),
    "compiled": ({}, (), False),
    "compiled (AOT on)": ({"VLLM_USE_AOT_COMPILE": "1"}, (), False),
    "eager": ({}, ("--enforce-eager",), False),
    "ci": ({"VLLM_CPU_CI_ENV": "1"}, (), False),
}


def complete(url: str, model: str, ids: list[int]) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0, "logprobs": 1,
            "kv_transfer_params": {"lmcache.skip_save": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t, out["choices"][0]["logprobs"]["token_logprobs"]


def one(mode: str, model_dir: Path, work: Path) -> dict:
    from lmcache_cartridge.paths import inductor_cache_dir
    from lmcache_cartridge.testing.launch import VllmServer, lmcache_config

    env, args, cold = MODES[mode]
    env = dict(env)
    if cold:  # a private, empty cache: the shared one is left as it is
        fresh = work / "inductor-cold"
        shutil.rmtree(fresh, ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(fresh)
    else:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    root = work / f"{mode.replace(' ', '_').replace(',', '')}-{time.time_ns()}"
    srv = VllmServer(root, str(model_dir), lmcache=lmcache_config(root / "registry.db"), extra_env=env,
                     extra_args=args)
    try:
        srv.wait_healthy(timeout=900)
        ids = [1] + list(range(300, 300 + PROMPT_TOKENS - 1))
        first_s, lp = complete(srv.url, str(model_dir), ids)
        second_s, _ = complete(srv.url, str(model_dir), ids)
        return {"mode": mode, "startup_s": srv.startup_s, "first_request_s": first_s,
                "second_request_s": second_s, "logprobs": lp}
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/server_start")
    args = ap.parse_args(argv)
    if args.model == "tiny":
        from lmcache_cartridge.tools.testmodel import ensure_test_model

        model_dir = ensure_test_model()
    else:
        from lmcache_cartridge.tools.realmodel import ensure_real_model

        model_dir = ensure_real_model()
    modes = [m for m in args.modes.split(",") if m]
    work = ROOT / ".cache" / "server-start"
    work.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    runs: list[dict] = []
    # the shared cache warm before anything is measured "warm"
    one("compiled", model_dir, work)
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            res = one(mode, model_dir, work)
            runs.append(res)
            print(f"[server start] round {r + 1} {mode}: start {res['startup_s']:.1f} s, first request "
                  f"{res['first_request_s']:.2f} s, second {res['second_request_s']:.2f} s", flush=True)
    ref = next(x["logprobs"] for x in runs if x["mode"] == "compiled")
    rows = []
    for mode in modes:
        rs = [x for x in runs if x["mode"] == mode]
        rows.append({"mode": mode, "startup_s": percentile([x["startup_s"] for x in rs], 50),
                     "first_request_s": percentile([x["first_request_s"] for x in rs], 50),
                     "second_request_s": percentile([x["second_request_s"] for x in rs], 50),
                     "max_dlogprob_vs_compiled": max(max(abs(a - b) for a, b in zip(x["logprobs"], ref)) for x in rs)})
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"server_start-{args.model}"
    md = [f"vLLM server start by mode, {Path(model_dir).name}, {info.get('cpu', '?')}, median of {args.rounds}",
          "", "| mode | start (s) | first request (s) | second request (s) | max abs dlogprob vs compiled |",
          "|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['startup_s']:.1f} | {r['first_request_s']:.2f} | {r['second_request_s']:.2f} | "
           f"{r['max_dlogprob_vs_compiled']:.4f} |" for r in rows]
    arms = [Arm.from_samples(f"{mode}/{k}", [x[k] for x in runs if x["mode"] == mode])
            for mode in modes for k in ("startup_s", "first_request_s", "second_request_s")]
    write_result(Result(benchmark="server_start", machine=info, parameters=vars(args), arms=arms,
                        details={"model": str(model_dir), "prompt_tokens": PROMPT_TOKENS, "rows": rows, "runs": runs}),
                 args.out, name, body="\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
