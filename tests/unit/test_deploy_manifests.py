"""deploy/kubernetes: every object validates against the Kubernetes API schemas (offline, strict: an unknown
field fails), the LeaderWorkerSet's pod templates as PodTemplateSpecs (LWS is a CRD), and every
pipeline-serve command line parses with pipeline-serve's own flags, LWS's variables in the right places."""

from __future__ import annotations

import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pipeline.server_args import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lws = obj["spec"]["leaderWorkerTemplate"]
        return [lws["leaderTemplate"], lws["workerTemplate"]]
    return []


def serve_args(container: dict, env: dict[str, str]) -> list[str] | None:
    """The flags a container gives pipeline-serve (after the shell's expansion of ``env``), or None."""
    if container["command"] == ["pipeline-serve"]:
        return container["args"]
    assert container["command"] == ["sh", "-c"]
    words = shlex.split(container["args"][0])
    if "pipeline-serve" not in words:
        return None
    words = words[words.index("pipeline-serve") + 1 :]
    return [env.get(w[1:], w) if w.startswith("$") else w for w in words]


def test_there_are_the_two_manifests():
    assert [p.name for p in MANIFESTS] == ["leaderworkerset-tp.yaml", "replicas-router.yaml"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_objects_validate_against_the_api_schemas(path):
    for obj in objects(path):
        if obj["kind"] == "LeaderWorkerSet":
            assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
            for i, template in enumerate(pod_templates(obj)):
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}}
                kubernetes_validate.validate({**wrapped, "template": template}, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_misspelled_field_fails_validation():
    """The validation above can fail: strict mode refuses a field the schema does not have."""
    obj = objects(DEPLOY / "replicas-router.yaml")[0]
    obj["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_servers_parse_probe_health_and_are_scraped(path):
    """Each pipeline-serve line parses; a pod serving HTTP is probed on /health and scraped on /metrics, at
    the port it listens on; the LWS pods take their node rank, node count and head from LWS."""
    lws_env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "pipeline-tp-0.pipeline-tp"}
    servers = 0
    for obj in objects(path):
        for template in pod_templates(obj):
            for container in template["spec"]["containers"]:
                argv = serve_args(container, lws_env)
                if argv is None:
                    continue
                servers += 1
                args = build_parser().parse_args(argv)
                if obj["kind"] == "LeaderWorkerSet":
                    assert (args.nnodes, args.node_rank, args.master_addr) == (2, 1, "pipeline-tp-0.pipeline-tp")
                    assert args.tensor_parallel_size == 2
                if (
                    obj["kind"] == "LeaderWorkerSet"
                    and template is obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
                ):
                    continue  # no HTTP server on a worker node
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert ports["http"] == args.port and args.host == "0.0.0.0"
                assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
                notes = template["metadata"]["annotations"]
                assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
                assert int(notes["prometheus.io/port"]) == args.port
    assert servers == (2 if "leaderworkerset" in path.name else 1)


def test_the_router_finds_the_replicas_by_their_label():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in objects(DEPLOY / "replicas-router.yaml")}
    replicas = objs["Deployment", "pipeline-serve"]["spec"]["template"]["metadata"]["labels"]
    router = shlex.split(objs["Deployment", "sglang-router"]["spec"]["template"]["spec"]["containers"][0]["args"][0])
    selector = router[router.index("--selector") + 1]
    key, value = selector.split("=")
    assert replicas[key] == value
    assert router[router.index("--policy") + 1] == "cache_aware"
    assert int(router[router.index("--service-discovery-port") + 1]) == 8000
    rules = objs["Role", "sglang-router-discovery"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
