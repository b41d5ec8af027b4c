"""Every YAML file under deploy/ against a schema, with no cluster: the core kinds against the Kubernetes
OpenAPI schemas that kubernetes-validate bundles, in strict mode (an unknown field fails, as it does
under `kubectl apply`); KEDA's ScaledObject, prometheus-operator's PodMonitor and ServiceMonitor, and
kustomize's Kustomization against the schemas in crd_schemas.py, hand-written from the fields those
projects document. Then what no schema sees: the files the kustomizations apply, the names and labels
that tie the resources together, the command lines the tokenmill CLI must accept, and the autoscaling
threshold against what `tokenmill plan` computes for the model and GPU."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.deploy.crd_schemas import SCHEMAS
from tokenmill.entrypoints.cli import build_parser, main
from tokenmill.plan.catalogue import resolve_model
from tokenmill.plan.gpus import resolve_gpu

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.31.0"  # the oldest release KEDA 2.16+ and current prometheus-operator support
MANIFESTS = sorted(path for path in DEPLOY.rglob("*") if path.suffix in (".yaml", ".yml"))
DEFINITIONS = json.loads(
    importlib.resources.files("kubernetes_validate")
    .joinpath(f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json")
    .read_text()
)
REGISTRY: Registry = Registry().with_resource(DEFINITIONS["$id"], Resource.from_contents(DEFINITIONS))
DELETE = object()
ENGINE = "spec.template.spec.containers.0"
SCALED_OBJECT = "autoscaling/engine-scaledobject.yaml"
POD_MONITOR = "autoscaling/engine-podmonitor.yaml"
SERVICE_MONITOR = "autoscaling/router-servicemonitor.yaml"


def documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document is not None]


def schema_errors(document: dict[str, Any]) -> list[str]:
    """Why the document fails its kind's schema; empty when it passes."""
    key = (document.get("apiVersion"), document.get("kind"))
    if key in SCHEMAS:
        validator = Draft202012Validator(SCHEMAS[key], registry=REGISTRY)
        return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(document)]
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"$.{'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def relative(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


RESOURCES = [document for path in MANIFESTS for document in documents(path)]


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [r for r in RESOURCES if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} under deploy/, found {len(found)}"
    return found[0]


def container(deployment_name: str) -> dict[str, Any]:
    (only,) = the("Deployment", deployment_name)["spec"]["template"]["spec"]["containers"]
    return only


def command_line(deployment_name: str) -> list[str]:
    """The container's command and args, less the leading `tokenmill`."""
    spec = container(deployment_name)
    assert spec["command"][0] == "tokenmill"
    return [*spec["command"][1:], *spec.get("args", [])]


@pytest.mark.parametrize("path", MANIFESTS, ids=relative)
def test_every_manifest_validates(path):
    assert documents(path), f"{relative(path)} holds no document"
    for document in documents(path):
        assert schema_errors(document) == []


def test_deploy_holds_the_whole_stack():
    # What the glob above found; a file added under deploy/ is validated before it is listed here.
    kinds = sorted(r["kind"] for r in RESOURCES)
    assert kinds == [
        "Deployment", "Deployment", "Kustomization", "Kustomization", "Namespace", "PersistentVolumeClaim",
        "PodMonitor", "ScaledObject", "Service", "Service", "ServiceMonitor",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("file", "path", "value", "message"),
    [
        ("engine-deployment.yaml", f"{ENGINE}.resource", {}, "Additional properties"),
        ("engine-deployment.yaml", f"{ENGINE}.ports.0.containerPort", "8000", "not of type"),
        ("engine-service.yaml", "spec.ports.0.port", "http", "not of type"),
        ("router-deployment.yaml", "spec.selector", DELETE, "'selector' is a required property"),
        ("models-pvc.yaml", "spec.accessModes", "ReadWriteMany", "not of type"),
        ("namespace.yaml", "kind", "Namespaces", "Couldn't find schema for kind Namespaces"),
        (SCALED_OBJECT, "spec.triggers.0.metadata.threshold", 231, "not of type"),
        (SCALED_OBJECT, "spec.triggers.0.metadata.treshold", "231", "Additional"),
        (SCALED_OBJECT, "spec.triggers.0.metricType", "Average", "is not one of"),
        (SCALED_OBJECT, "spec.scaleTargetRef", DELETE, "'scaleTargetRef' is a required"),
        (
            SCALED_OBJECT,
            "spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.stabilizationWindowSeconds",
            "600",
            "not of type",
        ),
        (POD_MONITOR, "spec.podMetricsEndpoints.0.interval", "15 seconds", "does not match"),
        (POD_MONITOR, "spec.selector.matchLabel", {}, "Additional properties"),
        (SERVICE_MONITOR, "spec.endpoints", DELETE, "'endpoints' is a required"),
        (SERVICE_MONITOR, "metadata.labels.team", 7, "not of type"),
        ("kustomization.yaml", "resource", ["namespace.yaml"], "Additional properties"),
        ("kustomization.yaml", "images.0.newTag", 0.1, "not of type"),
    ],
)
def test_a_broken_manifest_fails(file, path, value, message):
    document = copy.deepcopy(documents(DEPLOY / file)[0])
    *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
    node = document
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    errors = schema_errors(document)
    assert errors and message in " ".join(errors)


