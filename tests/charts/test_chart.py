"""The Helm chart, rendered by the real helm (``helm template``): every object valid against Kubernetes' own JSON
schemas in strict mode (kubernetes-validate) and the vendored schemas of the Prometheus Operator's and KEDA's
kinds; the values schema refusing wrong values at install; the probes, port, limits and rules agreeing with the
service and the files they come from."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from components import helm_path

from padim.service.app import create_app
from padim.service.lines.config import LinesFile
from padim.service.metrics import Metrics
from padim.service.settings import ServiceSettings

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "padim"
#: The Kubernetes release whose schemas the objects must meet (the newest kubernetes-validate has).
KUBERNETES = kubernetes_validate.latest_version()
#: Custom resources kubernetes-validate has no schema for: vendored in schemas/ (README there says from where).
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitor_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrule_v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json",
}
VALUES = {
    "default": [],
    "gpu": ["-f", str(CHART / "ci" / "gpu-values.yaml")],
    "keda": ["-f", str(CHART / "ci" / "keda-values.yaml")],
    "cpu": ["-f", str(CHART / "ci" / "cpu-values.yaml")],
}
pytestmark = pytest.mark.helm


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm_path()), *args], capture_output=True, text=True, timeout=120)


def render(*args: str) -> list[dict]:
    done = helm("template", "padim", str(CHART), "--namespace", "inspection", *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def env_of(deployment: dict) -> dict:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(*args) for name, args in VALUES.items()}


@pytest.mark.parametrize(
    "values, kinds",
    [
        ("default", {"ServiceAccount", "PersistentVolumeClaim", "Service", "Deployment"}),
        (
            "gpu",
            {"PodDisruptionBudget", "HorizontalPodAutoscaler", "Ingress", "ServiceMonitor", "PrometheusRule"},
        ),
        ("keda", {"ScaledObject", "ServiceMonitor", "PrometheusRule"}),
        ("cpu", {"ConfigMap", "Deployment"}),
    ],
)
def test_every_object_meets_the_schemas_of_its_kind_in_strict_mode(rendered, values, kinds):
    objects = rendered[values]
    assert kinds <= {o["kind"] for o in objects}
    for item in objects:
        custom = CUSTOM.get((item["apiVersion"], item["kind"]))
        if custom is None:
            kubernetes_validate.validate(item, KUBERNETES, strict=True)
        else:
            schema = json.loads((Path(__file__).parent / "schemas" / custom).read_text())
            # not check_schema: the CRDs' patterns are Go's regular expressions, which Python's re cannot all read
            jsonschema.validators.validator_for(schema)(schema).validate(item)
    if values in ("keda", "cpu"):  # one autoscaler at most: KEDA makes its own HPA
        assert "HorizontalPodAutoscaler" not in {o["kind"] for o in objects}


def test_the_chart_lints_with_each_values_file():
    for args in VALUES.values():
        linted = helm("lint", "--strict", str(CHART), *args)
        assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.parametrize(
    "args, error",
    [
        (["--set", "replicaCount=two"], "/replicaCount': got string, want integer"),
        (["--set", "device=tpu"], "/device"),
        (["--set", "probes.readiness.timeoutSeconds=5"], "/probes/readiness/timeoutSeconds"),
        (["--set", "replicaCount=2"], "/record/databaseUrl/existingSecret"),  # SQLite cannot be shared
        (["--set", "autoscaling.mode=hpa", "--set", "record.databaseUrl.existingSecret=pg"], "ReadWriteMany"),
        (["--set", "models.source=s3"], "/models/s3/bucket"),
        (["--set", "settings.PADIM_REPOSITORY=/x"], "propertyName 'PADIM_REPOSITORY'"),  # the chart's own
        (["--set", "replicaCountt=1"], "additional properties 'replicaCountt' not allowed"),
        (["--set", "workers=0"], "/workers"),
        (["--set", "settings.PADIM_WORKERS=4"], "propertyName 'PADIM_WORKERS'"),  # the chart's value says it
    ],
)
def test_the_values_schema_refuses_a_wrong_value_at_install(args, error):
    done = helm("template", "padim", str(CHART), *args)
    assert done.returncode != 0 and "schema" in done.stderr and error in done.stderr, done.stderr


def test_the_probes_and_port_are_the_services_own(rendered):
    paths = create_app(ServiceSettings(models=[Path("unused.padim")])).openapi()["paths"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    exposed = int(re.search(r"^EXPOSE (\d+)", dockerfile, re.M).group(1))
    image_port = int(re.search(r"PADIM_PORT=(\d+)", dockerfile).group(1))
    for objects in rendered.values():
        deployment = one(objects, "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["ports"][0]["containerPort"] == exposed == image_port == int(env_of(deployment)["PADIM_PORT"])
        probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
        for probe in probes.values():
            assert probe["httpGet"]["path"] in paths and probe["httpGet"]["port"] == "http"
        assert probes["readiness"]["httpGet"]["path"] == "/health/ready" and probes["readiness"]["timeoutSeconds"] > 5
        assert probes["liveness"]["httpGet"]["path"] == "/health/live"
        # SIGKILL comes after the preStop pause and the whole drain
        drain = float(env_of(deployment)["PADIM_DRAIN_TIMEOUT_S"])
        pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pause + drain
        assert set(env_of(deployment)) <= {f"PADIM_{name.upper()}" for name in ServiceSettings.model_fields} | {"HOME"}


def test_the_pods_run_unprivileged_on_a_read_only_root(rendered):
    for objects in rendered.values():
        pod = one(objects, "Deployment")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and context["capabilities"]["drop"] == ["ALL"]
            assert context["allowPrivilegeEscalation"] is False
        mounted = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/home/padim", "/models"} <= mounted


def test_gpu_and_cpu_values_ask_for_what_they_use(rendered):
    gpu = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["runtimeClassName"] == "nvidia"
    assert gpu["tolerations"][0]["key"] == "nvidia.com/gpu"
    cpu = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"].get("limits", {})
    assert "runtimeClassName" not in cpu and env_of(one(rendered["cpu"], "Deployment"))["PADIM_DEVICE"] == "cpu"
    # models from S3: pulled by an init container into the pod; versions change by a rollout, so no admin key
    assert cpu["initContainers"][0]["args"][0] == "s3://padim/models"
    assert "PADIM_ADMIN_KEY" not in env_of(one(rendered["cpu"], "Deployment"))
    # the lines.yaml of the ConfigMap is one padim reads
    lines = yaml.safe_load(one(rendered["cpu"], "ConfigMap")["data"]["lines.yaml"])
    assert LinesFile.model_validate(lines).lines[0].name == "press-3"


def test_the_processes_of_a_pod_share_memory_and_count_its_cores(rendered):
    """API processes and the scoring process meet in /dev/shm, a Memory emptyDir of the chart's size (the runtime's
    own is 64 MB); their number is the service's from the container's CPU limit, unless the values set it."""
    for objects in rendered.values():
        deployment = one(objects, "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
        assert "PADIM_WORKERS" not in env_of(deployment)
    assert (
        one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
        == "16"
    )
    pinned = one(render("--set", "workers=6", "--set", "sharedMemory.sizeLimit=2Gi"), "Deployment")
    assert env_of(pinned)["PADIM_WORKERS"] == "6"
    volumes = pinned["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "shm")["emptyDir"]["sizeLimit"] == "2Gi"


def test_replicas_share_the_record_in_postgresql_and_name_their_journals(rendered):
    env = env_of(one(rendered["gpu"], "Deployment"))
    assert env["PADIM_RECORD_URL"] == {"secretKeyRef": {"name": "padim-record", "key": "url"}}
    assert env["PADIM_REPLICA"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert float(env["PADIM_REPOSITORY_POLL_S"]) > 0
    claims = {
        o["metadata"]["name"]: o["spec"]["accessModes"] for o in rendered["gpu"] if o["kind"] == "PersistentVolumeClaim"
    }
    assert claims == {"padim-models": ["ReadWriteMany"], "padim-record": ["ReadWriteMany"]}


def test_autoscalers_read_the_queue_padim_exports(rendered):
    exported = {family.name for family in Metrics().registry.collect()}
    hpa = one(rendered["gpu"], "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"][0]
    assert metric == adapter["name"]["as"] == "padim_queue_depth" and metric in exported
    assert adapter["seriesQuery"].startswith(metric + "{") and "sum(" in adapter["metricsQuery"]
    keda = one(rendered["keda"], "ScaledObject")["spec"]["triggers"][0]
    assert keda["type"] == "prometheus" and keda["metadata"]["query"].startswith("sum(padim_queue_depth{")
    assert keda["metricType"] == "AverageValue" and float(keda["metadata"]["threshold"]) == 64


def test_the_ingress_allows_the_bodies_the_service_allows(rendered):
    env = env_of(one(rendered["gpu"], "Deployment"))
    score, admin = one(rendered["gpu"], "Ingress", "padim-score"), one(rendered["gpu"], "Ingress", "padim-admin")
    limit = "nginx.ingress.kubernetes.io/proxy-body-size"
    assert score["metadata"]["annotations"][limit] == env["PADIM_MAX_UPLOAD_BYTES"]
    assert admin["metadata"]["annotations"][limit] == env["PADIM_MAX_MODEL_UPLOAD_BYTES"]
    assert admin["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/models"


def test_the_prometheus_rule_is_the_file_promtool_tests(rendered):
    rule = one(rendered["gpu"], "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "padim-alerts.yml").read_text())


def test_the_helm_commands_in_the_docs_render():
    """Each ``helm install`` of docs/kubernetes.md, as ``helm template``: its values pass the schema and render."""
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    commands = [
        shlex.split(line)
        for block in re.findall(r"^```bash\n(.*?)^```", page, re.S | re.M)
        for line in block.splitlines()
    ]
    installs = [words for words in commands if words[:2] == ["helm", "install"]]
    assert len(installs) >= 2
    for words in installs:
        done = subprocess.run(
            [str(helm_path()), "template", *words[2:]], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert done.returncode == 0 and "kind: Deployment" in done.stdout, (words, done.stderr)
