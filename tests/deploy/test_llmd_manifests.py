"""docker/k8s/llm-d: every manifest validated against its published schema (the vendored
InferencePool CRD, the Kubernetes API for the rest, the router's EndpointPickerConfig types),
and the pieces agreeing with each other and with the server's flags and metric names."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.settings.config import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
LLMD = ROOT / "docker" / "k8s" / "llm-d"
CRD = LLMD / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
EPP_SCHEMA = LLMD / "crds" / "endpointpickerconfig.schema.json"
METRICS_SRC = ROOT / "server" / "http" / "metrics.py"


def docs() -> dict[str, dict]:
    out = {}
    for p in sorted(LLMD.glob("*.yaml")):
        if p.name != "kustomization.yaml":
            for d in yaml.safe_load_all(p.read_text()):
                out[d["kind"]] = d
    return out


def pool_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def epp_config(d: dict) -> dict:
    return yaml.safe_load(d["ConfigMap"]["data"]["epp-config.yaml"])


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((LLMD / "kustomization.yaml").read_text())
    files = {p.name for p in LLMD.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files


def test_inference_pool_validates_against_the_published_crd():
    d = docs()
    pool = d["InferencePool"]
    schema = pool_schema()
    jsonschema.validate(pool, schema)
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(pool)
    del bad["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize("kind", ["Deployment", "Service", "ConfigMap"])
def test_kubernetes_objects_validate(kind):
    d = docs()[kind]
    for version in ["1.27.0", kubernetes_validate.latest_version()]:
        kubernetes_validate.validate(d, version, strict=True)


def test_router_config_validates_and_refers_to_declared_plugins():
    cfg = epp_config(docs())
    schema = json.loads(EPP_SCHEMA.read_text())
    jsonschema.validate(cfg, schema)
    declared = {p.get("name", p["type"]) for p in cfg["plugins"]}
    refs = [x["pluginRef"] for prof in cfg["schedulingProfiles"] for x in prof["plugins"]]
    for src in cfg["dataLayer"]["sources"]:
        refs += [src["pluginRef"]] + [e["pluginRef"] for e in src["extractors"]]
    assert set(refs) <= declared, set(refs) - declared
    scored = {x["pluginRef"] for x in cfg["schedulingProfiles"][0]["plugins"]}
    # load, KV use and precise prefix hits
    assert {"queue-scorer", "kv-cache-utilization-scorer", "precise-prefix-cache-scorer"} <= scored
    bad = copy.deepcopy(cfg)
    bad["schedulingProfiles"][0]["plugins"][0]["weigth"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _params(cfg: dict, kind: str) -> dict:
    (p,) = [p for p in cfg["plugins"] if p["type"] == kind]
    return p.get("parameters", {})


def test_pieces_agree_with_each_other_and_the_server():
    d = docs()
    cfg = epp_config(d)
    pod = d["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    known = {o.env for o in OPTIONS}
    assert set(env) - {"POD_IP"} <= known
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # the pool selects the pods, on the server's port
    pool = d["InferencePool"]["spec"]
    assert all(labels.get(k) == v for k, v in pool["selector"]["matchLabels"].items())
    assert (
        [p["number"] for p in pool["targetPorts"]]
        == [ports["http"]]
        == [int(env["LLAMA_ARG_PORT"])]
    )
    # the precise scorer: same block size, the events' port, a selector matching the pods
    pp = _params(cfg, "precise-prefix-cache-scorer")
    assert pp["tokenProcessorConfig"]["blockSize"] == int(env["LLAMA_ARG_KV_BLOCK_SIZE"])
    disc = pp["kvEventsConfig"]["podDiscoveryConfig"]
    assert env["LLAMA_ARG_KV_EVENTS_ENDPOINT"] == f"tcp://*:{disc['socketPort']}"
    # the router dials the pod: the bind beyond the loopback is confirmed (issue 40)
    assert env["LLAMA_ARG_KV_EVENTS_ALLOW_REMOTE"] == "1"
    assert ports["kv-events"] == disc["socketPort"]
    key, value = disc["podLabelSelector"].split("=")
    assert labels[key] == value
    # the topic names the pod as the router does (<IP>:<port>) and the model as clients do
    model = env["LLAMA_ARG_ALIAS"]
    assert env["LLAMA_ARG_KV_EVENTS_TOPIC"] == f"kv@$(POD_IP):{ports['http']}@{model}"
    assert _params(cfg, "token-producer")["modelName"] == model
    tiers = {b["name"] for b in pp["indexerConfig"]["kvCacheBackendConfigs"]}
    assert tiers == {"gpu", "cpu", "disk"}  # the events' media, lower-cased
    # the metric mapping: this pod's engine label, metric names the server exposes
    cm = _params(cfg, "core-metrics-extractor")
    (eng,) = cm["engineConfigs"]
    assert labels[cm["engineLabelKey"]] == eng["name"]
    src = METRICS_SRC.read_text()
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert f'"{eng[spec]}"' in src, eng[spec]
    assert f'"{eng["cacheBlockSizeLabelName"]}"' in src
    assert f'"{eng["cacheNumBlocksLabelName"]}"' in src
