"""The deployment recipes in deploy/ parse, and every command in them (and in the README.txt
of `rollart cluster init`) parses with rollart's real argument parsers; the KEDA objects name
the stream and consumer rollart creates for the run they are about."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest
import yaml

from rollart import messages as m
from rollart.app.cli import build_parser
from rollart.app.cli import main as rollart_main
from rollart.config import RunConfig, load
from rollart.config.schema import NatsConfig, NodeConfig
from rollart.app.node import _parser as node_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_k8s() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in _docs(p)]


def check_command(words: list[str], where: str) -> None:
    """Parse ``words`` (``rollart ...`` or ``python -m rollart.node ...``) with the real parser."""
    if "-m" in words and words[words.index("-m") + 1] == "rollart.node":
        parser, args = node_parser(), words[words.index("-m") + 2:]
    elif Path(words[0]).name == "rollart":
        if words[1:2] == ["node"]:
            parser, args = node_parser(), words[2:]
        else:
            parser, args = build_parser(), words[1:]
    else:
        raise AssertionError(f"{where}: not a rollart command: {words}")
    try:
        parser.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"{where}: {shlex.join(words)!r} does not parse (exit {e.code})") from None


def text_commands(text: str) -> list[list[str]]:
    """``rollart ...`` / ``python -m rollart.node ...`` lines of code blocks, and inline
    ``\\`rollart ... --flag\\``` spans (a bare ``\\`rollart secure init\\``` names a command)."""
    found = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("rollart ") or s.startswith("python -m rollart.node "):
            found.append(shlex.split(s, comments=True))
    for span in re.findall(r"`((?:rollart|python -m rollart\.node) [^`]*)`", text):
        if " --" in span:
            found.append(shlex.split(span))
    return found


def test_yaml_parses_and_names_known_kinds():
    kinds = {d["kind"] for d in all_k8s()}
    assert {"StatefulSet", "Deployment", "ScaledObject", "ConfigMap", "Service"} <= kinds
    for d in all_k8s():
        assert d["apiVersion"] and d["metadata"]["name"]


def k8s_run_config(tmp_path) -> RunConfig:
    (cm,) = [d for d in all_k8s() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rollart-config"]
    path = tmp_path / "run.yaml"
    path.write_text(cm["data"]["run.yaml"])
    return load(path, RunConfig)


def deployments() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in all_k8s() if d["kind"] == "Deployment"}


def node_args(dep: dict) -> list[str]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return [*c["command"], *c["args"]]


def test_k8s_commands_parse_and_config_loads(tmp_path):
    cfg = k8s_run_config(tmp_path)
    assert cfg.node.stream_replicas == 3 and len(cfg.nats.urls) == 3
    deps = deployments()
    assert {"rollart-generate", "rollart-env", "rollart-trainer"} <= set(deps)
    for name, dep in deps.items():
        words = node_args(dep)
        check_command(words, f"Deployment {name}")
        args = node_parser().parse_args(words[3:])
        assert args.config == "/etc/rollart/run.yaml"
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > cfg.node.grace, f"{name}: terminationGracePeriodSeconds <= node.grace"
    from rollart.node.build import role_pool

    for name, dep in deps.items():  # each pod's pool serves its roles under mapping:
        args = node_parser().parse_args(node_args(dep)[3:])
        for role in args.roles.split(","):
            assert role_pool(cfg, role, args.pool) == args.pool, (name, role)


def test_nats_statefulset_is_a_three_server_cluster():
    docs = _docs(K8S / "nats-statefulset.yaml")
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert sts["spec"]["replicas"] == 3
    conf = cm["data"]["nats.conf"]
    svc = sts["spec"]["serviceName"]
    ns = sts["metadata"]["namespace"]
    for i in range(3):
        assert f"nats-route://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc.cluster.local:6222" in conf
    assert "jetstream" in conf and "http_port: 8222" in conf
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == svc]
    assert headless["spec"]["clusterIP"] == "None"


def env_durable(run: str, pool: str) -> tuple[str, str]:
    """(durable, filter subject) of an EnvManager's rollout.requested consumer, from the
    actor's own handler table."""
    from rollart.actors.env.manager import EnvManager

    env = EnvManager.__new__(EnvManager)  # handlers() reads only these
    env.run, env.pool, env.settings = run, pool, {}
    (h,) = [h for h in env.handlers() if h.settings.subject == "rollout.requested"]
    return h.settings.durable, h.subject


