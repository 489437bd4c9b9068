"""deploy/k8s renders, every object in it is valid Kubernetes, and it says what the gateway expects.

`kubectl kustomize deploy/k8s` renders it (kubectl's own kustomize); each object is checked
against the Kubernetes OpenAPI schemas of the versions in K8S_VERSIONS with kubernetes-validate,
strictly (an unknown field is an error). Then what matters for Sandgate: probes on the gateway's
port, the token from a Secret, a ReadWriteMany checkpoint volume, websocket timeouts on the
Ingress, and no SANDGATE_* variable that the gateway does not read. Nothing here runs a cluster."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sandgate import cli
from sandgate.config import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSIONS = ("1.29.0", "1.33.0")  # the oldest this supports, and a recent one; both bundled by kubernetes-validate
NAMESPACE = "sandgate"


@pytest.fixture(scope="module")
def objects() -> list:
    kubectl = shutil.which("kubectl")
    assert kubectl, ("kubectl is needed to render deploy/k8s (`kubectl kustomize`); this machine's image "
                     "has it (1.32); elsewhere install a recent one (its kustomize reads `labels:`)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, "deploy/k8s rendered nothing"
    return docs


def one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def gateway_container(objects) -> dict:
    ds = one(objects, "DaemonSet")
    (container,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    return container


def env_of(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def port_number(container, port) -> int:
    """A probe's or Service's port (a name or a number) as the container's port number."""
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return match


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(objects, version):
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not problems, f"against Kubernetes {version}:\n" + "\n".join(problems)


