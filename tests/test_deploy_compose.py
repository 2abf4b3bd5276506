"""docker-compose.yml against the Compose Specification schema, and the wiring of its services.

tests/data/compose-spec.json is the Compose Specification JSON schema as shipped in the docker-compose 1.29.2
wheel on PyPI (compose/config/compose_spec.json), vendored because tests run offline.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cli_parsing import parse_cli

ROOT = Path(__file__).resolve().parents[1]
SPECSERVE_SERVICES = ("draft", "target", "coordinator")



@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


@pytest.fixture(scope="module")
def dockerfile_healthcheck() -> str:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", "")
    (command,) = re.findall(r"^HEALTHCHECK .*?CMD (\[.*\])$", text, re.MULTILINE)
    return json.loads(command)[2]


def served(compose: dict[str, Any], name: str) -> Any:
    return parse_cli(compose["services"][name]["command"], f"compose service {name}")


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any], validator: Any) -> None:
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("mutation", ["unknown service key", "bad depends_on condition", "bad healthcheck"])
def test_the_schema_is_not_vacuous(compose: dict[str, Any], validator: Any, mutation: str) -> None:
    broken = copy.deepcopy(compose)
    service = broken["services"]["coordinator"]
    if mutation == "unknown service key":
        service["commandd"] = ["serve"]
    elif mutation == "bad depends_on condition":
        service["depends_on"]["draft"]["condition"] = "service_ready"
    else:
        service["healthcheck"]["retry"] = 3
    assert list(validator.iter_errors(broken))


def test_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*SPECSERVE_SERVICES, "otel-collector", "jaeger", "prometheus"}
    images = {compose["services"][name]["image"] for name in SPECSERVE_SERVICES}
    assert len(images) == 1, "draft, target and coordinator run the same image"
    for name in SPECSERVE_SERVICES:
        service = compose["services"][name]
        assert service["build"]["context"] == "."
        assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
        assert "entrypoint" not in service  # the image's ENTRYPOINT (specserve) is used


@pytest.mark.parametrize("name", SPECSERVE_SERVICES)
def test_commands_parse_and_bind_all_interfaces(compose: dict[str, Any], name: str) -> None:
    args = served(compose, name)
    assert (args.command, args.role) == ("serve", name)
    assert args.host == "0.0.0.0"
    assert args.metrics_port > 0


@pytest.mark.parametrize("name", ["draft", "target"])
def test_model_services_read_the_mounted_models(compose: dict[str, Any], name: str) -> None:
    args = served(compose, name)
    assert args.model == f"/models/{name}"
    (volume,) = compose["services"][name]["volumes"]
    assert volume == {"type": "bind", "source": "./models/tiny", "target": "/models", "read_only": True}
    assert "ports" not in compose["services"][name]  # only the coordinator is published


def test_coordinator_reaches_the_model_services_by_name(compose: dict[str, Any]) -> None:
    args = served(compose, "coordinator")
    for role in ("target", "draft"):
        spec = getattr(args, role)
        host, _, port = spec.removeprefix("dns:///").rpartition(":")
        assert host == role, f"--{role} {spec} does not name the compose service {role}"
        assert int(port) == served(compose, role).port
    service = compose["services"]["coordinator"]
    assert service["ports"] == [f"{args.port}:{args.port}"]
    assert service["depends_on"]["draft"] == {"condition": "service_healthy"}
    assert service["depends_on"]["target"] == {"condition": "service_healthy"}


@pytest.mark.parametrize("name", SPECSERVE_SERVICES)
def test_healthchecks_use_grpc_health(compose: dict[str, Any], dockerfile_healthcheck: str, name: str) -> None:
    service = compose["services"][name]
    assert service["healthcheck"]["test"] == ["CMD", "python", "-c", dockerfile_healthcheck]
    assert service["environment"]["SPECSERVE_HEALTH_PORT"] == str(served(compose, name).port)
    assert service["init"] is True


@pytest.mark.parametrize("name", SPECSERVE_SERVICES)
def test_tracing_goes_to_the_collector(compose: dict[str, Any], name: str) -> None:
    env = compose["services"][name]["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert env["OTEL_SERVICE_NAME"] == f"specserve-{name}"
    assert "otel-collector" in compose["services"][name]["depends_on"]


def test_collector_pipeline_exports_to_jaeger(compose: dict[str, Any]) -> None:
    collector = compose["services"]["otel-collector"]
    assert collector["image"].startswith("otel/opentelemetry-collector-contrib:")
    (mount,) = collector["volumes"]
    assert collector["command"] == [f"--config={mount['target']}"]
    config = yaml.safe_load((ROOT / mount["source"]).read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        for component in pipeline[section]:
            assert component in config[section], f"{section} {component} is not defined"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]
    (exporter,) = pipeline["exporters"]
    assert exporter.split("/")[0] == "otlp"
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in jaeger["ports"]


def test_prometheus_scrapes_every_metrics_port(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    (mount,) = prometheus["volumes"]
    assert f"--config.file={mount['target']}" in prometheus["command"]
    config = yaml.safe_load((ROOT / mount["source"]).read_text())
    targets = {target for job in config["scrape_configs"] for static in job["static_configs"]
               for target in static["targets"]}
    for name in SPECSERVE_SERVICES:
        assert f"{name}:{served(compose, name).metrics_port}" in targets
    assert "9090:9090" in prometheus["ports"]
