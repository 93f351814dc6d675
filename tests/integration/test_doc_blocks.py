"""Every shell block of README.md and docs/ run as written (issue 31), in the order the docs
give them, as a newcomer would paste them: every command must exit 0 and print what the docs
show after it (modulo numbers, spacing and ``...``: tests/docblocks.py). Blocks and commands
that need root, apt, systemd as PID 1 or a Jetson are listed with their reason in
tests/docblocks.py (NOT_RUN) and printed here as skipped.

The scene is real: an edged serving the default models as ``make run`` starts it (its own
socket; the tests' cloud, MLServer, as its cloud tier with the answer model), Mosquitto with
the fleet's TLS and ACLs, nginx as the CDN, ``edgefleet serve`` (with enrolment), and the node
``jetson-17`` (a cloudsync in fleet ``plant-7``, labelled as the README's cloudsync.toml) in
front of that edged. What the docs leave to the reader is done by the scene and said here:
the hosts, paths and placeholders of SUBSTITUTIONS become this run's, the files a command
names are put in its directory first (PREPARED), and a soak of ten minutes is two seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloudsync.fleet.enrolment import Issuer, write_crl
from cloudsync.protocol.manifest import file_entry
from tests.conftest import (
    CLOUD_MODEL,
    CLOUD_MODEL_B,
    MODELS,
    Cloud,
    Daemon,
    answer_model_config,
    linked_repository,
    skip_or_fail,
    wait_for,
)
from tests.docblocks import NOT_RUN, NOT_RUN_COMMANDS, ROOT, Command, every_block, unshown
from tests.fleetservice import TOKENS, FleetService
from tests.mosquitto import Broker, cloudsync_config, make_pki
from tests.nginx import SECRET, Cdn

NODES = ["jetson-17", "jetson-18"]
FOREVER = {"edgefleet --fleet plant-7 watch": 3.0}  # runs until stopped: seconds to watch it


def embedding() -> list[float]:
    return [0.05] * 384


@dataclass
class Scene:
    tmp: Path
    work: Path  # the shell's directory: samples/ and .venv/ are the checkout's
    edged: Daemon
    cloud: Cloud
    pki: Path
    broker: Broker
    cdn: Cdn
    service: FleetService
    env: dict[str, str] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)  # placeholders learned on the way
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)  # stopped by PID
    device: subprocess.Popen[Any] | None = None  # the device the README enrols

    # ---- what the docs leave to the reader -------------------------------------------------

    def substitutions(self) -> list[tuple[str, str]]:
        """(as the docs write it, as this run has it), in the order they apply."""
        mqtt = f"--host 127.0.0.1 --port {self.broker.port} --pki {self.pki}"
        node18 = self.tmp / "jetson-18"
        return [
            ("run/edged.sock", str(self.edged.socket)),
            ("/run/edged/edged.sock", str(self.edged.socket)),
            ("/run/edged/cloudsync.sock", str(node18 / "cloudsync.sock")),
            ("/etc/edged/cloudsync.toml", str(node18 / "cloudsync.toml")),
            ("--host mqtt.fleet.example --pki /etc/edged/fleet", mqtt),
            ("edgefleet --fleet plant-7", f"edgefleet {mqtt} --fleet plant-7"),
            ("https://fleet.example", self.service.url),
            ("http://127.0.0.1:8480", self.service.url),
            ("/etc/edgefleet/edgefleet.toml", str(self.service.config)),
            ("model.onnx=https://cdn.example/...", "model.onnx=" + self.values.get("url-6-m", "")),
            ("labels.txt=https://cdn.example/...", "labels.txt=" + self.values.get("url-6-l", "")),
            ("https://cdn.example", self.cdn.base),
            ("--soak 600", "--soak 2"),
            ("intent-classifier-v2", CLOUD_MODEL_B),
            ("EDGEFLEET_TOKEN=...", f"EDGEFLEET_TOKEN={TOKENS['operator']}"),
            ("approve 5f0c...", f"approve {self.values.get('pending', '')}"),
            ("--checkpoint 4100:9f2c...", f"--checkpoint {self.values.get('checkpoint', '')}"),
        ]

    def shell(self, command: Command) -> str:
        text = command.text
        for old, new in self.substitutions():
            text = text.replace(old, new)
        return text

    def run(self, command: Command) -> tuple[int, str, str]:
        """Exit code, stdout and stderr of one command (``&``: started, tracked, waited for)."""
        text = self.shell(command)
        if text.startswith("export "):
            name, value = text.split(None, 1)[1].split("#")[0].strip().split("=", 1)
            self.env[name] = value
            return 0, "", ""
        if text.rstrip().endswith("&"):
            return self.background(text.rstrip()[:-1])
        timeout = next((s for start, s in FOREVER.items() if command.text.startswith(start)), 0)
        try:
            done = subprocess.run(
                ["bash", "-c", text],
                cwd=self.work,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout or 180,
            )
        except subprocess.TimeoutExpired as stopped:
            out, err = (
                x.decode() if isinstance(x, bytes) else x or ""
                for x in (stopped.stdout, stopped.stderr)
            )
            return (0 if timeout else 124), out, err
        return done.returncode, done.stdout, done.stderr

    def background(self, text: str) -> tuple[int, str, str]:
        if " serve " in text:  # the service the scene ran until now gives way to this one
            self.service.stop()
        log = (self.tmp / f"background-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen(
            ["bash", "-c", "exec " + text],
            cwd=self.work,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        if " serve " in text:
            self.service.proc = proc  # stopped with the scene
            wait_for(
                lambda: self.service.call("GET", "/healthz")[0] == 200,
                30,
                "the README's edgefleet serve",
                proc,
            )
        else:  # cloudsync: its local API
            wait_for((self.tmp / "jetson-18" / "cloudsync.sock").exists, 30, "cloudsync", proc)
        return 0, "", ""

    # ---- parts started when a block needs them ---------------------------------------------

    def node(self, name: str, edged: Path | None, labels: str = "") -> Path:
        """A cloudsync config for ``name`` in fleet plant-7 (heartbeats each second; downloads
        into edged's staging from the CDN); its work directory."""
        work = self.tmp / name
        (work / "trust").mkdir(parents=True, exist_ok=True)
        for key in ("fleet-1.pub", "deploy-1.pub", "deploy-1.commands"):
            if (self.work / key).exists():
                shutil.copy(self.work / key, work / "trust" / key)
        more = (
            "[heartbeat]\ninterval_s = 1\n[telemetry]\ninterval_s = 1\n[delivery]\n"
            f'staging_dir = "{self.edged.workdir / "state" / "staging"}"\n'
            f'ca_file = "{self.pki}/ca.pem"\nhealth_window_s = 0\n'
        )
        text = cloudsync_config(self.broker, work, "plant-7", name, edged, more=more)
        text = text.replace(f'name = "{name}"\n', f'name = "{name}"\n{labels}\n')
        (work / "cloudsync.toml").write_text(text)
        return work

    def retire_device(self) -> None:
        """The enrolled device leaves (its example is over): it has no edged and no fleet key,
        and a rollout to the fleet's online nodes would stop at its refusal."""
        assert self.device is not None
        state = lambda: self.service.call("GET", "/v1/nodes/jetson-43")[1].get("state")  # noqa: E731
        wait_for(lambda: state() == "online", 30, "jetson-43 approved and online", self.device)
        self.device.kill()
        self.device.wait()
        wait_for(lambda: state() == "offline", 30, "jetson-43 offline")

    def cloudsync(self, work: Path) -> subprocess.Popen[bytes]:
        """cloudsync on ``work/cloudsync.toml``, its output in ``work/cloudsync.log``; stopped
        with the harness."""
        with (work / "cloudsync.log").open("wb") as log:
            argv = [sys.executable, "-m", "cloudsync.agent.cli", "--config"]
            proc = subprocess.Popen([*argv, str(work / "cloudsync.toml")], stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def start_node(self) -> None:
        """jetson-17, in front of edged, trusting the fleet key the README's keygen made."""
        labels = 'labels = { site = "berlin", tier = "camera" }'
        work = self.node("jetson-17", self.edged.socket, labels)
        proc = self.cloudsync(work)
        online = lambda: self.service.call("GET", "/v1/nodes/jetson-17")[1]  # noqa: E731
        # online, with edged's models in a heartbeat: the block lists them (the first heartbeats
        # may come before edged has loaded them, and say "-")
        wait_for(
            lambda: (
                isinstance(online(), dict)
                and online().get("state") == "online"
                and bool(online().get("models"))
            ),
            30,
            "jetson-17 online, its models listed",
            proc,
        )

    def pending_device(self) -> None:
        """A new device with the claim credential and no token: pending until approved."""
        work = self.tmp / "jetson-43"
        work.mkdir()
        enrol = (
            f'[enrol]\nclaim_cert = "{self.pki}/claim.pem"\nclaim_key = "{self.pki}/claim.key"\n'
        )
        text = cloudsync_config(
            self.broker, work, "plant-7", "jetson-43", more=f"[heartbeat]\ninterval_s = 1\n{enrol}"
        )
        text = text.replace(f"{self.pki}/jetson-43.pem", f"{work}/device.pem")
        text = text.replace(f"{self.pki}/jetson-43.key", f"{work}/device.key")
        (work / "cloudsync.toml").write_text(text)
        proc = self.cloudsync(work)
        self.device = proc

        def pending() -> bool:
            _, rows = self.service.call("GET", "/v1/enrolments?state=pending")
            found = [r for r in rows["enrolments"] if r["node"] == "jetson-43"]
            if found:
                self.values["pending"] = found[0]["rid"]
            return bool(found)

        wait_for(pending, 30, "jetson-43's request, pending", proc)

    # ---- the files and state a block's commands name ---------------------------------------

    def version_files(self) -> None:
        """model.onnx and labels.txt (intent-classifier's), smoke.json, cdn.secret; version 7
        on the CDN where --cdn-prefix says, version 6 behind a signed URL."""
        source = MODELS / "intent-classifier" / "1"
        for name in ("model.onnx", "labels.txt"):
            shutil.copy(source / name, self.work / name)
            for version in (6, 7):
                self.cdn.put(f"intent-classifier/{version}/{name}", (source / name).read_bytes())
        case = {
            "inputs": [
                {"name": "embedding", "datatype": "FP32", "shape": [1, 384], "data": embedding()}
            ],
            "outputs": [],
        }
        (self.work / "smoke.json").write_text(json.dumps([case]))
        (self.work / "cdn.secret").write_text(SECRET)
        (self.work / "config.pbtxt").write_text(
            (MODELS / "intent-classifier" / "config.pbtxt")
            .read_text()
            .replace('name: "intent-classifier"', 'name: "fraud"')
        )
        (self.work / "edged_0.2.0_arm64.deb").write_bytes(b"!<arch>\n")  # named, not installed

    def m6(self) -> None:
        """m6.json: the version the deployment starts from, signed as the README signs m7."""
        done = subprocess.run(
            [
                "edgefleet",
                "manifest",
                "--model",
                "intent-classifier",
                "--version",
                "6",
                "--file",
                "model.onnx",
                "--file",
                "labels.txt",
                "--sign",
                "fleet-1=fleet-1.key",
                "--smoke",
                "smoke.json",
                "--out",
                "m6.json",
            ],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        from cloudsync.fleet.common import secure_link_url

        for name, key in (("model.onnx", "url-6-m"), ("labels.txt", "url-6-l")):
            url = f"/models/intent-classifier/6/{name}"
            self.values[key] = shlex.quote(secure_link_url(self.cdn.base, url, SECRET, 3600))

    def second_version(self) -> None:
        """intent-classifier version 2 (version 1's files), installed as any admin installs."""
        staged = self.edged.workdir / "state" / "staging" / "ic-2"
        staged.mkdir(parents=True)
        for name in ("model.onnx", "labels.txt"):
            shutil.copy(MODELS / "intent-classifier" / "1" / name, staged / name)
        files = [file_entry(staged / n) for n in ("model.onnx", "labels.txt")]
        self.edged.client.install("intent-classifier", 2, str(staged), files)

    def cloud_call(self) -> None:
        """A cloud call with the request id the README lists; a checkpoint of the ledger."""
        self.edged.client.infer_answer(
            CLOUD_MODEL,
            {"embedding": np.array([embedding()], np.float32)},
            request_id="req-17",
            parameters={"route": "cloud"},
        )
        head = self.edged.client.egress(limit=1)["head"]
        self.values["checkpoint"] = f"{head['seq']}:{head['hash']}"
        (self.work / "request-body.bin").write_bytes(b"{}")

    def keys_for_the_trust_document(self) -> None:
        """The new fleet key the README rotates to, and certificates to revoke."""
        if not (self.work / "fleet-2.pub").exists():
            subprocess.run(
                ["edgefleet", "keygen", "--kid", "fleet-2"],
                cwd=self.work,
                env=self.env,
                check=True,
                capture_output=True,
            )
        for name in ("old-cdn.pem", "old-broker.pem"):
            shutil.copy(self.pki / "rogue.pem", self.work / name)

    def resume(self) -> None:
        """The device back in service after the fan swap the README drained it for."""
        self.edged.client.resume()

    def hooks(self) -> dict[str, Callable[[], None]]:
        """Before the command that starts so (as the docs write it): what the scene does."""
        return {
            "edgectl routing set local_threshold_ms=50": self.second_version,
            "edgefleet --service https://fleet.example enrol list": self.pending_device,
            "edgefleet keygen --kid fleet-1": self.retire_device,
            "edgefleet --host mqtt.fleet.example": self.start_node,
            "edgefleet manifest --model intent-classifier --version 7": self.version_files,
            "edgefleet trust make": self.keys_for_the_trust_document,
            "cloudsync --config": lambda: self.node("jetson-18", self.edged.socket) and None,
            "edgefleet --service http://127.0.0.1:8480 deploy create": self.m6,
            "edgectl egress list": self.cloud_call,
            "curl --unix-socket run/edged.sock http://localhost/v2/models/text-embedding": (
                self.resume
            ),
        }


@pytest.fixture
def scene(tmp_path: Path, make_daemon: type[Daemon], cloud: Cloud) -> Iterator[Scene]:
    for why in (Broker.available(), Cdn.available()):
        if why:
            skip_or_fail(why)
    work = tmp_path / "shell"
    work.mkdir()
    for name in ("samples", ".venv"):
        (work / name).symlink_to(ROOT / name)
    (work / "admin.token").write_text(TOKENS["admin"])  # the README revokes as an admin
    repository = linked_repository(tmp_path / "models")
    (repository / "intent-classifier").unlink()  # a copy: versions are installed into it
    shutil.copytree(MODELS / "intent-classifier", repository / "intent-classifier")
    old = repository / "old-detector"  # the model the README removes
    shutil.copytree(MODELS / "intent-classifier", old)
    config = old / "config.pbtxt"
    config.write_text(config.read_text().replace('"intent-classifier"', '"old-detector"'))
    # as `make run` starts it: whoever runs make (root here), from the checkout
    edged = make_daemon(repository, config=answer_model_config(cloud), as_unit=False).start()
    pki = make_pki(tmp_path / "pki", NODES)
    crl = tmp_path / "fleet.crl"
    write_crl(Issuer(pki / "ca.pem", pki / "ca.key", 1), [], int(time.time() * 1000), crl)
    broker = Broker(tmp_path / "mosquitto", pki, crl_file=crl).start()
    cdn = Cdn(tmp_path / "cdn", pki).start()
    env = {
        **os.environ,
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
        "EDGED_SOCKET": str(edged.socket),
        "EDGEFLEET_TOKEN": TOKENS["admin"],
    }
    # the deploy key the README's fleet service prose makes (nodes trust it for its scope)
    subprocess.run(
        [
            "edgefleet",
            "keygen",
            "--kid",
            "deploy-1",
            "--commands",
            "rollback",
            "--commands",
            "cloud-ab",
        ],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
    )
    enrolment = (
        f'[enrolment]\nca_cert = "{pki}/ca.pem"\nca_key = "{pki}/ca.key"\ncrl_file = "{crl}"\n'
    )
    service = FleetService(
        tmp_path / "service",
        broker,
        fleet="plant-7",
        sections=enrolment,
        more=f'deploy_key = "{work / "deploy-1.key"}"\ntrust_dir = "{work}"',
    )
    service.writes(crl)
    service.reads(work / "deploy-1.key")  # the package's root:edgefleet 0640
    service.start()
    scene = Scene(tmp_path, work, edged, cloud, pki, broker, cdn, service, env)
    try:
        yield scene
    finally:
        for proc in reversed(scene.procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for part in (service, cdn, broker):
            part.stop() if isinstance(part, Cdn) else part.kill()


def the_quick_start_says(outputs: dict[str, str]) -> None:
    """What the README's quick start says its commands print (it shows no output)."""
    assert outputs["ready"].strip() == "200"
    assert '"intent"' in outputs["intent"]
    assert "ready" in outputs["status"]
    assert "cosine similarity" in outputs["embed"]
    assert "Total: $1,234.50" in outputs["ocr"] and "INVOICE" in outputs["ocr"], outputs["ocr"]
    (segment,) = re.findall(r"([\d.]+) s -> +([\d.]+) s", outputs["vad"])  # speech: 0.65-1.89 s
    assert abs(float(segment[0]) - 0.65) < 0.15 and abs(float(segment[1]) - 1.89) < 0.15


def test_every_shell_block_of_the_docs_runs_as_written(scene: Scene) -> None:
    failed: list[str] = []
    hooks = scene.hooks()
    ran = 0
    quick: dict[str, str] = {}
    for block in every_block():
        if block.key in NOT_RUN:
            print(f"SKIPPED {block.path}:{block.line}: {NOT_RUN[block.key]}")
            continue
        for command in block.commands:
            where = f"{block.path}:{command.line}: {command.text}"
            why = next((w for s, w in NOT_RUN_COMMANDS.items() if command.text.startswith(s)), "")
            if why:
                print(f"SKIPPED {where}: {why}")
                continue
            for start, hook in hooks.items():
                if command.text.startswith(start):
                    hook()
            code, out, err = scene.run(command)
            print(f"$ {command.text}\n-> {code}: {out[:400]}{err[:400]}")
            ran += 1
            missing = unshown(command.shown, out)
            missing = unshown(missing, err) if missing else []
            if code != 0 or missing:
                failed.append(
                    f"{where}\n  exit {code}; not shown: {missing}\n  stdout: "
                    f"{out[-1500:]}\n  stderr: {err[-1500:]}"
                )
            if block.path == "README.md" and block.line < 60:
                quick[quick_name(command)] = out
    the_quick_start_says(quick)
    print(f"{ran} commands ran")
    assert not failed, "\n".join(failed)
    assert ran >= 60


def quick_name(command: Command) -> str:
    if "health/ready" in command.text:
        return "ready"
    if "/v1/intent" in command.text:
        return "intent"
    return command.text.split("edged.sock", 1)[1].split()[0]
