"""deploy/: the Kubernetes manifests validate against the Kubernetes API schemas (the
kubernetes-validate package ships them; no network) and agree with the server they run (its
flags, ports, health service, metric names and drain timing); the HAProxy config passes
`haproxy -c`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # native preStop sleep needs 1.30; the newest schemas


def _docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _docs() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _container() -> dict:
    return _one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def _args():
    from tts_server.__main__ import build_parser

    return build_parser().parse_args(_container()["args"])  # unknown flags fail here


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version):
    import kubernetes_validate

    kinds = set()
    for doc in _docs():
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap"} <= kinds


def test_a_broken_manifest_is_caught():
    import kubernetes_validate

    bad = _one("Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_deployment_matches_the_server():
    from tts_server.rpc.server import SERVICE_NAME

    c, a = _container(), _args()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == a.port and ports["metrics"] == a.metrics_port
    assert ports["http"] == a.http_port  # the OpenAI-compatible speech API
    assert c["readinessProbe"]["grpc"] == {"port": a.port, "service": SERVICE_NAME}
    assert c["livenessProbe"]["grpc"]["port"] == c["startupProbe"]["grpc"]["port"] == a.port
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"]
    template = _one("Deployment")["spec"]["template"]
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == a.metrics_port


def test_compiled_kernels_outlive_the_pod():
    """TRITON_CACHE_DIR lies on a node folder (not the container's or an emptyDir), so that a
    restarted or added pod does not compile every kernel again."""
    c = _container()
    pod = _one("Deployment")["spec"]["template"]["spec"]
    cache = {e["name"]: e.get("value") for e in c.get("env", [])}.get("TRITON_CACHE_DIR")
    assert cache, "TRITON_CACHE_DIR is not set"
    mounts = [m for m in c.get("volumeMounts", []) if (cache + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts and not mounts[0].get("readOnly"), f"{cache} is not on a writable volume"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert "hostPath" in volume or "persistentVolumeClaim" in volume, volume


def test_termination_grace_covers_the_drain():
    c, a = _container(), _args()
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert a.drain_delay_s > 0  # behind Services and proxies: keep taking calls while they notice
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + a.drain_delay_s + a.grace_period_s + 5
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > a.drain_delay_s + a.grace_period_s


def test_selectors_and_autoscaling_point_at_the_deployment():
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind, name in (("Service", "tts-server"), ("Service", "tts-server-headless")):
        assert _one(kind, name)["spec"]["selector"].items() <= labels.items()
    assert _one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = _one("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == _one("Deployment")["metadata"]["name"]
    assert _one("Service", "tts-server-headless")["spec"]["clusterIP"] == "None"


def test_autoscaling_rule_uses_metrics_the_server_exports():
    from tts_server.metrics import Metrics

    exported = {m.name for m in Metrics().registry.collect()}
    rules = yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])["rules"]
    metric = _one("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert [r["name"]["as"] for r in rules] == [metric]
    for needed in ("tts_active_streams", "tts_stream_slots"):
        assert needed in exported and needed in rules[0]["metricsQuery"]


HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy")
                                      else None)


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (Debian/Ubuntu: apt-get "
                                            "install haproxy; `make test` installs it where it can)")
def test_haproxy_config_is_valid():
    res = subprocess.run([HAPROXY, "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
