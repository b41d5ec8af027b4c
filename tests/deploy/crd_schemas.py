"""JSON schemas for the kinds under deploy/ that the Kubernetes OpenAPI schemas do not cover: KEDA's
ScaledObject, prometheus-operator's PodMonitor and ServiceMonitor, and kustomize's Kustomization.

Hand-written from the fields each project documents (KEDA's ScaledObject specification and prometheus
scaler page, the prometheus-operator API reference, kustomize's Kustomization reference), not copied
from their CRDs. Every object they define is closed (additionalProperties false), as `kubectl apply`'s
strict field validation treats them; where they embed a Kubernetes type (ObjectMeta, LabelSelector,
the HPA's behavior) the schema points at the strict definition kubernetes-validate bundles. Nested
objects that deploy/ does not use (TLS, auth, relabelling rules) are checked for being objects only."""

from __future__ import annotations

from typing import Any

# kubernetes-validate's strict definitions are registered under this id (see test_manifests.REGISTRY).
K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"
OBJECT_META = {
    "allOf": [{"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}, {"required": ["name"]}]
}
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
COUNT = {"type": "integer", "minimum": 0}
STRINGS = {"type": "array", "items": STRING}
STRING_MAP = {"type": "object", "additionalProperties": STRING}
# A Kubernetes quantity or a number written as a string, e.g. "231" or "0.5".
NUMBER_STRING = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
# Prometheus durations: 15s, 1m30s, 500ms.
DURATION = {
    "type": "string",
    "pattern": r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$",
}
TRUE_OR_FALSE = {"type": "string", "enum": ["true", "false"]}


def closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


def resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"{kind} ({api_version})",
        **closed(
            {
                "apiVersion": {"const": api_version},
                "kind": {"const": kind},
                "metadata": OBJECT_META,
                "spec": spec,
            },
            required=("apiVersion", "kind", "metadata", "spec"),
        ),
    }


# keda.sh/v1alpha1 ScaledObject: the scale target, replica bounds, HPA behaviour and triggers. A
# trigger's metadata is a map of strings (threshold: 231 unquoted is refused by the CRD); for the
# prometheus trigger it is checked key by key against the scaler's documented parameters.
PROMETHEUS_TRIGGER_METADATA = closed(
    {
        "serverAddress": {"type": "string", "pattern": r"^https?://"},
        "query": {"type": "string", "minLength": 1},
        "threshold": NUMBER_STRING,
        "activationThreshold": NUMBER_STRING,
        "namespace": STRING,
        "customHeaders": STRING,
        "queryParameters": STRING,
        "ignoreNullValues": TRUE_OR_FALSE,
        "unsafeSsl": TRUE_OR_FALSE,
        "timeout": {"type": "string", "pattern": r"^[0-9]+$"},
        "authModes": STRING,
    },
    required=("serverAddress", "query", "threshold"),
)
SCALED_OBJECT_TRIGGER = {
    **closed(
        {
            "type": {"type": "string", "minLength": 1},
            "name": STRING,
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "useCachedMetrics": BOOLEAN,
            "metadata": STRING_MAP,
            "authenticationRef": closed(
                {"name": STRING, "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]}},
                required=("name",),
            ),
        },
        required=("type", "metadata"),
    ),
    "if": {"properties": {"type": {"const": "prometheus"}}},
    "then": {"properties": {"metadata": PROMETHEUS_TRIGGER_METADATA}},
}
SCALED_OBJECT = resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    closed(
        {
            "scaleTargetRef": closed(
                {
                    "apiVersion": STRING,
                    "kind": STRING,
                    "name": {"type": "string", "minLength": 1},
                    "envSourceContainerName": STRING,
                },
                required=("name",),
            ),
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": COUNT,
            "initialCooldownPeriod": COUNT,
            "idleReplicaCount": COUNT,
            "minReplicaCount": COUNT,
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": closed(
                {
                    "failureThreshold": COUNT,
                    "replicas": COUNT,
                    "behavior": {
                        "enum": [
                            "static",
                            "currentReplicas",
                            "currentReplicasIfHigher",
                            "currentReplicasIfLower",
                            "scalingModifiers",
                        ]
                    },
                },
                required=("failureThreshold", "replicas"),
            ),
            "advanced": closed(
                {
                    "restoreToOriginalReplicaCount": BOOLEAN,
                    "horizontalPodAutoscalerConfig": closed(
                        {
                            "name": STRING,
                            "behavior": {
                                "$ref": K8S + "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
                            },
                        }
                    ),
                    "scalingModifiers": closed(
                        {
                            "formula": STRING,
                            "target": STRING,
                            "activationTarget": STRING,
                            "metricType": {"enum": ["AverageValue", "Value"]},
                        }
                    ),
                }
            ),
            "triggers": {"type": "array", "minItems": 1, "items": SCALED_OBJECT_TRIGGER},
        },
        required=("scaleTargetRef", "triggers"),
    ),
)