def test_the_validator_refuses_what_it_should(objects):
    """The schemas are really checked, strictly: a misspelt field and a wrong type are caught."""
    ds = one(objects, "DaemonSet")
    typo = {**ds, "spec": {**ds["spec"], "updateStrategie": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSIONS[0], strict=True)
    svc = one(objects, "Service", "sandgate")
    wrong = {**svc, "spec": {**svc["spec"], "ports": [{"port": "eighty"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSIONS[0], strict=True)


def test_all_in_one_namespace_with_the_expected_objects(objects):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == sorted([
        ("Namespace", NAMESPACE), ("ConfigMap", "sandgate-settings"), ("DaemonSet", "sandgate-gateway"),
        ("Service", "sandgate"), ("Ingress", "sandgate"), ("PersistentVolumeClaim", "sandgate-checkpoints"),
        ("Deployment", "sandgate-redis"), ("Service", "sandgate-redis"), ("PersistentVolumeClaim", "sandgate-redis"),
        ("NetworkPolicy", "sandgate-redis"),
    ]), kinds
    ns = one(objects, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"  # the gateway is
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == NAMESPACE, o["metadata"]


def test_probes_are_on_the_gateways_port(objects):
    c = gateway_container(objects)
    port = int(env_of(c)["SANDGATE_PORT"]["value"])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[kind]["httpGet"]
        assert port_number(c, get["port"]) == port, kind
        assert get.get("scheme", "HTTP") == "HTTP" and "httpHeaders" not in get, kind  # no token: none needed
        paths[kind] = get["path"]
    # readiness (and startup) on /healthz, 503 while draining; liveness on /livez, which is not
    # (gateway/api/health.py): a liveness probe failing during a drain would restart the gateway.
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/healthz", "livenessProbe": "/livez"}
    from sandgate.api import health

    assert {r[0] for r in health.routes()} == {"/healthz", "/livez"}


def test_the_token_comes_from_a_secret_and_none_is_committed(objects):
    c = gateway_container(objects)
    token = env_of(c)["SANDGATE_TOKEN"]
    assert "value" not in token
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "sandgate-token", "key": "token"}
    assert not [o for o in objects if o["kind"] == "Secret"], "no Secret may be committed: deploy/README.md makes it"
    assert "SANDGATE_TOKEN" not in one(objects, "ConfigMap", "sandgate-settings")["data"]
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "create secret generic sandgate-token" in readme and "--from-literal=token=" in readme


def test_the_gateway_node(objects):
    ds = one(objects, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = gateway_container(objects)
    env = env_of(c)
    assert pod["nodeSelector"] == {"sandgate.dev/sandbox-capable": "true"}
    assert pod.get("hostNetwork", False) is False
    assert c["securityContext"]["privileged"] is True
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0  # never two gateways on one home
    # Node identity from the downward API: a restarted pod is the same node, reachable at its pod IP.
    assert env["SANDGATE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(env["SANDGATE_PORT"]["value"])
    assert env["SANDGATE_NODE_URL"]["value"] == f"http://$(POD_IP):{port}"
    assert list(env).index("POD_IP") < list(env).index("SANDGATE_NODE_URL")  # $(POD_IP) expands only if defined before
    assert env["SANDGATE_IP"]["value"] == "0.0.0.0"
    # The home on the node's disk; the checkpoint store on the shared claim, which is ReadWriteMany.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    home = volumes[mounts[env["SANDGATE_HOME"]["value"]]]
    assert home["hostPath"]["path"] and home["hostPath"]["type"] == "DirectoryOrCreate"
    store = volumes[mounts[env["SANDGATE_CHECKPOINT_STORE"]["value"]]]
    claim = one(objects, "PersistentVolumeClaim", store["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # preStop: `sandgate drain` against this pod's own gateway, parsed by the real CLI; time enough for it.
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sandgate"
    seen = {}
    real = cli.cmd_drain
    cli.cmd_drain = lambda args: seen.update(vars(args)) or 0
    try:
        assert cli.main(cmd[1:]) == 0
    finally:
        cli.cmd_drain = real
    assert seen["cmd"] == "drain" and seen["url"] == f"http://127.0.0.1:{port}", seen
    assert pod["terminationGracePeriodSeconds"] >= 300
    assert "memory" not in c["resources"].get("limits", {}), "a memory limit would cap every sandbox together"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]


def test_services_redis_and_ingress_fit_together(objects):
    ds = one(objects, "DaemonSet")
    c = gateway_container(objects)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    svc = one(objects, "Service", "sandgate")
    assert svc["spec"]["selector"].items() <= labels.items()
    (sport,) = svc["spec"]["ports"]
    assert port_number(c, sport["targetPort"]) == int(env_of(c)["SANDGATE_PORT"]["value"])
    assert "sessionAffinity" not in svc["spec"]  # any node forwards
    # Websockets and streamed executes through ingress-nginx: long timeouts, no buffering.
    ing = one(objects, "Ingress", "sandgate")
    notes = ing["metadata"]["annotations"]
    for key in ("nginx.ingress.kubernetes.io/proxy-read-timeout", "nginx.ingress.kubernetes.io/proxy-send-timeout"):
        assert int(notes[key]) >= 3600, key
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == f"{Settings().max_message_mb}m"
    assert not [k for k in notes if "affinity" in k]
    backends = [p["backend"]["service"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    assert backends == [{"name": "sandgate", "port": {"name": sport["name"]}}]
    # Redis: append-only on its volume, reached at the URL the gateways are given.
    redis = one(objects, "Deployment", "sandgate-redis")["spec"]["template"]["spec"]
    (rc,) = redis["containers"]
    args = rc["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    data = args[args.index("--dir") + 1]
    (mount,) = [m for m in rc["volumeMounts"] if m["mountPath"] == data]
    (vol,) = [v for v in redis["volumes"] if v["name"] == mount["name"]]
    assert one(objects, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    rsvc = one(objects, "Service", "sandgate-redis")
    url = env_of(c)["SANDGATE_REDIS_URL"]["value"]
    assert url == f"redis://{rsvc['metadata']['name']}:{rsvc['spec']['ports'][0]['port']}/0"
    policy = one(objects, "NetworkPolicy", "sandgate-redis")
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()


def test_every_sandgate_variable_named_is_one_the_gateway_reads(objects):
    """The manifests and the Dockerfile cannot drift from gateway/config.py: a renamed or
    misspelt setting fails here instead of being ignored by a running gateway."""
    known = set(Settings.ENV.values()) | set(Settings.LIMIT_ENV.values())
    named = set()
    for path in sorted(K8S.glob("*.yaml")) + [ROOT / "deploy" / "Dockerfile"]:
        named |= set(re.findall(r"\bSANDGATE_[A-Z0-9_]+", path.read_text()))
    c = gateway_container(objects)
    rendered = set(env_of(c)) | set(one(objects, "ConfigMap", "sandgate-settings")["data"])
    named |= {n for n in rendered if n.startswith("SANDGATE_")}
    assert named, "no SANDGATE_ variable found: the check checks nothing"
    unknown = sorted(named - known)
    assert not unknown, f"not settings the gateway reads (gateway/config.py Settings.ENV): {unknown}"
    assert set(one(objects, "ConfigMap", "sandgate-settings")["data"]) <= known  # all of it, SANDGATE_ or not
    # and the gateway really gets the ConfigMap's values
    assert {"configMapRef": {"name": "sandgate-settings"}} in c["envFrom"]
