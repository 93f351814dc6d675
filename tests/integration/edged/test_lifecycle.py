"""Start, readiness, systemd notification and activation, drain on SIGTERM, reload on SIGHUP."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edged.client import Client, ClientError, UnixHTTPConnection
from tests.asunit import reachable
from tests.conftest import (
    MODELS,
    Daemon,
    copy_model,
    linked_repository,
    skip_or_fail,
    wait_for,
)

SMALL = ["intent-classifier"]  # a model that loads in milliseconds


def test_ready_is_503_until_the_models_are_loaded(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repo = linked_repository(tmp_path / "repo", ["text-encoder"])
    encoder = copy_model(repo, "text-encoder")
    # Triton's model_warmup makes loading take seconds, so the window is wide and certain.
    inputs = ", ".join(
        f'{{ key: "{name}" value: {{ data_type: TYPE_INT64 dims: [ 128 ] zero_data: true }} }}'
        for name in ("input_ids", "attention_mask", "token_type_ids")
    )
    with (encoder / "config.pbtxt").open("a") as f:
        f.write(f'model_warmup [ {{ name: "slow" batch_size: 64 count: 2 inputs [ {inputs} ] }} ]')
    daemon = make_daemon(repo).start(wait=False)
    client = daemon.client
    wait_for(lambda: daemon.socket.exists() and client.live(), 60, "live", daemon.proc)
    assert client.ready() is False
    states = {(m["name"], m.get("version")): m["state"] for m in client.status()["models"]}
    assert states.get(("text-encoder", "1")) == "LOADING", states
    not_ready = subprocess.run(
        [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), "status"],
        capture_output=True,
        check=False,
    )
    assert not_ready.returncode == 5 and b"NOT READY" in not_ready.stdout
    status, _, _ = client.request("GET", "/v2/models/text-encoder/ready")
    assert status == 503
    with pytest.raises(ClientError) as error:
        client.infer("text-encoder", {"input_ids": np.ones((1, 4), np.int64)})
    assert error.value.status == 503 and "loading" in error.value.message
    daemon.wait_ready()
    assert client.request("GET", "/v2/models/text-encoder/ready")[0] == 200
    assert daemon.stop() == 0


def notify_socket(path: Path) -> socket.socket:
    """A notify socket as systemd's own: any service may write to it (/run/systemd/notify)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    path.chmod(0o777)
    reachable(path)
    sock.settimeout(60)
    return sock