# monitoring.coreos.com/v1: what a scrape endpoint of a PodMonitor and of a ServiceMonitor share.
ENDPOINT_FIELDS: dict[str, Any] = {
    "port": STRING,
    "targetPort": {"type": ["integer", "string"]},
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": STRINGS},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": BOOLEAN,
    "honorTimestamps": BOOLEAN,
    "trackTimestampsStaleness": BOOLEAN,
    "enableHttp2": BOOLEAN,
    "filterRunning": BOOLEAN,
    "followRedirects": BOOLEAN,
    "proxyUrl": STRING,
    "noProxy": STRING,
    "proxyFromEnvironment": BOOLEAN,
    "proxyConnectHeader": OBJECT,
    "relabelings": {"type": "array", "items": OBJECT},
    "metricRelabelings": {"type": "array", "items": OBJECT},
    "tlsConfig": OBJECT,
    "basicAuth": OBJECT,
    "bearerTokenSecret": OBJECT,
    "authorization": OBJECT,
    "oauth2": OBJECT,
}
MONITOR_FIELDS: dict[str, Any] = {
    "selector": {"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"},
    "namespaceSelector": closed({"any": BOOLEAN, "matchNames": STRINGS}),
    "selectorMechanism": {"enum": ["RelabelConfig", "RoleSelector"]},
    "jobLabel": STRING,
    "podTargetLabels": STRINGS,
    "attachMetadata": closed({"node": BOOLEAN}),
    "scrapeClass": STRING,
    "scrapeProtocols": STRINGS,
    "fallbackScrapeProtocol": STRING,
    "scrapeClassicHistograms": BOOLEAN,
    "scrapeNativeHistograms": BOOLEAN,
    "convertClassicHistogramsToNHCB": BOOLEAN,
    "nativeHistogramBucketLimit": COUNT,
    "nativeHistogramMinBucketFactor": {"type": ["integer", "string"]},
    "sampleLimit": COUNT,
    "targetLimit": COUNT,
    "labelLimit": COUNT,
    "labelNameLengthLimit": COUNT,
    "labelValueLengthLimit": COUNT,
    "keepDroppedTargets": COUNT,
    "bodySizeLimit": STRING,
}
POD_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    closed(
        {
            **MONITOR_FIELDS,
            "podMetricsEndpoints": {
                "type": "array",
                "items": closed(
                    {**ENDPOINT_FIELDS, "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535}}
                ),
            },
        },
        required=("selector",),
    ),
)
SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    closed(
        {
            **MONITOR_FIELDS,
            "targetLabels": STRINGS,
            "serviceDiscoveryRole": {"enum": ["Endpoints", "EndpointSlice"]},
            "endpoints": {
                "type": "array",
                "items": closed({**ENDPOINT_FIELDS, "bearerTokenFile": STRING}),
            },
        },
        required=("selector", "endpoints"),
    ),
)

# kustomize.config.k8s.io/v1beta1 Kustomization (a file kustomize reads, never sent to a cluster; it
# has no spec). commonLabels is left out on purpose: it is deprecated for `labels`.
KUSTOMIZATION = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Kustomization (kustomize.config.k8s.io/v1beta1)",
    **closed(
        {
            "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
            "kind": {"const": "Kustomization"},
            "metadata": OBJECT,
            "resources": {"type": "array", "minItems": 1, "items": STRING},
            "components": STRINGS,
            "namespace": STRING,
            "namePrefix": STRING,
            "nameSuffix": STRING,
            "labels": {
                "type": "array",
                "items": closed(
                    {
                        "pairs": STRING_MAP,
                        "includeSelectors": BOOLEAN,
                        "includeTemplates": BOOLEAN,
                        "fields": {"type": "array", "items": OBJECT},
                    },
                    required=("pairs",),
                ),
            },
            "commonAnnotations": STRING_MAP,
            "images": {
                "type": "array",
                "items": closed(
                    {"name": STRING, "newName": STRING, "newTag": STRING, "digest": STRING},
                    required=("name",),
                ),
            },
            "replicas": {
                "type": "array",
                "items": closed({"name": STRING, "count": COUNT}, ("name", "count")),
            },
            "patches": {
                "type": "array",
                "items": closed({"path": STRING, "patch": STRING, "target": OBJECT, "options": OBJECT}),
            },
            "configMapGenerator": {"type": "array", "items": OBJECT},
            "secretGenerator": {"type": "array", "items": OBJECT},
            "generatorOptions": OBJECT,
        },
        required=("apiVersion", "kind", "resources"),
    ),
}

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"): KUSTOMIZATION,
}