def test_every_manifest_is_applied_by_a_kustomization():
    applied: list[Path] = []
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        for entry in documents(kustomization)[0]["resources"]:
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{relative(kustomization)} lists {entry}, which does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), (
                    f"{entry} is a directory with no kustomization"
                )
            else:
                applied.append(target)
    resources = [path for path in MANIFESTS if path.name != "kustomization.yaml"]
    assert sorted(applied) == resources


def test_every_resource_lives_in_the_namespace():
    namespace = the("Namespace")["metadata"]["name"]
    for resource in RESOURCES:
        if resource["kind"] not in ("Namespace", "Kustomization"):
            assert resource["metadata"].get("namespace") == namespace, resource["metadata"]["name"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_services_and_monitors_select_what_they_name():
    engine_pods = the("Deployment", "tokenmill-engine")["spec"]["template"]["metadata"]["labels"]
    router_pods = the("Deployment", "tokenmill-router")["spec"]["template"]["metadata"]["labels"]
    headless = the("Service", "tokenmill-engine-headless")["spec"]
    router_service = the("Service", "tokenmill-router")
    assert headless["clusterIP"] == "None" and selects(headless["selector"], engine_pods)
    assert not selects(headless["selector"], router_pods)
    assert selects(router_service["spec"]["selector"], router_pods)
    pod_monitor = the("PodMonitor", "tokenmill-engine")["spec"]
    assert selects(pod_monitor["selector"]["matchLabels"], engine_pods)
    assert not selects(pod_monitor["selector"]["matchLabels"], router_pods)
    service_monitor = the("ServiceMonitor", "tokenmill-router")["spec"]
    assert selects(service_monitor["selector"]["matchLabels"], router_service["metadata"]["labels"])
    # Every port they scrape or forward to is a named container port.
    assert {p["name"] for p in container("tokenmill-engine")["ports"]} >= {
        *(p["targetPort"] for p in headless["ports"]),
        *(e["port"] for e in pod_monitor["podMetricsEndpoints"]),
    }
    assert {p["name"] for p in container("tokenmill-router")["ports"]} >= {
        p["targetPort"] for p in router_service["spec"]["ports"]
    }
    assert {e["port"] for e in service_monitor["endpoints"]} <= {
        p["name"] for p in router_service["spec"]["ports"]
    }


def test_the_cli_accepts_the_command_lines():
    parser = build_parser()
    engine = parser.parse_args(command_line("tokenmill-engine"))
    router = parser.parse_args(command_line("tokenmill-router"))
    headless = the("Service", "tokenmill-engine-headless")
    namespace = headless["metadata"]["namespace"]
    assert (engine.host, engine.port) == ("0.0.0.0", headless["spec"]["ports"][0]["port"])
    assert router.discover == [f"tokenmill-engine-headless.{namespace}.svc.cluster.local:{engine.port}"]
    assert (router.host, router.policy, router.model) == ("0.0.0.0", "cache_aware", engine.model)
    assert router.port == container("tokenmill-router")["ports"][0]["containerPort"]


def test_the_grace_period_covers_the_drain():
    engine = the("Deployment", "tokenmill-engine")["spec"]["template"]["spec"]
    args = build_parser().parse_args(command_line("tokenmill-engine"))
    pre_stop = container("tokenmill-engine")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The server is gone about 2 s after the drain timeout.
    assert engine["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + args.shutdown_timeout + 2


def test_the_scaled_object_scales_the_engine_on_its_podmonitor_series():
    scaled = the("ScaledObject", "tokenmill-engine")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == the("Deployment", "tokenmill-engine")["metadata"]["name"]
    assert "replicas" not in the("Deployment", "tokenmill-engine")["spec"]  # the autoscaler owns it
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    monitor = the("PodMonitor")["metadata"]
    job = f'job="{monitor["namespace"]}/{monitor["name"]}"'  # the job label prometheus-operator sets
    query = " ".join(trigger["metadata"]["query"].split())
    assert query == (
        f"sum(tokenmill:num_requests_running{{{job}}} + tokenmill:num_requests_waiting{{{job}}})"
    )


def test_the_threshold_is_the_planners_target_concurrency(capsys):
    """The comment above the ScaledObject names the `tokenmill plan` command; its figure and the engine
    it describes must be the manifest's."""
    text = (DEPLOY / SCALED_OBJECT).read_text()
    (command,) = re.findall(r"^#\s+(tokenmill plan .+)$", text, flags=re.MULTILINE)
    argv = shlex.split(command)[1:]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (trigger,) = the("ScaledObject", "tokenmill-engine")["spec"]["triggers"]
    assert int(trigger["metadata"]["threshold"]) == plan["target_concurrency"]
    assert f"{plan['target_concurrency']}," in text  # the comment quotes the figure too

    plan_args = build_parser().parse_args(argv)
    engine_args = build_parser().parse_args(command_line("tokenmill-engine"))
    engine_pod = the("Deployment", "tokenmill-engine")["spec"]["template"]["spec"]
    (served_name,) = engine_args.served_model_name
    assert resolve_model(served_name).name == plan["model"]
    assert resolve_gpu(engine_pod["nodeSelector"]["nvidia.com/gpu.product"]).name == plan["gpu"]
    assert container("tokenmill-engine")["resources"]["limits"]["nvidia.com/gpu"] == str(plan["tp"])
    assert engine_args.max_num_seqs == plan_args.max_num_seqs
    assert engine_args.gpu_memory_utilization == plan_args.gpu_memory_utilization
    assert engine_args.max_model_len >= plan["context_len"]
