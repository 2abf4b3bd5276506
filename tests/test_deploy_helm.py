"""The Helm chart (helm/specserve), rendered by Helm's own engine (helm-python-sdk, libhelm_c) offline.

Every rendered manifest is validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail), every container's args are parsed by the specserve CLI, and the schema rejects bad values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cli_parsing import parse_cli

from specserve.serve import DEFAULT_PREFIX_CACHE_MB

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "specserve"
GPU_VALUES = CHART / "ci" / "gpu-tls-autoscaling-values.yaml"
RELEASE, NAMESPACE = "rel", "serving"
KUBE_VERSIONS = ["1.33.0", kubernetes_validate.latest_version()]
CRD_GROUPS = {"monitoring.coreos.com"}  # kinds kubernetes-validate has no schema for (Prometheus Operator)


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All objects the chart renders for these values (Helm validates them against values.schema.json)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def gpu_values() -> dict[str, Any]:
    return yaml.safe_load(GPU_VALUES.read_text())


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, got {[o['metadata']['name'] for o in find(objects, kind)]}"
    return found[0]


def deployment(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return one(objects, "Deployment", f"{RELEASE}-specserve-{component}")


def container(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (main,) = deployment(objects, component)["spec"]["template"]["spec"]["containers"]
    return main


def expanded_args(objects: list[dict[str, Any]], main: dict[str, Any]) -> list[str]:
    """The container's args after the kubelet's $(VAR) expansion (env values and ConfigMap keys)."""
    env: dict[str, str] = {}
    for var in main.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            data = one(objects, "ConfigMap", ref["name"])["data"]
            assert ref["key"] in data, f"ConfigMap {ref['name']} has no key {ref['key']}"
            env[var["name"]] = data[ref["key"]]

    def expand(arg: str) -> str:
        def substitute(match: re.Match[str]) -> str:
            assert match.group(1) in env, f"$({match.group(1)}) in {arg!r} is not defined in the container env"
            return env[match.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, arg)

    return [expand(arg) for arg in main["args"]]



@pytest.fixture(scope="module")
def default_objects() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def gpu_objects() -> list[dict[str, Any]]:
    return render(gpu_values())


# ---------------------------------------------------------------------------------------------------- lint


@pytest.mark.parametrize("values_file", [None, GPU_VALUES], ids=["default", "gpu-tls-autoscaling"])
def test_lint_is_clean(values_file: Path | None) -> None:
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert problems == []


def test_chart_metadata() -> None:
    with helm.Chart.load(CHART) as chart:
        assert chart.metadata["apiVersion"] == "v2"
        assert chart.name == "specserve"
        assert chart.schema is not None and chart.schema["type"] == "object"


# ------------------------------------------------------------------------------------- Kubernetes schemas


@pytest.mark.parametrize("values", [None, "gpu", "dns", "hostPath", "image", "no-draft"])
def test_every_manifest_validates_against_kubernetes(values: str | None) -> None:
    overrides: dict[str, Any] | None = {
        None: None,
        "gpu": gpu_values(),
        "dns": {"discovery": {"mode": "dns"}},
        "hostPath": {"models": {"source": "hostPath"}},
        "image": {"models": {"source": "image", "image": {"repository": "registry.example.com/models"}}},
        "no-draft": {"draft": {"enabled": False}},
    }[values]
    objects = render(overrides)
    assert objects
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        for version in KUBE_VERSIONS:
            if group in CRD_GROUPS:
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, version, strict=True)
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{path}: {error.message}")


# ------------------------------------------------------------------------------------------ default values


def test_default_objects(default_objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted(["ConfigMap", "Deployment", "Deployment", "Deployment", "PodDisruptionBudget",
                            "PodDisruptionBudget", "PodDisruptionBudget", "Role", "RoleBinding", "Service",
                            "Service", "Service", "ServiceAccount"])
    for obj in default_objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


def test_model_services_are_headless_and_coordinator_is_cluster_ip(default_objects: list[dict[str, Any]]) -> None:
    for component, port in [("draft", 50051), ("target", 50052)]:
        service = one(default_objects, "Service", f"{RELEASE}-specserve-{component}")
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["ports"][0] == {"name": "grpc", "port": port, "targetPort": "grpc",
                                               "protocol": "TCP", "appProtocol": "grpc"}
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
    coordinator = one(default_objects, "Service", f"{RELEASE}-specserve-coordinator")
    assert coordinator["spec"]["type"] == "ClusterIP"
    assert "clusterIP" not in coordinator["spec"]
    for service in find(default_objects, "Service"):
        labels = service["spec"]["selector"]
        pods = deployment(default_objects, labels["app.kubernetes.io/component"])["spec"]["template"]
        assert labels.items() <= pods["metadata"]["labels"].items(), "Service selects no pod of its Deployment"


@pytest.mark.parametrize("component", ["draft", "target", "coordinator"])
def test_probes_are_native_grpc(default_objects: list[dict[str, Any]], component: str) -> None:
    main = container(default_objects, component)
    (grpc_port,) = [p["containerPort"] for p in main["ports"] if p["name"] == "grpc"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": grpc_port}, probe
        assert "exec" not in main[probe]


@pytest.mark.parametrize("component", ["draft", "target", "coordinator"])
def test_pods_run_as_non_root(default_objects: list[dict[str, Any]], component: str) -> None:
    pod = deployment(default_objects, component)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    main = pod["containers"][0]
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"]


@pytest.mark.parametrize("component", ["draft", "target"])
def test_model_args_parse(default_objects: list[dict[str, Any]], component: str) -> None:
    main = container(default_objects, component)
    args = parse_cli(expanded_args(default_objects, main), f"the {component} Deployment")
    assert (args.command, args.role) == ("serve", component)
    assert args.host == "0.0.0.0"
    assert args.model == f"/models/{component}"
    assert args.metrics_port == 9464
    assert (args.device, args.dtype, args.attention, args.attention_backend, args.cuda_graphs) == (
        "cpu", "auto", "bifurcated", "torch", "auto")
    assert (args.kv_budget_mb, args.prefix_cache_mb) == (0, DEFAULT_PREFIX_CACHE_MB)  # the chart keeps serve's default
    if component == "draft":
        assert (args.prompt_lookup, args.confidence_floor) == ((2, 3), 0.3)
    mount = next(m for m in main["volumeMounts"] if m["name"] == "models")
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    volume = next(v for v in deployment(default_objects, component)["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "specserve-models", "readOnly": True}


def test_coordinator_discovers_replicas_through_endpointslices(default_objects: list[dict[str, Any]]) -> None:
    main = container(default_objects, "coordinator")
    args = parse_cli(expanded_args(default_objects, main), "the coordinator Deployment")
    assert args.role == "coordinator"
    assert args.host == "0.0.0.0"
    assert args.target == f"k8s:///{NAMESPACE}/{RELEASE}-specserve-target:50052"
    assert args.draft == f"k8s:///{NAMESPACE}/{RELEASE}-specserve-draft:50051"
    for spec, component in [(args.target, "target"), (args.draft, "draft")]:
        service_name, port = spec.rpartition("/")[2].split(":")
        service = one(default_objects, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None"
        assert int(port) in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
    # the settings come from the ConfigMap
    assert (args.max_n, args.max_batch_sequences, args.max_queue) == (64, 64, 256)
    assert (args.draft_len, args.max_draft_len, args.fixed_draft_len) == (4, 8, False)
    assert (args.speculation_gate, args.speculation_probe_every) == ("on", 16)
    assert args.prompt_lookup == (2, 3)
    assert args.max_batch_tokens == 0 and args.prefix_affinity_slack == 16
    assert args.auth_token_file is None and args.tls_cert is None
    discovery = pytest.importorskip("coordinator.discovery")
    assert type(discovery.parse_endpoint_spec(args.target)).__name__ == "KubernetesDiscovery"


def test_rbac_allows_reading_endpointslices(default_objects: list[dict[str, Any]]) -> None:
    (role,) = find(default_objects, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    (binding,) = find(default_objects, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    pod = deployment(default_objects, "coordinator")["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert find(default_objects, "ServiceAccount", pod["serviceAccountName"])
    assert pod["automountServiceAccountToken"] is True
    for component in ("draft", "target"):  # the model pods never talk to the API server
        assert deployment(default_objects, component)["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is False


def test_pod_disruption_budgets(default_objects: list[dict[str, Any]]) -> None:
    budgets = find(default_objects, "PodDisruptionBudget")
    assert len(budgets) == 3
    for budget in budgets:
        component = budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert budget["spec"]["selector"]["matchLabels"] == \
            deployment(default_objects, component)["spec"]["selector"]["matchLabels"]
        assert budget["spec"]["maxUnavailable"] == 1


def test_otel_environment(default_objects: list[dict[str, Any]]) -> None:
    env = {v["name"]: v.get("value") for v in container(default_objects, "draft")["env"]}
    assert env["OTEL_SERVICE_NAME"] == "specserve-draft"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env  # no endpoint configured by default
    endpoint = "http://collector.observability:4317"
    objects = render({"otel": {"endpoint": endpoint}})
    for component in ("draft", "target", "coordinator"):
        env = {v["name"]: v.get("value") for v in container(objects, component)["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        assert env["OTEL_SERVICE_NAME"] == f"specserve-{component}"


# -------------------------------------------------------------------------------------- other value sets


def test_dns_discovery_needs_no_rbac() -> None:
    objects = render({"discovery": {"mode": "dns"}})
    args = parse_cli(expanded_args(objects, container(objects, "coordinator")), "the coordinator (dns)")
    assert args.target == f"dns:///{RELEASE}-specserve-target.{NAMESPACE}.svc.cluster.local:50052"
    assert args.draft == f"dns:///{RELEASE}-specserve-draft.{NAMESPACE}.svc.cluster.local:50051"
    assert not find(objects, "Role") and not find(objects, "RoleBinding")
    assert deployment(objects, "coordinator")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_without_draft_the_coordinator_decodes_on_the_target_alone() -> None:
    objects = render({"draft": {"enabled": False}})
    assert not find(objects, "Deployment", f"{RELEASE}-specserve-draft")
    assert not find(objects, "Service", f"{RELEASE}-specserve-draft")
    args = parse_cli(expanded_args(objects, container(objects, "coordinator")), "the coordinator (no draft)")
    assert args.draft is None


def test_models_from_host_path() -> None:
    objects = render({"models": {"source": "hostPath", "hostPath": {"path": "/data/llm"}}})
    pod = deployment(objects, "target")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert volume["hostPath"] == {"path": "/data/llm", "type": "Directory"}


def test_models_copied_from_an_image() -> None:
    objects = render({"models": {"source": "image", "image": {"repository": "registry.example.com/models",
                                                              "tag": "v3", "path": "/checkpoints"}}})
    pod = deployment(objects, "target")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert "emptyDir" in volume
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example.com/models:v3"
    assert "/checkpoints/." in init["command"][-1]
    assert init["volumeMounts"][0]["name"] == "models"
    assert "initContainers" not in deployment(objects, "coordinator")["spec"]["template"]["spec"]


# ------------------------------------------------------------------------------- GPU + TLS + autoscaling


@pytest.mark.parametrize("component", ["draft", "target"])
def test_gpu_values(gpu_objects: list[dict[str, Any]], component: str) -> None:
    pod = deployment(gpu_objects, component)["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "memory" in main["resources"]["limits"]  # the user's limits are kept
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    args = parse_cli(expanded_args(gpu_objects, main), f"the {component} Deployment (GPU values)")
    assert (args.device, args.dtype, args.attention_backend) == ("cuda", "bfloat16", "triton")
    assert args.prefix_cache_mb == {"draft": 2048, "target": 16384}[component]
    assert args.model.startswith("/models/llama-")
    assert deployment(gpu_objects, component)["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in container(gpu_objects, "coordinator")["resources"].get("limits", {})


@pytest.mark.parametrize("component", ["draft", "target", "coordinator"])
def test_tls_values(gpu_objects: list[dict[str, Any]], component: str) -> None:
    pod = deployment(gpu_objects, component)["spec"]["template"]["spec"]
    main = pod["containers"][0]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "specserve-tls"
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is True
    args = parse_cli(expanded_args(gpu_objects, main), f"the {component} Deployment (TLS values)")
    directory = mount["mountPath"]
    assert (args.tls_cert, args.tls_key, args.tls_ca) == (
        f"{directory}/tls.crt", f"{directory}/tls.key", f"{directory}/ca.crt")
    # the kubelet's gRPC probe cannot do TLS: the probes run the image's health check over mutual TLS
    env = {v["name"]: v.get("value") for v in main["env"]}
    assert env["SPECSERVE_TLS_CERT"] == args.tls_cert and env["SPECSERVE_TLS_CA"] == args.tls_ca
    assert env["SPECSERVE_HEALTH_PORT"] == str(args.port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = main[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"] and "grpc_health" in command[2]
        compile(command[2], probe, "exec")


def test_coordinator_auth_autoscaling_and_service_monitor(gpu_objects: list[dict[str, Any]]) -> None:
    coordinator = deployment(gpu_objects, "coordinator")
    assert "replicas" not in coordinator["spec"]  # the HPA owns the replica count
    main = coordinator["spec"]["template"]["spec"]["containers"][0]
    args = parse_cli(expanded_args(gpu_objects, main), "the coordinator Deployment (GPU values)")
    assert args.auth_token_file == "/etc/specserve/auth/token"
    (volume,) = [v for v in coordinator["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert volume["secret"]["secretName"] == "specserve-api-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert (args.max_n, args.max_batch_tokens, args.connect_timeout) == (32, 65536, 600.0)
    for component in ("draft", "target"):  # only the coordinator holds the token
        assert "auth" not in [v["name"] for v in deployment(gpu_objects, component)["spec"]["template"]["spec"][
            "volumes"]]

    (hpa,) = find(gpu_objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": coordinator["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)

    (monitor,) = find(gpu_objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    selected = [s for s in find(gpu_objects, "Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 3
    for service in selected:
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]

    budget = one(gpu_objects, "PodDisruptionBudget", coordinator["metadata"]["name"])
    assert budget["spec"] == {"minAvailable": 1, "selector": coordinator["spec"]["selector"]}


def test_probe_code_is_the_image_healthcheck(gpu_objects: list[dict[str, Any]]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    code = container(gpu_objects, "target")["readinessProbe"]["exec"]["command"][2]
    assert f'"{code}"' in dockerfile.replace("\\\n", "")


# ---------------------------------------------------------------------------------------- values schema


@pytest.mark.parametrize(("values", "messages"), [
    ({"target": {"replicas": -1}}, ["/target/replicas", "minimum: got -1, want 0"]),
    ({"draft": {"attention": "foo"}}, ["/draft/attention", "'bifurcated', 'standard'"]),
    ({"target": {"dtype": "int8"}}, ["/target/dtype", "'auto', 'float32', 'bfloat16', 'float16'"]),
    ({"draft": {"attentionBackend": "cuda"}}, ["/draft/attentionBackend", "'torch', 'triton'"]),
    ({"coordinator": {"port": 0}}, ["/coordinator/port", "minimum: got 0, want 1"]),
    ({"target": {"port": 70000}}, ["/target/port", "maximum: got 70,000, want 65,535"]),
    ({"coordinator": {"replicas": "two"}}, ["/coordinator/replicas", "got string, want integer"]),
    ({"models": {"source": "s3"}}, ["/models/source", "'pvc', 'hostPath', 'image'"]),
    ({"discovery": {"mode": "consul"}}, ["/discovery/mode", "'k8s', 'dns'"]),
    ({"tls": {"enabled": True}}, ["/tls/secretName", "minLength"]),
    ({"auth": {"enabled": True}}, ["/auth/existingSecret", "minLength"]),
    ({"target": {"gpus": 1}}, ["/target", "additional properties 'gpus' not allowed"]),
    ({"coordinator": {"settings": {"speculationProbeEvery": 1}}}, ["speculationProbeEvery", "minimum: got 1, want 2"]),
    ({"draft": {"promptLookup": "2-3"}}, ["/draft/promptLookup", "does not match pattern"]),
    ({"draft": {"confidenceFloor": 1}}, ["/draft/confidenceFloor"]),
    ({"target": {"promptLookup": "2,3"}}, ["/target", "additional properties 'promptLookup' not allowed"]),
])
def test_schema_rejects_bad_values(values: dict[str, Any], messages: list[str]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as rejected:
            chart.validate_schema(values)
        for message in messages:
            assert message in str(rejected.value)
        with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications of the schema"):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_schema_accepts_the_shipped_values() -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(None)
        chart.validate_schema(gpu_values())
