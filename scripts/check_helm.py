"""Checks the Helm chart helm/sluice without a cluster or a helm binary.

Run through scripts/check-helm.sh, which provides the pinned tools:
helm-python-sdk (Helm's Go SDK: lint, values schema, template engine) and
kubernetes-validate (the Kubernetes API's JSON schemas).

For the chart's default values and for every file in its ci/ directory:
  1. lints the chart (strict: warnings fail; the values schema is enforced),
  2. renders it with Helm's engine (which also runs the chart's own checks),
  3. validates every manifest against the Kubernetes schemas (strict: unknown
     fields fail); custom resources (ServiceMonitor, KEDA) have no schema
     there, so only their apiVersion, kind, metadata and a few references
     are checked,
  4. checks how the parts fit: the ConfigMap's sluice.toml parses and has
     [kafka], [llm] and [http] listen but no advertised_url, which each pod
     gets from SLUICE_HTTP__ADVERTISED_URL built from its own name; ports,
     probes, volumes, Services, selectors and the drain budget agree,
  5. checks the task gateway (gateway.enabled): its Deployment runs
     `gateway --config` on the same ConfigMap and Secret, listens, advertises
     its pod IP and keeps its state on an emptyDir as the chart sets them; its
     Service, PodDisruptionBudget, NetworkPolicy, Ingress and ServiceMonitor
     select its pods and no others, the workers' objects do not select them,
     and sluice.toml's [gateway] is gateway.config. Disabled: none of it.
The same for configToml (the default config given as a string), for
dashboard.enabled (the dashboard ConfigMap must hold files/dashboard.json as
valid JSON), for metrics.prometheusRule.enabled (the alert rules pass
`promtool check rules` and their unit tests, tests/alerts/rules_test.yaml,
under `promtool test rules`; SLUICE_PROMTOOL names the binary), and for a few variants of the values (persistence off,
chart-made Secret, KEDA without a topic list, ...). Then it checks that the
chart refuses values it must refuse, with a message naming the culprit.

Prints one line per values file (and one for all variants, one for the
refusals); any problem exits non-zero with the reasons.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from kubernetes_validate import utils as kv

KUBE_VERSION = "1.37.0"
RELEASE = "sluice"
NAMESPACE = "ai"

# Custom resources the chart may render: apiVersion per kind. Their schemas
# come with their operators, not with Kubernetes.
CUSTOM_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "TriggerAuthentication": "keda.sh/v1alpha1",
}

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# Values the chart must refuse, and a fragment of the reason it must give.
MUST_REFUSE = [
    ("an unknown [tasks] key", {"config": {"tasks": {"max_byte": 10}}}, "max_byte"),
    ("a non-string librdkafka property", {"config": {"kafka": {"client": {"linger.ms": 5}}}}, "linger.ms"),
    ("a string replica count", {"replicaCount": "three"}, "replicaCount"),
    ("[http] set in config", {"config": {"http": {"listen": "0.0.0.0:9090"}}}, "http"),
    (
        "a model without a price",
        {"config": {"llm": {"models": [{"name": "other", "provider": "openai"}]}}},
        "prices",
    ),
    (
        "configToml with advertised_url",
        {"configToml": '[kafka]\nbootstrap_servers = "k:9092"\n[llm]\n[http]\nadvertised_url = "http://x"\n'},
        "advertised_url",
    ),
    ("a grace period shorter than the drain", {"terminationGracePeriodSeconds": 10}, "drain"),
    ("[gateway] listen set in gateway.config", {"gateway": {"config": {"listen": "0.0.0.0:9090"}}}, "listen"),
    ("[gateway] set in config", {"config": {"gateway": {"max_batch": 10}}}, "gateway"),
    ("a zero gateway.config.max_batch", {"gateway": {"enabled": True, "config": {"max_batch": 0}}}, "max_batch"),
    (
        "zero streams per HTTP/2 connection",
        {
            "config": {
                "llm": {
                    "providers": [
                        {"name": "openai", "base_url": "https://api.openai.com/v1", "http2": True, "http2_max_streams": 0}
                    ]
                }
            }
        },
        "http2_max_streams",
    ),
    (
        "a drain longer than the rebalance timeout",
        {"config": {"kafka": {"max_poll_interval_ms": 60000}}},
        "max_poll_interval_ms",
    ),
    (
        "configToml with group_instance_id",
        {"configToml": '[kafka]\nbootstrap_servers = "k:9092"\ngroup_instance_id = "a"\n[llm]\n'},
        "group_instance_id",
    ),
    (
        "KEDA SASL without credentials",
        {"autoscaling": {"enabled": True, "kafka": {"sasl": "plaintext"}}},
        "kafkaSasl",
    ),
]


# Other paths through the templates, each checked like a values file (one
# summary line for all).
VARIANTS = [
    ("no persistence", {"persistence": {"enabled": False}}),
    ("storageClass -", {"persistence": {"storageClass": "-"}}),
    ("chart-made Secret with SASL", {
        "secrets": {"data": {"openai-api-key": "sk-x", "kafka-sasl-username": "u", "kafka-sasl-password": "p"},
                    "kafkaSasl": {"enabled": True}},
    }),
    ("existing ServiceAccount, hard anti-affinity, no probes or preStop", {
        "serviceAccount": {"create": False, "name": "sluice-runner"},
        "podAntiAffinity": "hard",
        "livenessProbe": {"enabled": False}, "readinessProbe": {"enabled": False},
        "startupProbe": {"enabled": False}, "preStopSleepSeconds": 0,
    }),
    ("custom affinity, extras, long name", {
        "fullnameOverride": "a-very-long-release-name-for-sluice-in-the-staging-cluster-x",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ai"]}]}]}}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "ai", "operator": "Exists", "effect": "NoSchedule"}],
        "extraEnv": [{"name": "SLUICE_APP__PROCESSING_THREADS", "value": "4"}],
        "extraVolumes": [{"name": "ca", "configMap": {"name": "kafka-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/kafka-ca", "readOnly": True}],
        "image": {"digest": "sha256:" + "ab" * 32},
        "terminationGracePeriodSeconds": 120,
        "podDisruptionBudget": {"minAvailable": "50%"},
    }),
    ("KEDA on the whole consumer group, other port", {
        "autoscaling": {"enabled": True, "minReplicas": 0},
        "http": {"port": 9090}, "service": {"port": 80},
    }),
    ("gateway alone: no Ingress, PDB or NetworkPolicy, chart-made Secret, no anti-affinity", {
        "gateway": {"enabled": True, "replicaCount": 1, "podDisruptionBudget": {"enabled": False},
                    "config": {"max_batch": 10, "status_ttl_hours": None}},
        "networkPolicy": {"enabled": False},
        "podAntiAffinity": "none",
        "secrets": {"data": {"openai-api-key": "sk-x", "api-tokens": "t" * 16 + " admin"}},
        "http": {"tokensFile": "/etc/sluice/secrets/api-tokens"},
    }),
    ("gateway behind a bare Ingress, ServiceMonitor, other port, long name", {
        "fullnameOverride": "a-very-long-release-name-for-sluice-in-the-staging-cluster-x",
        "gateway": {"enabled": True, "port": 9091, "ingress": {"enabled": True},
                    "podDisruptionBudget": {"minAvailable": "50%"}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }),
    ("configToml on another port", {
        "http": {"port": 9090},
        "configToml": '[app]\nid = "x"\n[kafka]\nbootstrap_servers = "k:9092"\n'
        '[[llm.providers]]\nname = "p"\nbase_url = "http://vllm:8000/v1"\n'
        '[[llm.models]]\nname = "m"\nprovider = "p"\n[prices.m]\ninput = 1\n[http]\nlisten = "0.0.0.0:9090"\n',
    }),
]


class CheckError(Exception):
    """A problem with the chart, for the summary."""


def lint(chart_dir: Path, values: dict[str, Any] | None) -> None:
    report = helm.lint(
        chart_dir,
        values,
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    # Severity: 1 info, 2 warning, 3 error. Infos ("icon is recommended") pass.
    # A schema failure is reported several times (values.yaml, templates/,
    # errors): each distinct line once.
    found = [(m.get("path", ""), m.get("error", "")) for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    found += [("", e) for e in report.get("errors", []) if e]
    lines: list[str] = []
    for path, error in found:
        for line in error.splitlines():
            line = line.strip()
            if not line or line.startswith("values don't meet the specifications") or line.endswith(":") and " " not in line:
                continue
            line = line if line.startswith("- at ") else f"{path}: {line}"
            if line not in lines:
                lines.append(line)
    if found:
        raise CheckError("helm lint:\n    " + "\n    ".join(lines or ["(no message)"]))


def render(chart: helm.Chart, values: dict[str, Any] | None) -> dict[str, list[dict]]:
    """Template path -> its manifests (empty documents dropped)."""
    try:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as e:
        raise CheckError(f"helm template: {e}") from e
    manifests: dict[str, list[dict]] = {}
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            if not text.strip():
                raise CheckError(f"{path} renders empty")
            continue
        try:
            docs = [d for d in yaml.safe_load_all(text) if d]
        except yaml.YAMLError as e:
            raise CheckError(f"{path} is not valid YAML: {e}\n{text}") from e
        for d in docs:
            if not isinstance(d, dict):
                raise CheckError(f"{path}: a document is not a mapping: {d!r}")
        if docs:
            manifests[path] = docs
    return manifests


def validate_schemas(manifests: dict[str, list[dict]]) -> list[str]:
    """Validates each manifest; returns the problems."""
    problems = []
    seen = set()
    for path, docs in manifests.items():
        for d in docs:
            kind, api = d.get("kind"), d.get("apiVersion")
            meta = d.get("metadata") or {}
            name = meta.get("name")
            where = f"{path}: {kind}/{name}"
            if not isinstance(kind, str) or not isinstance(api, str) or not isinstance(name, str):
                problems.append(f"{path}: apiVersion, kind and metadata.name must be strings")
                continue
            if (kind, name) in seen:
                problems.append(f"{where}: rendered twice")
            seen.add((kind, name))
            if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
                problems.append(f"{where}: metadata.name is not a DNS subdomain")
            if kind == "Service" and (len(name) > 63 or not DNS_LABEL.match(name)):
                problems.append(f"{where}: a Service name must be a DNS label (pod DNS names use it)")
            if kind == "StatefulSet" and len(name) > 52:
                problems.append(f"{where}: longer than 52 characters (its pods' controller-revision-hash label would exceed 63)")
            if meta.get("namespace") not in (None, NAMESPACE) and kind != "ServiceMonitor":
                problems.append(f"{where}: namespace {meta.get('namespace')} is not the release's")
            if kind in CUSTOM_KINDS:
                if api != CUSTOM_KINDS[kind]:
                    problems.append(f"{where}: apiVersion {api}, expected {CUSTOM_KINDS[kind]}")
                if not isinstance(d.get("spec"), dict) or not d["spec"]:
                    problems.append(f"{where}: no spec")
                labels = meta.get("labels") or {}
                if not all(isinstance(v, str) for v in labels.values()):
                    problems.append(f"{where}: label values must be strings")
                continue
            try:
                kv.validate(d, KUBE_VERSION, strict=True)
            except kv.ValidationError as e:
                at = ".".join(str(p) for p in e.path) or "(root)"
                problems.append(f"{where}: {at}: {e.message}")
            except kv.SchemaNotFoundError as e:
                problems.append(f"{where}: {e.message}")
    return problems


def by_kind(manifests: dict[str, list[dict]], kind: str) -> list[dict]:
    return [d for docs in manifests.values() for d in docs if d.get("kind") == kind]


def one(manifests: dict[str, list[dict]], kind: str) -> dict:
    found = by_kind(manifests, kind)
    if len(found) != 1:
        raise CheckError(f"expected one {kind}, rendered {len(found)}")
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def is_gateway(d: dict) -> bool:
    return (d.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component") == "gateway"


def workers(docs: list[dict]) -> list[dict]:
    """The objects that are not the gateway's."""
    return [d for d in docs if not is_gateway(d)]


