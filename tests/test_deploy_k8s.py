"""The Kubernetes objects a cluster would be given, checked without one: every object of
deploy/k8s/ and the engine and router pods production-stack's chart makes from
deploy/helm/values-cartridges.yaml validate against the Kubernetes API schemas
(`kubernetes-validate`, which ships them: no cluster, no network), and every pod meets Pod
Security "restricted" plus a read-only root filesystem whose writes land on emptyDirs.

No helm binary here: the chart's pods are put together from the values the way the chart's
templates place them (`engine_pod`, `router_pod`: production-stack's
helm/templates/deployment-vllm-multi.yaml and deployment-router.yaml, the fields these values
set)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
VALUES = ROOT / "deploy" / "helm" / "values-cartridges.yaml"
K8S_VERSION = "1.33"  # a release every supported cluster serves these APIs in
CUSTOM_KINDS = {"ServiceMonitor"}  # kube-prometheus-stack's CRD: no schema in Kubernetes' own


def manifests() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def _probe(p: dict) -> dict:
    """The chart's `chart.templateProbe` (an httpGet probe with its defaults)."""
    return {"initialDelaySeconds": p.get("initialDelaySeconds", 15), "periodSeconds": p.get("periodSeconds", 10),
            "failureThreshold": p.get("failureThreshold", 3),
            "httpGet": {"path": p.get("httpGet", {}).get("path", "/health"),
                        "port": p.get("httpGet", {}).get("port", 8000)}}


def _deployment(name: str, labels: dict, pod: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def engine_pod(v: dict) -> dict:
    """The engine Deployment the chart renders for the first modelSpec, with the fields the
    values set: pod and container securityContext, probes, resources, env, volumes and mounts."""
    se = v["servingEngineSpec"]
    spec = se["modelSpec"][0]
    container = {
        "name": "vllm", "image": f"{spec['repository']}:{spec['tag']}",
        "command": ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", str(se["containerPort"])]
        + list(spec["vllmConfig"].get("extraArgs", [])),
        "env": copy.deepcopy(spec.get("env", [])),
        "ports": [{"name": "container-port", "containerPort": se["containerPort"]}],
        "resources": copy.deepcopy(spec["resources"]),
        "volumeMounts": copy.deepcopy(spec.get("extraVolumeMounts", [])),
    }
    if se.get("containerSecurityContext"):
        container["securityContext"] = copy.deepcopy(se["containerSecurityContext"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if se.get(kind):
            container[kind] = _probe(se[kind])
    pod = {"containers": [container], "volumes": copy.deepcopy(spec.get("extraVolumes", []))}
    if se.get("securityContext"):
        pod["securityContext"] = copy.deepcopy(se["securityContext"])
    return _deployment(f"cartridges-{spec['name']}-deployment-vllm", dict(se["labels"]), pod)


def router_pod(v: dict) -> dict:
    rs = v["routerSpec"]
    container = {"name": "router-container", "image": "lmcache/lmstack-router:latest",
                 "ports": [{"name": "router-cport", "containerPort": rs["containerPort"]}],
                 "volumeMounts": copy.deepcopy(rs.get("extraVolumeMounts", []))}
    if rs.get("containerSecurityContext"):
        container["securityContext"] = copy.deepcopy(rs["containerSecurityContext"])
    pod = {"containers": [container], "volumes": copy.deepcopy(rs.get("extraVolumes", []))}
    if rs.get("securityContext"):
        pod["securityContext"] = copy.deepcopy(rs["securityContext"])
    return _deployment("cartridges-deployment-router", dict(rs["labels"]), pod)


def validate(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- Pod Security "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards) ----
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
WRITABLE = ("/tmp",)  # every server writes here; its home is checked per pod


def restricted_problems(pod: dict) -> list[str]:
    """Why `pod` (a PodSpec) fails Pod Security "restricted" or a read-only root filesystem whose
    written paths are emptyDirs, as a list of reasons (empty: it passes)."""
    out = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"pod {key}")
    for vol in pod.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {vol['name']}: {sorted(kinds - ALLOWED_VOLUMES)}")
    empty_dirs = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    for c in (pod.get("initContainers") or []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp!r}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{name}: hostPort")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: readOnlyRootFilesystem is not true")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
        for path in WRITABLE:
            if mounts.get(path) not in empty_dirs:
                out.append(f"{name}: {path} is not an emptyDir")
    return out


def pods() -> dict[str, dict]:
    """Every pod template this project deploys, by the Deployment's name."""
    deployments = [d for d in manifests() if d["kind"] == "Deployment"]
    deployments += [engine_pod(values()), router_pod(values())]
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in deployments}


# --- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("obj", [d for d in manifests() if d["kind"] not in CUSTOM_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifests_validate_against_the_kubernetes_schemas(obj):
    validate(obj)


def test_the_charts_pods_from_the_values_validate():
    validate(engine_pod(values()))
    validate(router_pod(values()))


def test_the_validator_rejects_what_a_cluster_would():
    """An unknown field and a wrongly typed one are refused (the schemas are really read)."""
    import kubernetes_validate

    dep = engine_pod(values())
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_every_pod_meets_pod_security_restricted():
    found = pods()
    assert {"cartridge-gateway", "cartridges-llama3-deployment-vllm", "cartridges-deployment-router"} <= set(found)
    for name, pod in found.items():
        assert restricted_problems(pod) == [], name


def test_the_restricted_check_sees_each_rule():
    """Each rule the check enforces, broken one at a time on a passing pod, is reported."""
    pod = pods()["cartridge-gateway"]
    breaks = {
        "runAsNonRoot": lambda p: p["securityContext"].pop("runAsNonRoot") and
        p["containers"][0]["securityContext"].pop("runAsNonRoot"),
        "seccompProfile": lambda p: p["securityContext"].pop("seccompProfile"),
        "allowPrivilegeEscalation": lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        "capabilities": lambda p: p["containers"][0]["securityContext"].pop("capabilities"),
        "readOnlyRootFilesystem": lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
        "hostPath": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "/tmp": lambda p: p["volumes"].remove(next(v for v in p["volumes"] if v["name"] == "tmp")),
        "hostNetwork": lambda p: p.update(hostNetwork=True),
    }
    for rule, breaker in breaks.items():
        p = copy.deepcopy(pod)
        breaker(p)
        assert any(rule in problem for problem in restricted_problems(p)), rule


def _mounts(pod: dict) -> dict[str, dict]:
    vols = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: vols[m["name"]] for m in pod["containers"][0]["volumeMounts"]}


