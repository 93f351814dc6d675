"""Delivery's decisions without a network: which URLs are taken, what a failure is reported as
(no local detail), and the state file (floors only go up, an older outbox's floors move in
once, a corrupt file fails closed). The outbox is a real SQLite one."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
from email.message import Message
from pathlib import Path

import pytest

from cloudsync.agent.delivery_state import DeliveryState, StateError
from cloudsync.agent.download import REDIRECT, DeliveryError, category
from cloudsync.agent.download import check_url as check
from cloudsync.agent.outbox import Outbox


@pytest.mark.parametrize(
    "url",
    [
        "https://cdn.example/m/7/model.onnx?md5=x&expires=1",
        "HTTPS://cdn.example:8443/m",
        "https://[2001:db8::1]/m",
    ],
)
def test_https_urls_are_taken(url: str) -> None:
    check(url)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("file:///var/lib/edged/models/m/1/model.onnx", "URL scheme 'file' refused: https only"),
        ("ftp://cdn.example/m", "URL scheme 'ftp' refused"),
        ("data:application/octet-stream;base64,AAAA", "URL scheme 'data' refused"),
        ("/m/7/model.onnx", "URL scheme '(none)' refused"),
        ("http://cdn.example/m", "plain http refused: https only"),
        ("http://127.0.0.1:8080/m", "plain http refused: https only"),
        ("https:///m", "the URL is not valid"),
        ("https://cdn.example:port/m", "the URL is not valid"),
        ("https://cdn.example/m\n", "the URL is not valid"),
    ],
)
def test_other_urls_are_refused_and_not_retried(url: str, says: str) -> None:
    with pytest.raises(DeliveryError, match=says.replace("(", r"\(").replace(")", r"\)")) as err:
        check(url)
    assert err.value.retry is False


@pytest.mark.parametrize(
    ("url", "taken"),
    [
        ("http://127.0.0.1:8080/m", True),
        ("http://127.9.9.9/m", True),
        ("http://[::1]:8080/m", True),
        ("http://localhost/m", True),
        ("http://LOCALHOST/m", True),
        ("http://127.0.0.1@cdn.example/m", False),  # the host is cdn.example
        ("http://localhost.cdn.example/m", False),
        ("http://10.0.0.1/m", False),
        ("http://[::ffff:127.0.0.1]/m", False),
    ],
)
def test_plain_http_with_the_setting_only_to_loopback(url: str, taken: bool) -> None:
    if taken:
        check(url, allow_http_loopback=True)
    else:
        with pytest.raises(DeliveryError, match="not loopback refused: https only"):
            check(url, allow_http_loopback=True)


def _http_error(code: int) -> urllib.error.HTTPError:
    headers = Message()
    headers["Location"] = "https://elsewhere.example/"
    return urllib.error.HTTPError("https://cdn.example/m", code, "reason", headers, None)


@pytest.mark.parametrize(
    ("exc", "what", "retry"),
    [
        (_http_error(302), REDIRECT, False),
        (_http_error(301), REDIRECT, False),
        (_http_error(404), "the server answered 404", False),
        (_http_error(410), "the server answered 410: the signed URL expired", False),
        (_http_error(503), "the server answered 503", True),
        (
            urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")),
            "cannot connect to the download server",
            True,
        ),
        (
            urllib.error.URLError(OSError(-2, "Name or service not known")),
            "cannot connect to the download server",
            True,
        ),
        (urllib.error.URLError(TimeoutError("timed out")), "the download timed out", True),
        (TimeoutError("timed out"), "the download timed out", True),
        (
            urllib.error.URLError(ssl.SSLError(1, "[SSL: TLSV1_ALERT_PROTOCOL_VERSION]")),
            "TLS handshake failed",
            True,
        ),
        (
            urllib.error.URLError(ssl.SSLCertVerificationError(1, "self-signed")),
            "TLS handshake failed: the server's certificate does not verify",
            True,
        ),
        (
            http.client.RemoteDisconnected("closed"),
            "the download server closed the connection",
            True,
        ),
        (http.client.BadStatusLine("SSH-2.0"), "the download server's answer is not HTTP", True),
    ],
)
def test_failures_are_reported_as_categories(exc: BaseException, what: str, retry: bool) -> None:
    said, again = category(exc)
    assert said.startswith(what) and again is retry
    for detail in ("Errno", "refused", "111", "Name or service", "SSL", "elsewhere", "reason"):
        assert detail not in said


def test_a_failure_while_reading_is_a_broken_download() -> None:
    assert category(ConnectionResetError(104, "reset"), reading=True) == (
        "the download broke off",
        True,
    )
    assert category(TimeoutError(), reading=True) == ("the download timed out", True)


def test_the_floor_only_goes_up_and_is_on_disk(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    states = DeliveryState(tmp_path / "delivery.json", outbox)
    assert states.get("ocr") == {}
    states.set("ocr", {"floor": 5})
    states.set("ocr", {"floor": 3, "failed": 5})  # a floor below: kept at 5
    assert json.loads((tmp_path / "delivery.json").read_text()) == {
        "ocr": {"floor": 5, "failed": 5}
    }
    assert DeliveryState(tmp_path / "delivery.json", outbox).get("ocr") == {"floor": 5, "failed": 5}
    # each writer gives only what changes: an operator's rollback (the commands thread) and a
    # floor raised by the delivery thread from a snapshot taken before it both stay
    states.set("ocr", {"failed": 6})
    states.set("ocr", {"floor": 6})
    assert states.get("ocr") == {"floor": 6, "failed": 6}


def test_an_older_outboxs_floors_move_to_the_file_once(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    outbox.put_many(
        [],
        state={
            "delivery/ocr": json.dumps({"floor": 45}),
            "delivery/ocr-det": json.dumps({"floor": 3, "failed": 4}),
            "delivery/broken": "{not json",
            "cursor": "7",
        },
    )
    path = tmp_path / "delivery.json"
    states = DeliveryState(path, outbox)
    assert states.get("ocr") == {"floor": 45}
    assert json.loads(path.read_text()) == {
        "ocr": {"floor": 45},
        "ocr-det": {"floor": 3, "failed": 4},
    }
    outbox.put_many([], state={"delivery/ocr": json.dumps({"floor": 1})})
    assert states.get("ocr") == {"floor": 45}  # the file, not the outbox, from now on


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"ocr": {"floor": ', "is not JSON"),
        ("\xff\xfe", "is not JSON"),
        ('{"ocr": {"floor": "45"}}', "does not hold"),
        ('{"ocr": {"floor": -1}}', "does not hold"),
        ('{"ocr": {"floor": true}}', "does not hold"),
        ("[45]", "does not hold"),
    ],
)
def test_a_corrupt_state_file_fails_closed(tmp_path: Path, text: str, says: str) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    outbox.put_many([], state={"delivery/ocr": json.dumps({"floor": 1})})
    path = tmp_path / "delivery.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(StateError, match=says):
        DeliveryState(path, outbox).get("ocr")
    with pytest.raises(StateError):
        DeliveryState(path, outbox).set("ocr", {"floor": 2})
    assert path.read_bytes() == text.encode("latin-1")  # left for whoever repairs it