def receive_until(sock: socket.socket, wanted: str, timeout: float = 60) -> list[str]:
    """Datagrams from the notify socket until ``wanted`` arrives, within ``timeout`` in all."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {wanted} within {timeout} s; got {seen}")
        sock.settimeout(remaining)
        seen += sock.recv(4096).decode().splitlines()
    return seen


def test_notifies_systemd_ready_watchdog_and_stopping(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    sock = notify_socket(tmp_path / "notify.sock")
    daemon = make_daemon(linked_repository(tmp_path / "repo", SMALL))
    daemon.start(
        env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"}, wait=False
    )
    seen = receive_until(sock, "READY=1")
    assert "STATUS=loading models" in seen
    assert any(line.startswith("STATUS=serving 1 of 1") for line in seen)
    assert daemon.client.ready()
    receive_until(sock, "WATCHDOG=1")
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert "RELOADING=1" in receive_until(sock, "READY=1")
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    receive_until(sock, "STOPPING=1")
    assert daemon.proc.wait(60) == 0  # type: ignore[union-attr]


def test_runs_under_systemd_socket_activate(make_daemon: type[Daemon], tmp_path: Path) -> None:
    tool = "/usr/bin/systemd-socket-activate"
    if not os.path.exists(tool):
        skip_or_fail(f"{tool} is missing: install the systemd package (make test does)")
    daemon = make_daemon(linked_repository(tmp_path / "repo", SMALL))
    activated = tmp_path / "activated.sock"
    command = [tool, "-l", str(activated), *daemon.command()]
    with daemon.log.open("ab") as log:
        daemon.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    wait_for(activated.exists, 30, "the activation socket", daemon.proc)
    client = Client(str(activated), timeout=60)
    assert client.live()  # the first connection starts edged on the passed socket
    wait_for(client.ready, 60, "READY", daemon.proc)
    assert not daemon.socket.exists()  # it did not bind its own
    assert "using the socket passed by systemd" in daemon.logs()
    assert daemon.stop() == 0


def test_sigterm_answers_all_50_requests_in_flight_and_exits_0(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    # A generous drain timeout: on a loaded machine 50 requests of 64 texts take long to finish,
    # and this test is about answering them all, not about how fast.
    config = '[server]\ndrain_timeout_s = 300\n[models]\nload = ["text-embedding"]\n'
    daemon = make_daemon(config=config).start()
    texts = [
        f"sentence number {i} about edge inference on small devices, batched" * 2 for i in range(64)
    ]
    results: list[int] = []
    lock = threading.Lock()

    def call() -> None:
        try:
            daemon.client.embed(texts)
            status = 200
        except ClientError as exc:
            status = exc.status
        with lock:
            results.append(status)

    threads = [threading.Thread(target=call) for _ in range(50)]
    for t in threads:
        t.start()
    inflight = 0

    def all_accepted() -> bool:
        nonlocal inflight
        inflight = daemon.client.status()["inflight"] - 1  # minus the status call itself
        with lock:
            return inflight + len(results) >= 50

    wait_for(all_accepted, 60, "50 requests accepted", daemon.proc)
    kept = UnixHTTPConnection(str(daemon.socket), timeout=60)  # a keep-alive connection
    kept.request("GET", "/v2/health/ready")
    assert kept.getresponse().read() == b"" and kept.sock is not None
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

    def draining() -> bool:
        kept.request("GET", "/v2/health/ready")
        response = kept.getresponse()
        response.read()
        return response.status == 503

    wait_for(draining, 30, "ready to turn 503 on SIGTERM", daemon.proc)
    kept.close()
    for t in threads:
        t.join(300)
    print(f"{inflight} requests in flight at SIGTERM")
    assert inflight >= 10, "too few requests were in flight to test draining"
    assert results == [200] * 50
    assert daemon.proc.wait(300) == 0  # type: ignore[union-attr]
    assert not daemon.socket.exists()


def test_a_truncated_onnx_file_makes_only_that_model_unavailable(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repo = linked_repository(tmp_path / "repo", ["text-encoder", "text-embedding", *SMALL])
    model = copy_model(repo, "text-encoder") / "1" / "model.onnx"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    daemon = make_daemon(repo).start()
    client = daemon.client
    index = {row["name"]: row for row in client.repository_index()}
    assert index["text-encoder"]["state"] == "UNAVAILABLE"
    assert "ONNX Runtime cannot load" in index["text-encoder"]["reason"]
    assert index["text-embedding"]["state"] == "UNAVAILABLE"
    assert "step model 'text-encoder' is unavailable" in index["text-embedding"]["reason"]
    with pytest.raises(ClientError) as error:
        client.embed(["hello"])
    assert error.value.status == 503 and "text-encoder" in error.value.message
    assert client.request("GET", "/v2/models/text-encoder/ready")[0] == 503
    # the others serve
    out = client.infer("intent-classifier", {"embedding": np.zeros((1, 384), np.float32)})
    assert out["probabilities"].shape[0] == 1
    assert daemon.stop() == 0


def test_sighup_loads_new_models_and_unloads_removed_ones(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repo = linked_repository(tmp_path / "repo", SMALL)
    # The flag overrides the file, at start and again on every reload.
    config = '[log]\nlevel = "warning"\n'
    daemon = make_daemon(repo, config, flags=("--log-level", "debug")).start()
    (repo / "vad-silero").symlink_to(MODELS / "vad-silero", target_is_directory=True)
    (repo / "intent-classifier").unlink()
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]

    def reloaded() -> bool:
        index = {row["name"]: row["state"] for row in daemon.client.repository_index()}
        return index == {"vad-silero": "READY"}

    wait_for(reloaded, 60, "the reload", daemon.proc)
    assert daemon.client.live()
    after = daemon.logs().split("reloaded the configuration", 1)[1]
    assert "GET /v2/health/live -> 200" in after, "--log-level debug was lost on SIGHUP"
    assert daemon.stop() == 0


def test_repository_load_and_unload(make_daemon: type[Daemon], tmp_path: Path) -> None:
    daemon = make_daemon(linked_repository(tmp_path / "repo", SMALL)).start()
    client = daemon.client
    client.unload("intent-classifier")
    assert client.request("GET", "/v2/models/intent-classifier/ready")[0] == 503
    client.load("intent-classifier")
    assert client.request("GET", "/v2/models/intent-classifier/ready")[0] == 200
    with pytest.raises(ClientError) as error:
        client.load("no-such-model")
    assert error.value.status == 404
    assert daemon.stop() == 0


def test_socket_is_0660_and_callers_are_checked_by_peer_credentials(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    other = os.getuid() + 4242
    daemon = make_daemon(
        linked_repository(tmp_path / "repo", SMALL), config=f"[server]\nallowed_uids = [{other}]\n"
    ).start(wait=False)
    wait_for(daemon.socket.exists, 60, "the socket", daemon.proc)
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    status, _, body = daemon.client.request("GET", "/v2/health/live")
    assert status == 403
    assert f"uid {os.getuid()}" in body.decode()
    assert daemon.stop() == 0
    allowed = make_daemon(
        linked_repository(tmp_path / "repo2", SMALL),
        config=f"[server]\nallowed_uids = [{other}]\nallowed_gids = [{os.getgid()}]\n",
    ).start()
    assert allowed.client.live()
    assert allowed.stop() == 0


def test_a_second_daemon_refuses_a_socket_in_use(make_daemon: type[Daemon], tmp_path: Path) -> None:
    first = make_daemon(linked_repository(tmp_path / "repo", SMALL)).start()
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "edged",
            "--socket",
            str(first.socket),
            "--models",
            str(first.models),
            "--state-dir",
            str(tmp_path / "s2"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "already serving" in second.stderr
    assert first.client.ready()
    assert first.stop() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--socket", "/tmp/" + "s" * 120 + ".sock"], "longer than the 107 bytes"),
        (["--models", "/nonexistent/models"], "models.repository /nonexistent/models is not"),
    ],
)
def test_start_up_fails_fast_with_a_clear_error(
    tmp_path: Path, args: list[str], message: str
) -> None:
    base = ["--socket", str(tmp_path / "e.sock"), "--models", str(MODELS)]
    done = subprocess.run(
        [sys.executable, "-m", "edged", *base, "--state-dir", str(tmp_path / "state"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert message in done.stderr


def test_a_broken_new_version_or_config_on_sighup_keeps_the_old_one_serving(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    sock = notify_socket(tmp_path / "notify.sock")
    repo = linked_repository(tmp_path / "repo", SMALL)
    model = copy_model(repo, "intent-classifier")
    daemon = make_daemon(repo).start(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    receive_until(sock, "READY=1")
    probe = {"embedding": np.zeros((1, 384), np.float32)}
    before = daemon.client.infer("intent-classifier", probe)["probabilities"]

    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes(b"not an onnx file")
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    receive_until(sock, "READY=1")
    index = {(r["name"], r.get("version")): r for r in daemon.client.repository_index()}
    assert index[("intent-classifier", "1")]["state"] == "READY"
    assert index[("intent-classifier", "2")]["state"] == "UNAVAILABLE"
    after = daemon.client.infer("intent-classifier", probe)["probabilities"]
    np.testing.assert_array_equal(before, after)

    (model / "config.pbtxt").write_text("this is { not a config")
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    receive_until(sock, "READY=1")
    assert daemon.client.request("GET", "/v2/models/intent-classifier/ready")[0] == 200
    assert "still serving the previous configuration" in daemon.logs()

    # An edged.toml that no longer validates keeps the old settings; the repository is polled.
    daemon.config.write_text("[server]\nno_such_key = 1\n")
    (repo / "vad-silero").symlink_to(MODELS / "vad-silero", target_is_directory=True)
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    receive_until(sock, "READY=1")
    assert "keeping the previous configuration" in daemon.logs()
    assert "no_such_key" in daemon.logs()
    assert daemon.client.request("GET", "/v2/models/vad-silero/ready")[0] == 200
    assert daemon.stop() == 0


def test_a_pipeline_is_not_ready_while_a_step_model_is_unloaded(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    daemon = make_daemon(config='[models]\nload = ["intent"]\n').start()
    client = daemon.client
    client.unload("intent-classifier")
    assert client.request("GET", "/v2/models/intent/ready")[0] == 503
    with pytest.raises(ClientError) as error:
        client.intent(["hello"])
    assert error.value.status == 503
    assert "step model 'intent-classifier' is unavailable" in error.value.message
    rows = {r["name"]: r for r in client.repository_index()}
    assert rows["intent"]["state"] == "UNAVAILABLE"
    client.load("intent-classifier")
    assert client.intent(["hello"])[0]["intent"]
    assert daemon.stop() == 0


def test_a_pipeline_naming_an_unknown_class_fails_alone(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repo = linked_repository(tmp_path / "repo", SMALL)
    (repo / "odd").mkdir()
    (repo / "odd" / "1").mkdir()
    (repo / "odd" / "config.pbtxt").write_text(
        'backend: "pipeline"\nparameters { key: "pipeline" value { string_value: "nope" } }\n'
    )
    (repo / "latin1").mkdir()
    (repo / "latin1" / "config.pbtxt").write_bytes(b'platform: "onnxruntime_onnx" # caf\xe9\n')
    daemon = make_daemon(repo).start()
    rows = {r["name"]: r for r in daemon.client.repository_index()}
    assert rows["intent-classifier"]["state"] == "READY"
    assert "pipeline='nope' is not one of" in rows["odd"]["reason"]
    assert "not UTF-8" in rows["latin1"]["reason"]
    assert daemon.stop() == 0


def test_a_hung_daemon_stops_its_watchdog_pings(make_daemon: type[Daemon], tmp_path: Path) -> None:
    """The test acts as systemd's manager with WatchdogSec=1: edged pings every 0.5 s; a hang of
    its event loop (the test hook: SIGUSR2 wedges it for 3 s) leaves the manager more than
    WatchdogSec without a ping, which is when systemd kills and restarts the service."""
    sock = notify_socket(tmp_path / "notify.sock")
    daemon = make_daemon(linked_repository(tmp_path / "repo", SMALL))
    env = {
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        "WATCHDOG_USEC": "1000000",
        "EDGED_TEST_HOOKS": "1",
        "EDGED_TEST_HANG_S": "3",
    }
    daemon.start(env=env, wait=False)
    receive_until(sock, "READY=1")
    pings: list[float] = []

    def watch(seconds: float) -> None:
        sock.settimeout(0.1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                if b"WATCHDOG=1" in sock.recv(4096):
                    pings.append(time.monotonic())
            except TimeoutError:
                pass

    watch(2.0)
    steady = max(b - a for a, b in itertools.pairwise(pings))
    assert steady < 1.0, f"pings every {steady:.2f} s at most while healthy"
    daemon.proc.send_signal(signal.SIGUSR2)  # type: ignore[union-attr]
    hung_at = time.monotonic()
    watch(5.0)
    after = [t for t in pings if t > hung_at]
    # (one ping may already have been on its way when the signal came)
    gap = max(b - a for a, b in itertools.pairwise([hung_at, *after]))
    assert gap > 2.5, "no ping while hung: the manager's watchdog fires"
    assert len(after) >= 3, "and they come back once it is not"
    assert daemon.stop() == 0


def test_the_watchdogs_sigabrt_leaves_the_hung_stack_in_the_log(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """systemd's watchdog kills a hung service with SIGABRT: edged's stacks go to stderr (the
    journal) first, the main thread's showing where the event loop is stuck."""
    daemon = make_daemon(linked_repository(tmp_path / "repo", SMALL))
    daemon.start(env={"EDGED_TEST_HOOKS": "1", "EDGED_TEST_HANG_S": "60"})
    proc = daemon.proc
    assert proc is not None
    proc.send_signal(signal.SIGUSR2)
    time.sleep(0.5)  # the loop is in the hook's sleep
    proc.send_signal(signal.SIGABRT)
    assert proc.wait(30) == -signal.SIGABRT
    log = daemon.logs()
    assert "Fatal Python error: Aborted" in log
    stack = log[log.index("Current thread") :]
    # the event loop's frames (uvloop's run, asyncio's run_forever) and edged's own
    assert ("uvloop" in stack or "run_forever" in stack) and "edged/cli.py" in stack


def test_an_old_section_name_is_served_and_warned_at_start_and_on_sighup(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """A file that still says [load] (now [device]) starts edged, with a warning in its log; a
    reload of it warns again; the file renamed, the warnings stop."""
    sock = notify_socket(tmp_path / "notify.sock")
    daemon = make_daemon(config="[load]\ninterval_s = 0.5\n")
    daemon.start(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    receive_until(sock, "READY=1")
    warning = '"message":"config: load is now device: rename it'  # a JSON log line's message
    assert daemon.logs().count(warning) == 1, daemon.logs()
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    receive_until(sock, "READY=1")
    assert daemon.logs().count(warning) == 2
    daemon.config.write_text("[device]\ninterval_s = 0.5\n")
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    receive_until(sock, "READY=1")
    assert daemon.logs().count(warning) == 2 and "keeping the previous" not in daemon.logs()
    assert daemon.stop() == 0