def test_keda_names_the_real_stream_and_consumer(tmp_path):
    cfg = k8s_run_config(tmp_path)
    deps = deployments()
    env_pool = node_parser().parse_args(node_args(deps["rollart-env"])[3:]).pool
    durable, subject = env_durable(cfg.run, env_pool)
    assert subject == m.subject(cfg.run, "rollout.requested", env_pool)
    assert subject in [s.replace(">", env_pool) for s in m.stream_subjects(cfg.run, "work")]
    objs = _docs(K8S / "keda-scaledobjects.yaml")
    targets = set()
    for so in objs:
        assert so["kind"] == "ScaledObject"
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deps, f"{so['metadata']['name']} scales unknown Deployment {target}"
        targets.add(target)
        for t in so["spec"]["triggers"]:
            assert t["type"] == "nats-jetstream"
            md = t["metadata"]
            assert set(md) >= {"natsServerMonitoringEndpoint", "account", "stream", "consumer",
                               "lagThreshold"}
            assert md["stream"] == m.stream_name(cfg.run, "work")
            assert md["consumer"] == durable
            assert int(md["lagThreshold"]) > 0 and md["natsServerMonitoringEndpoint"].endswith(":8222")
    assert targets == {"rollart-env", "rollart-generate"}


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str
    unit.read_string((DEPLOY / "systemd" / "rollart-node.service").read_text())
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure" and svc["KillSignal"] == "SIGTERM"
    assert float(svc["TimeoutStopSec"]) > NodeConfig().grace
    words = shlex.split(svc["ExecStart"])
    check_command(words, "rollart-node.service ExecStart")
    args = node_parser().parse_args(words[3:])
    assert args.roles and args.pool and args.config
    assert "network-online.target" in unit["Unit"]["After"]


def test_readme_commands_parse():
    cmds = text_commands((DEPLOY / "README.md").read_text())
    assert len(cmds) >= 5
    for words in cmds:
        check_command(words, "deploy/README.md")


@pytest.mark.parametrize("hosts", [[], ["n1.example.org", "n2.example.org", "n3.example.org"]])
def test_cluster_readme_commands_parse(tmp_path, hosts):
    out = tmp_path / "c"
    flags = [a for h in hosts for a in ("--host", h)] or ["--servers", "3"]
    assert rollart_main(["cluster", "init", str(out), *flags]) == 0
    text = (out / "README.txt").read_text()
    cmds = text_commands(text)
    assert sum("--server-config" in w for w in cmds) == 3
    for words in cmds:
        check_command(words, "cluster README.txt")
    urls_line = next(line for line in text.splitlines() if line.strip().startswith("nats: {urls:"))
    nats = NatsConfig(**yaml.safe_load(urls_line)["nats"])
    assert len(nats.urls) == 3 and (not hosts or hosts[0] in nats.urls[0])
    node_line = next(line for line in text.splitlines() if line.strip().startswith("node: {"))
    assert NodeConfig(**yaml.safe_load(node_line)["node"]).stream_replicas == 3


def test_stream_replicas_is_validated():
    assert NodeConfig().stream_replicas == 1
    with pytest.raises(ValueError, match="node.stream_replicas"):
        NodeConfig(stream_replicas=0)
    with pytest.raises(ValueError, match="node.stream_replicas"):
        NodeConfig(stream_replicas=7)