def config_of(manifests: dict[str, list[dict]], pod_spec: dict, config_path: str) -> tuple[str, str]:
    """(ConfigMap name, file text) of the config file a pod reads at config_path."""
    c = pod_spec["containers"][0]
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    path = Path(config_path)
    mount = mounts.get(str(path.parent))
    if mount is None or "configMap" not in volumes.get(mount["name"], {}):
        raise CheckError(f"{config_path} is not on a ConfigMap volume")
    name = volumes[mount["name"]]["configMap"]["name"]
    cms = [d for d in by_kind(manifests, "ConfigMap") if d["metadata"]["name"] == name]
    if not cms or path.name not in (cms[0].get("data") or {}):
        raise CheckError(f"ConfigMap {name} with {path.name} is not rendered")
    return name, cms[0]["data"][path.name]


def check_fit(manifests: dict[str, list[dict]], values: dict[str, Any]) -> list[str]:
    """Checks that config, StatefulSet, Services and the rest agree."""
    problems: list[str] = []
    sts = one(manifests, "StatefulSet")
    pod = sts["spec"]["template"]
    pod_labels = pod["metadata"].get("labels", {})
    spec = pod["spec"]
    containers = spec["containers"]
    c = containers[0]
    env = c.get("env", [])
    env_names = [e["name"] for e in env]
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}

    if not selects(sts["spec"]["selector"]["matchLabels"], pod_labels):
        problems.append("StatefulSet selector does not select its own pods")

    # The config file: mounted from the ConfigMap, TOML with the required sections.
    args = c.get("args", [])
    if args[:2] != ["run", "--config"] or len(args) < 3:
        return problems + [f"container args {args} are not `run --config FILE`"]
    config_path = Path(args[2])
    mount = mounts.get(str(config_path.parent))
    if mount is None or "configMap" not in volumes.get(mount["name"], {}):
        return problems + [f"{config_path} is not on a ConfigMap volume"]
    cm_name = volumes[mount["name"]]["configMap"]["name"]
    cms = [d for d in by_kind(manifests, "ConfigMap") if d["metadata"]["name"] == cm_name]
    if not cms:
        return problems + [f"ConfigMap {cm_name} (the config volume) is not rendered"]
    text = (cms[0].get("data") or {}).get(config_path.name)
    if text is None:
        return problems + [f"ConfigMap {cm_name} has no {config_path.name}"]
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return problems + [f"{config_path.name} is not valid TOML: {e}\n{text}"]
    kafka = cfg.get("kafka")
    if not isinstance(kafka, dict) or not str(kafka.get("bootstrap_servers", "")).strip():
        problems.append(f"{config_path.name}: no [kafka] bootstrap_servers")
    llm = cfg.get("llm")
    if not isinstance(llm, dict) or not llm.get("providers") or not llm.get("models"):
        problems.append(f"{config_path.name}: no [llm] providers and models")
    http = cfg.get("http") or {}
    if "advertised_url" in http:
        problems.append(
            f"{config_path.name}: [http] advertised_url is fixed in the shared file; each pod must set its own"
        )
    listen = str(http.get("listen", "0.0.0.0:8080"))
    port = int(listen.rsplit(":", 1)[1])

    # Each pod advertises http://<its name>.<headless service>.<namespace>.svc...:<port>.
    headless = [s for s in by_kind(manifests, "Service") if s["spec"].get("clusterIP") == "None"]
    if len(headless) != 1 or headless[0]["metadata"]["name"] != sts["spec"].get("serviceName"):
        problems.append("the StatefulSet's serviceName is not the headless Service")
    else:
        hs = headless[0]["metadata"]["name"]
        url = next((e.get("value", "") for e in env if e["name"] == "SLUICE_HTTP__ADVERTISED_URL"), None)
        pod_name = next((e for e in env if e["name"] == "POD_NAME"), None)
        expected = re.compile(
            rf"^http://\$\(POD_NAME\)\.{re.escape(hs)}\.{re.escape(NAMESPACE)}\.svc\.[a-z0-9.-]+:{port}$"
        )
        if url is None:
            problems.append("no SLUICE_HTTP__ADVERTISED_URL in the container's environment")
        elif not expected.match(url):
            problems.append(f"SLUICE_HTTP__ADVERTISED_URL {url!r} is not {expected.pattern}")
        if (
            pod_name is None
            or pod_name.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name"
            or (url is not None and env_names.index("POD_NAME") > env_names.index("SLUICE_HTTP__ADVERTISED_URL"))
        ):
            problems.append("POD_NAME must come from metadata.name, before SLUICE_HTTP__ADVERTISED_URL")
        # Static membership: each pod is its own group.instance.id.
        gid = next((e.get("value") for e in env if e["name"] == "SLUICE_KAFKA__GROUP_INSTANCE_ID"), None)
        if gid != "$(POD_NAME)" or env_names.index("POD_NAME") > env_names.index("SLUICE_KAFKA__GROUP_INSTANCE_ID"):
            problems.append("SLUICE_KAFKA__GROUP_INSTANCE_ID must be $(POD_NAME), after POD_NAME")
    if isinstance(kafka, dict) and "group_instance_id" in kafka:
        problems.append(f"{config_path.name}: [kafka] group_instance_id is fixed in the shared file; each pod must set its own")

    # Ports and probes.
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if ports.get("http") != port:
        problems.append(f"container port http is {ports.get('http')}, [http] listen uses {port}")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        if not values.get(probe, {}).get("enabled", True):
            continue
        get = (c.get(probe) or {}).get("httpGet") or {}
        if get.get("path") != path or get.get("port") not in ("http", port):
            problems.append(f"{probe} is not GET {path} on the http port")
    for svc in workers(by_kind(manifests, "Service")):
        if not selects(svc["spec"].get("selector", {}), pod_labels):
            problems.append(f"Service {svc['metadata']['name']} does not select the pods")
        for p in svc["spec"].get("ports", []):
            if p.get("targetPort") not in ("http", port):
                problems.append(f"Service {svc['metadata']['name']} targets port {p.get('targetPort')}")

    # State on the claim (or an emptyDir), a writable /tmp, a read-only root.
    state_dir = cfg.get("app", {}).get("state_dir", "/var/lib/sluice")
    state = mounts.get(state_dir)
    if state is None:
        problems.append(f"nothing is mounted at [app] state_dir {state_dir}")
    elif state["name"] not in claims and "emptyDir" not in volumes.get(state["name"], {}):
        problems.append(f"{state_dir} is neither a volumeClaimTemplate nor an emptyDir")
    if values.get("persistence", {}).get("enabled", True) and state and state["name"] not in claims:
        problems.append("persistence is enabled but the state is not on a volumeClaimTemplate")
    if "/tmp" not in mounts:
        problems.append("no writable /tmp")
    sc = c.get("securityContext") or {}
    psc = spec.get("securityContext") or {}
    if not sc.get("readOnlyRootFilesystem"):
        problems.append("the root filesystem is not read-only")
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
        problems.append("the container may run as root")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("privilege escalation is not disabled")

    # Shutdown: the grace period covers the drain of in-flight calls.
    drain_ms = cfg.get("app", {}).get("drain_timeout_ms")
    if drain_ms is None:
        models = cfg.get("llm", {}).get("models", [])
        drain_ms = max([int(m.get("timeout_ms", 60000)) for m in models] or [0]) + 5000
    drain_s = -(-int(drain_ms) // 1000)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace < drain_s:
        problems.append(f"terminationGracePeriodSeconds {grace} < drain_timeout {drain_s}s")

    # Every volume's ConfigMap or Secret is rendered or named as existing.
    rendered_secrets = {d["metadata"]["name"] for d in by_kind(manifests, "Secret")}
    existing = values.get("secrets", {}).get("existingSecret")
    for v in volumes.values():
        if "secret" in v and v["secret"]["secretName"] not in rendered_secrets | {existing}:
            problems.append(f"volume {v['name']} uses Secret {v['secret']['secretName']}, which is neither rendered nor existingSecret")
    for e in env:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref and ref["name"] not in rendered_secrets | {existing}:
            problems.append(f"env {e['name']} uses Secret {ref['name']}, which is neither rendered nor existingSecret")

    for pdb in workers(by_kind(manifests, "PodDisruptionBudget")):
        if not selects(pdb["spec"]["selector"].get("matchLabels", {}), pod_labels):
            problems.append("the PodDisruptionBudget does not select the pods")

    for so in by_kind(manifests, "ScaledObject"):
        target = so["spec"].get("scaleTargetRef", {})
        if (target.get("kind"), target.get("name")) != ("StatefulSet", sts["metadata"]["name"]):
            problems.append(f"ScaledObject targets {target}, not the StatefulSet")
        triggers = so["spec"].get("triggers") or []
        if not triggers:
            problems.append("ScaledObject has no triggers")
        for t in triggers:
            md = t.get("metadata", {})
            if t.get("type") != "kafka" or md.get("consumerGroup") != cfg.get("app", {}).get("id", "sluice"):
                problems.append("a ScaledObject trigger is not the kafka lag of [app] id's consumer group")
            if md.get("bootstrapServers") != (kafka or {}).get("bootstrap_servers"):
                problems.append("a ScaledObject trigger's bootstrapServers differ from [kafka]")
            if not all(isinstance(v, str) for v in md.values()):
                problems.append("ScaledObject trigger metadata values must be strings")
        if "replicas" in sts["spec"]:
            problems.append("the StatefulSet sets replicas while KEDA scales it")

    for sm in workers(by_kind(manifests, "ServiceMonitor")):
        sel = sm["spec"].get("selector", {}).get("matchLabels", {})
        matched = [s for s in by_kind(manifests, "Service") if selects(sel, s["metadata"].get("labels", {}))]
        if len(matched) != 1:
            problems.append(f"the ServiceMonitor selects {len(matched)} Services (want exactly one)")
        if not any(ep.get("port") == "http" and ep.get("path") == "/metrics" for ep in sm["spec"].get("endpoints", [])):
            problems.append("the ServiceMonitor does not scrape /metrics on port http")
    return problems


def check_gateway(manifests: dict[str, list[dict]], values: dict[str, Any]) -> list[str]:
    """Checks the task gateway's objects against the StatefulSet's and the values."""
    problems: list[str] = []
    gw = values.get("gateway") or {}
    sts = one(manifests, "StatefulSet")
    sts_spec = sts["spec"]["template"]["spec"]
    sts_labels = sts["spec"]["template"]["metadata"].get("labels", {})
    config_path = sts_spec["containers"][0]["args"][2]
    _, text = config_of(manifests, sts_spec, config_path)
    cfg = tomllib.loads(text)
    ours = [d for docs in manifests.values() for d in docs if is_gateway(d)]
    if not gw.get("enabled"):
        if ours or by_kind(manifests, "Deployment") or by_kind(manifests, "Ingress"):
            problems.append("gateway.enabled is false, yet gateway objects are rendered")
        if not values.get("configToml") and "gateway" in cfg:
            problems.append("gateway.enabled is false, yet sluice.toml has a [gateway] section")
        return problems

    dep = one(manifests, "Deployment")
    if not is_gateway(dep):
        problems.append("the Deployment is not labelled app.kubernetes.io/component: gateway")
    pod_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    spec = dep["spec"]["template"]["spec"]
    if not selects(dep["spec"]["selector"]["matchLabels"], pod_labels):
        problems.append("the gateway Deployment's selector does not select its own pods")
    # Selectors stay apart: the StatefulSet's (immutable) selector and the
    # workers' Services, PDB and NetworkPolicy must not take the gateway pods,
    # nor the gateway's the workers'.
    if selects(sts["spec"]["selector"]["matchLabels"], pod_labels):
        problems.append("the StatefulSet's selector selects the gateway pods")
    if selects(dep["spec"]["selector"]["matchLabels"], sts_labels):
        problems.append("the gateway Deployment's selector selects the StatefulSet's pods")
    for d in [d for docs in manifests.values() for d in docs]:
        kind = d.get("kind")
        sel = {
            "Service": lambda: d["spec"].get("selector", {}),
            "PodDisruptionBudget": lambda: d["spec"]["selector"].get("matchLabels", {}),
            "NetworkPolicy": lambda: d["spec"]["podSelector"].get("matchLabels", {}),
        }.get(kind)
        if sel is None:
            continue
        want, other = (pod_labels, sts_labels) if is_gateway(d) else (sts_labels, pod_labels)
        if not selects(sel(), want):
            problems.append(f"{kind} {d['metadata']['name']} does not select its pods")
        if selects(sel(), other):
            problems.append(f"{kind} {d['metadata']['name']} also selects the {'workers' if is_gateway(d) else 'gateway'} pods")

    c = spec["containers"][0]
    sts_c = sts_spec["containers"][0]
    if c.get("image") != sts_c.get("image") or c.get("command") != sts_c.get("command"):
        problems.append("the gateway's image or command differs from the StatefulSet's")
    if c.get("args") != ["gateway", "--config", config_path]:
        problems.append(f"gateway container args {c.get('args')} are not `gateway --config {config_path}`")
    try:
        cm, _ = config_of(manifests, spec, config_path)
        if cm != config_of(manifests, sts_spec, config_path)[0]:
            problems.append("the gateway reads another ConfigMap than the StatefulSet")
    except CheckError as e:
        problems.append(f"gateway: {e}")

    port = int(gw["port"])
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if ports.get("gateway") != port:
        problems.append(f"gateway container port `gateway` is {ports.get('gateway')}, gateway.port is {port}")
    env = c.get("env", [])
    names = [e["name"] for e in env]
    value = {e["name"]: e.get("value") for e in env}
    pod_ip = next((e for e in env if e["name"] == "POD_IP"), None)
    if value.get("SLUICE_GATEWAY__LISTEN") != f"0.0.0.0:{port}":
        problems.append(f"SLUICE_GATEWAY__LISTEN is {value.get('SLUICE_GATEWAY__LISTEN')!r}, not 0.0.0.0:{port}")
    if value.get("SLUICE_GATEWAY__ADVERTISED_URL") != f"http://$(POD_IP):{port}":
        problems.append(f"SLUICE_GATEWAY__ADVERTISED_URL is {value.get('SLUICE_GATEWAY__ADVERTISED_URL')!r}, not http://$(POD_IP):{port}")
    elif (
        pod_ip is None
        or pod_ip.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP"
        or names.index("POD_IP") > names.index("SLUICE_GATEWAY__ADVERTISED_URL")
    ):
        problems.append("POD_IP must come from status.podIP, before SLUICE_GATEWAY__ADVERTISED_URL")
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    state = mounts.get(value.get("SLUICE_GATEWAY__STATE_DIR") or "")
    if state is None or "emptyDir" not in volumes.get(state["name"], {}):
        problems.append("SLUICE_GATEWAY__STATE_DIR is not on an emptyDir")
    if "/tmp" not in mounts:
        problems.append("the gateway has no writable /tmp")
    # The Secret (provider keys, tokens, claims key, Kafka CA) as the workers have it.
    sts_volumes = {v["name"]: v for v in sts_spec.get("volumes", [])}
    sts_secrets = [(m["mountPath"], sts_volumes.get(m["name"], {}).get("secret")) for m in sts_c.get("volumeMounts", [])]
    for path, secret in sts_secrets:
        if secret and (path not in mounts or volumes.get(mounts[path]["name"], {}).get("secret") != secret):
            problems.append(f"the gateway does not mount the Secret {secret['secretName']} at {path}")
    http = cfg.get("http") or {}
    for key in ("tokens_file", "claims_key_file"):
        f = http.get(key)
        if f and not any(f.startswith(m.rstrip("/") + "/") for m in mounts):
            problems.append(f"[http] {key} {f} is on no volume of the gateway")
    sts_refs = {json.dumps(e) for e in sts_c.get("env", []) if (e.get("valueFrom") or {}).get("secretKeyRef")}
    gw_refs = {json.dumps(e) for e in env if (e.get("valueFrom") or {}).get("secretKeyRef")}
    if not sts_refs <= gw_refs:
        problems.append("the gateway lacks Secret-backed variables the StatefulSet has (Kafka SASL)")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        if not values.get(probe, {}).get("enabled", True):
            continue
        get = (c.get(probe) or {}).get("httpGet") or {}
        if get.get("path") != path or get.get("port") not in ("gateway", port):
            problems.append(f"the gateway's {probe} is not GET {path} on the gateway port")
    sc = c.get("securityContext") or {}
    psc = spec.get("securityContext") or {}
    if not sc.get("readOnlyRootFilesystem") or sc.get("allowPrivilegeEscalation") is not False:
        problems.append("the gateway's root filesystem is writable or it may escalate privileges")
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
        problems.append("the gateway container may run as root")

    svcs = [s for s in by_kind(manifests, "Service") if is_gateway(s)]
    if len(svcs) != 1:
        return problems + [f"expected one gateway Service, rendered {len(svcs)}"]
    svc = svcs[0]
    if svc["spec"].get("type", "ClusterIP") != "ClusterIP":
        problems.append("the gateway Service is not ClusterIP")
    if [(p.get("name"), p.get("targetPort")) for p in svc["spec"]["ports"]] != [("http", "gateway")]:
        problems.append("the gateway Service's port is not http -> gateway")
    pdbs = [d for d in by_kind(manifests, "PodDisruptionBudget") if is_gateway(d)]
    if len(pdbs) != (1 if gw.get("podDisruptionBudget", {}).get("enabled") else 0):
        problems.append(f"{len(pdbs)} gateway PodDisruptionBudgets rendered")

    if values.get("networkPolicy", {}).get("enabled"):
        nps = [d for d in by_kind(manifests, "NetworkPolicy") if is_gateway(d)]
        if len(nps) != 1:
            problems.append(f"expected one gateway NetworkPolicy, rendered {len(nps)}")
        else:
            rules = nps[0]["spec"].get("ingress") or []
            peers = [
                p for r in rules if any(int(x.get("port", 0)) == port for x in r.get("ports", []))
                for p in r.get("from", [])
            ]
            if not any(selects((p.get("podSelector") or {}).get("matchLabels", {}), pod_labels)
                       and "namespaceSelector" not in p for p in peers):
                problems.append("the gateway NetworkPolicy does not admit the gateway's own pods to the gateway port")
            for p in values["networkPolicy"].get("from") or []:
                if p not in peers:
                    problems.append(f"the gateway NetworkPolicy does not admit networkPolicy.from peer {p}")
            for p in gw.get("networkPolicy", {}).get("from") or []:
                if p not in peers:
                    problems.append(f"the gateway NetworkPolicy does not admit gateway.networkPolicy.from peer {p}")

    ing_values = gw.get("ingress") or {}
    ings = by_kind(manifests, "Ingress")
    if len(ings) != (1 if ing_values.get("enabled") else 0):
        problems.append(f"{len(ings)} Ingresses rendered, gateway.ingress.enabled is {ing_values.get('enabled')}")
    for ing in ings:
        for rule in ing["spec"].get("rules", []):
            if rule.get("host", "") != ing_values.get("host", ""):
                problems.append(f"Ingress rule host {rule.get('host')!r}, gateway.ingress.host is {ing_values.get('host')!r}")
            for path in rule.get("http", {}).get("paths", []):
                backend = path.get("backend", {}).get("service", {})
                if backend.get("name") != svc["metadata"]["name"] or backend.get("port", {}).get("name") != "http":
                    problems.append(f"Ingress backend {backend} is not the gateway Service's http port")
        if (ing["spec"].get("tls") or []) != (ing_values.get("tls") or []):
            problems.append("the Ingress's tls is not gateway.ingress.tls")

    if values.get("metrics", {}).get("serviceMonitor", {}).get("enabled"):
        sms = [d for d in by_kind(manifests, "ServiceMonitor") if is_gateway(d)]
        if len(sms) != 1:
            problems.append(f"expected one gateway ServiceMonitor, rendered {len(sms)}")
        else:
            sel = sms[0]["spec"].get("selector", {}).get("matchLabels", {})
            matched = [s for s in by_kind(manifests, "Service") if selects(sel, s["metadata"].get("labels", {}))]
            if matched != [svc]:
                problems.append("the gateway ServiceMonitor does not select exactly the gateway Service")
            if not any(ep.get("port") == "http" and ep.get("path") == "/metrics" for ep in sms[0]["spec"].get("endpoints", [])):
                problems.append("the gateway ServiceMonitor does not scrape /metrics on port http")

    # [gateway] in sluice.toml: gateway.config, without the chart-managed keys.
    section = cfg.get("gateway")
    if not values.get("configToml"):
        want = {k: v for k, v in (gw.get("config") or {}).items() if v is not None}
        if (section or {}) != want:
            problems.append(f"sluice.toml [gateway] is {section}, gateway.config is {want}")
    for key in ("listen", "advertised_url", "state_dir"):
        if key in (section or {}) and values.get("configToml") is None:
            problems.append(f"sluice.toml [gateway] {key} is the chart's (set from the environment)")
    return problems


def check_values(chart_dir: Path, chart: helm.Chart, label: str, values: dict[str, Any] | None) -> str:
    lint(chart_dir, values)
    manifests = render(chart, values)
    problems = validate_schemas(manifests)
    merged = chart.merge_values(values or {})
    problems += check_fit(manifests, merged)
    if not problems:
        problems += check_gateway(manifests, merged)
    if problems:
        raise CheckError("\n    ".join(["problems:"] + problems))
    kinds = sorted({d["kind"] for docs in manifests.values() for d in docs})
    return f"{label}: lint ok, {sum(map(len, manifests.values()))} manifests valid for Kubernetes {KUBE_VERSION} ({', '.join(kinds)}), sluice.toml ok"


def check_dashboard(chart_dir: Path, enabled: dict[str, list[dict]], default: dict[str, list[dict]]) -> None:
    """dashboard.enabled renders files/dashboard.json as a ConfigMap for the
    Grafana sidecar (its label, valid JSON, a dashboard with panels and a
    Prometheus datasource variable); the default values render none."""
    source = chart_dir / "files/dashboard.json"
    if not source.exists():
        raise CheckError(f"{source} is missing")
    if any(d["metadata"]["name"].endswith("-dashboard") for d in by_kind(default, "ConfigMap")):
        raise CheckError("the default values (dashboard.enabled false) render a dashboard ConfigMap")
    cms = [d for d in by_kind(enabled, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    if len(cms) != 1:
        raise CheckError(f"expected one dashboard ConfigMap, rendered {len(cms)}")
    cm = cms[0]
    if cm["metadata"].get("namespace") != NAMESPACE:
        raise CheckError(f"dashboard ConfigMap namespace {cm['metadata'].get('namespace')!r}, expected {NAMESPACE!r}")
    if cm["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        raise CheckError("dashboard ConfigMap lacks the Grafana sidecar label grafana_dashboard: \"1\"")
    data = cm.get("data") or {}
    if list(data) != ["sluice.json"]:
        raise CheckError(f"dashboard ConfigMap data keys {list(data)}, expected ['sluice.json']")
    try:
        dashboard = json.loads(data["sluice.json"])
    except json.JSONDecodeError as e:
        raise CheckError(f"dashboard ConfigMap sluice.json is not valid JSON: {e}") from e
    if dashboard != json.loads(source.read_text()):
        raise CheckError(f"dashboard ConfigMap sluice.json differs from {source.name}")
    if not dashboard.get("title") or not dashboard.get("panels"):
        raise CheckError("dashboard has no title or no panels")
    variables = dashboard.get("templating", {}).get("list", [])
    if not any(v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables):
        raise CheckError("dashboard has no Prometheus datasource variable")


ALERTS = [
    "SluiceRebalancesFrequent",
    "SluiceRateLimited",
    "SluicePartitionLagSkewed",
    "SluiceDeadLettersGrowing",
    "SluiceBreakerOpen",
    "SluiceQuotaRefusals",
    "SluiceTaskSloMissed",
]


def check_alerts(chart_dir: Path, enabled: dict[str, list[dict]], default: dict[str, list[dict]], promtool: str) -> None:
    """metrics.prometheusRule.enabled renders one PrometheusRule holding the
    documented alerts; the default values render none. promtool checks the
    rules (PromQL, templates) and runs their unit tests
    (tests/alerts/rules_test.yaml: each alert fires on series that must fire
    it and stays silent on series that must not)."""
    if by_kind(default, "PrometheusRule"):
        raise CheckError("the default values (prometheusRule.enabled false) render a PrometheusRule")
    rules = one(enabled, "PrometheusRule")
    if rules["metadata"].get("namespace") != NAMESPACE:
        raise CheckError(f"PrometheusRule namespace {rules['metadata'].get('namespace')!r}, expected {NAMESPACE!r}")
    groups = rules["spec"]["groups"]
    names = [r.get("alert") for g in groups for r in g["rules"]]
    if names != ALERTS:
        raise CheckError(f"PrometheusRule alerts {names}, expected {ALERTS}")
    test_file = chart_dir.parent.parent / "tests/alerts/rules_test.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp, "full.yaml")
        full.write_text(yaml.safe_dump({"groups": groups}))
        # The unit tests compare labels; annotations are checked by `check rules`.
        bare = [
            {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups
        ]
        Path(tmp, "rules.yaml").write_text(yaml.safe_dump({"groups": bare}))
        Path(tmp, "rules_test.yaml").write_text(test_file.read_text())
        for args in (["check", "rules", str(full)], ["test", "rules", "rules_test.yaml"]):
            run = subprocess.run([promtool, *args], cwd=tmp, capture_output=True, text=True)
            if run.returncode != 0:
                raise CheckError(f"promtool {' '.join(args[:2])}:\n{run.stdout}{run.stderr}")


def check_refusals(chart: helm.Chart) -> list[str]:
    problems = []
    for what, values, reason in MUST_REFUSE:
        try:
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        except helm.HelmError as e:
            if reason not in str(e):
                problems.append(f"{what}: refused, but the message does not name {reason!r}: {e}")
            continue
        problems.append(f"{what}: accepted, must be refused")
    return problems


def main() -> int:
    chart_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "helm/sluice").resolve()
    failed = False
    with helm.Chart.load(chart_dir) as chart:
        default_cm: list[str] = []

        def default_config_as_string() -> dict[str, Any]:
            default_cm.append(one(render(chart, None), "ConfigMap")["data"]["sluice.toml"])
            return {"configToml": default_cm[0]}

        sets: list[tuple[str, Any]] = [("values.yaml", None)]
        for f in sorted((chart_dir / "ci").glob("*.yaml")):
            sets.append((f"ci/{f.name}", yaml.safe_load(f.read_text()) or {}))
        # configToml: the default config, given back as a string, must render the same file.
        sets.append(("configToml (the default config as a string)", default_config_as_string))
        # The Grafana dashboard: enabled, files/dashboard.json renders as a ConfigMap.
        sets.append(("dashboard.enabled", {"dashboard": {"enabled": True}}))
        # The alerts: metrics.prometheusRule.enabled, checked and unit-tested by promtool.
        promtool = os.environ.get("SLUICE_PROMTOOL", "")
        if not promtool:
            print("check-helm: SLUICE_PROMTOOL (the promtool binary) is not set", file=sys.stderr)
            return 1
        sets.append(("metrics.prometheusRule.enabled", {"metrics": {"prometheusRule": {"enabled": True}}}))
        for label, values in sets:
            try:
                if callable(values):
                    values = values()
                line = check_values(chart_dir, chart, label, values)
                if default_cm and label.startswith("configToml"):
                    again = one(render(chart, values), "ConfigMap")["data"]["sluice.toml"]
                    if again != default_cm[0]:
                        raise CheckError("configToml is not passed through unchanged")
                if label.startswith("dashboard"):
                    check_dashboard(chart_dir, render(chart, values), render(chart, None))
                if label.startswith("metrics.prometheusRule"):
                    check_alerts(chart_dir, render(chart, values), render(chart, None), promtool)
                print(f"check-helm: {line}")
            except CheckError as e:
                failed = True
                print(f"check-helm: FAILED for {label}: {e}", file=sys.stderr)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                failed = True
                print(f"check-helm: FAILED for {label}: a manifest lacks what the chart must render: {e!r}", file=sys.stderr)
        bad = 0
        for label, values in VARIANTS:
            try:
                check_values(chart_dir, chart, label, values)
            except (CheckError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                bad += 1
                print(f"check-helm: FAILED for the variant {label}: {e}", file=sys.stderr)
        if bad:
            failed = True
        else:
            print(f"check-helm: {len(VARIANTS)} variants of the values ok")
        # Refusals only mean something once good values pass.
        if not failed:
            refusals = check_refusals(chart)
            if refusals:
                failed = True
                print("check-helm: FAILED: values the chart must refuse:\n    " + "\n    ".join(refusals), file=sys.stderr)
            else:
                print(f"check-helm: {len(MUST_REFUSE)} kinds of bad values refused")
    if failed:
        print(f"check-helm: the chart {chart_dir} has problems (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