def _quantity(q) -> float:
    from test_deploy import quantity

    return quantity(q)


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["containers"][0].get("env") or [] if "value" in e}


def test_the_engines_disk_tier_is_an_emptydir_the_ephemeral_storage_request_holds():
    """The plugin's disk tier (disk_budget_gb) and the model's download live under the server's
    home, an emptyDir; the pod requests (and is limited to) the ephemeral storage its emptyDirs
    may fill, so the scheduler places it on a node that holds them."""
    import json

    from test_deploy import docker_env

    pod = pods()["cartridges-llama3-deployment-vllm"]
    env = _env(pod)
    home = env["LMCACHE_CARTRIDGE_HOME"]
    assert docker_env("engine")["LMCACHE_CARTRIDGE_HOME"] == home == docker_env("engine")["HOME"]
    for var in ("HF_HOME", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        assert docker_env("engine")[var].startswith(home + "/"), var
    mounts = _mounts(pod)
    assert "emptyDir" in mounts[home] and "emptyDir" in mounts["/tmp"]
    prom = values()["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["prometheusMultiprocDir"]
    assert "emptyDir" in mounts[prom]  # a fresh one per container, as the plugin's metrics need
    assert mounts["/dev/shm"]["emptyDir"].get("medium") == "Memory"
    disk_gb = float(json.loads(env["LMCACHE_EXTRA_CONFIG"])["storage_plugin.cartridge.disk_budget_gb"])
    assert _quantity(mounts[home]["emptyDir"]["sizeLimit"]) >= disk_gb * 2**30 + 16 * 2**30  # + the model
    res = pod["containers"][0]["resources"]
    on_disk = sum(_quantity(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]
                  if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
    assert _quantity(res["limits"]["ephemeral-storage"]) >= _quantity(res["requests"]["ephemeral-storage"]) >= on_disk
    in_memory = sum(_quantity(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]
                    if v.get("emptyDir", {}).get("medium") == "Memory")
    tiers = (float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"])
             + float(json.loads(env["LMCACHE_EXTRA_CONFIG"])["storage_plugin.cartridge.cpu_budget_gb"])) * 2**30
    assert _quantity(res["limits"]["memory"]) >= tiers + in_memory + 16 * 2**30


def test_the_gateways_writes_land_on_emptydirs_its_ephemeral_storage_holds():
    dep = next(d for d in manifests() if d["kind"] == "Deployment" and d["metadata"]["name"] == "cartridge-gateway")
    pod = dep["spec"]["template"]["spec"]
    home = _env(pod)["LMCACHE_CARTRIDGE_HOME"]
    mounts = _mounts(pod)
    assert "emptyDir" in mounts[home] and "emptyDir" in mounts["/tmp"]
    res = pod["containers"][0]["resources"]
    on_disk = sum(_quantity(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"] if "emptyDir" in v)
    assert _quantity(res["limits"]["ephemeral-storage"]) >= on_disk
    from lmcache_cartridge.tools.cli import build_parser

    args = build_parser().parse_args(pod["containers"][0]["command"][1:])
    assert _quantity(mounts[home]["emptyDir"]["sizeLimit"]) >= args.max_cache_bytes
    assert pod["containers"][0]["startupProbe"]["httpGet"] == pod["containers"][0]["livenessProbe"]["httpGet"]


def test_disruption_budgets_keep_a_replica_of_each_serving():
    """The gateway's PodDisruptionBudget selects its pods and keeps one; the chart's budgets for
    the engines and the router are enabled and never allow all replicas down."""
    docs = manifests()
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["minAvailable"] >= 1 and dep["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    v = values()
    engines = v["servingEngineSpec"]["modelSpec"][0]
    assert engines["pdb"]["enabled"] and 0 < engines["pdb"]["maxUnavailable"] < engines["replicaCount"]
    assert v["routerSpec"]["pdb"]["enabled"] and v["routerSpec"]["pdb"]["minAvailable"] >= 1
    assert v["servingEngineSpec"]["startupProbe"]["failureThreshold"] * \
        v["servingEngineSpec"]["startupProbe"]["periodSeconds"] >= 20 * 60  # a model download and a compile


def test_the_network_is_denied_by_default_and_each_pod_allowed_only_its_peers():
    """A default-deny policy (ingress and egress, every pod); DNS for all; each of the gateway, the
    router and the engines may reach only what it calls; Prometheus is selected by a namespace
    label the operator sets, never by a fixed namespace name."""
    policies = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "NetworkPolicy"}
    deny = policies["default-deny-all"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    for name, p in policies.items():
        for rule in p["spec"].get("ingress", []) + p["spec"].get("egress", []):
            for peer in rule.get("from", []) + rule.get("to", []):
                ns = (peer.get("namespaceSelector") or {}).get("matchLabels", {})
                assert ns.get("kubernetes.io/metadata.name") in (None, "kube-system"), name
    engines = policies["cartridges-engines"]["spec"]
    scrape = [peer["namespaceSelector"]["matchLabels"] for rule in engines["ingress"] for peer in rule["from"]
              if "namespaceSelector" in peer]
    assert scrape == [{"lmcache-cartridge/scrape": "true"}]
    assert "lmcache-cartridge/scrape=true" in (K8S / "network-policies.yaml").read_text()  # the how-to
    for name in ("cartridge-gateway", "cartridges-router", "cartridges-engines"):
        assert set(policies[name]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, name
    router_egress = policies["cartridges-router"]["spec"]["egress"]
    assert router_egress[0]["to"][0]["podSelector"]["matchLabels"] == values()["servingEngineSpec"]["labels"]
    gateway_egress = policies["cartridge-gateway"]["spec"]["egress"]
    assert gateway_egress[0]["to"][0]["podSelector"]["matchLabels"] == values()["routerSpec"]["labels"]
    # the engines call nobody in the cluster: only HTTPS out (S3, the hub)
    assert all("ipBlock" in peer for rule in engines["egress"] for peer in rule["to"])
