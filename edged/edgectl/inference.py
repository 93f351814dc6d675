"""Inference from the shell: ``edgectl infer`` (a raw Open Inference Protocol request) and the
default models' tasks, ``embed``, ``intent``, ``ocr`` and ``vad``, with --explain where each
call ran and why; and ``listen``, audio streamed to the wake word (or live VAD)."""

from __future__ import annotations

import argparse
import json
import sys
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np

from edged.client import Client, ClientError
from edged.common.terminal import UsageError
from edged.edgectl.base import read_input, request_params


def _explained(reply: dict[str, Any], text: str, args: argparse.Namespace) -> str:
    """With --explain: where the work ran, why, and every decision of the request."""
    if not args.explain or "route" not in reply:
        return text

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    lines = [text, f"route: {reply['route']}: {reply['reason']}"]
    lines.append(
        f"  predicted {ms(reply.get('predicted_ms'))}, actual {ms(reply.get('actual_ms'))}"
    )
    trace = reply.get("route_trace") or []
    if isinstance(trace, str):  # OIP parameters carry it as JSON text
        trace = json.loads(trace)
    for step in trace:
        lines.append(
            f"  {step['model']}: {step['route']} (deadline {ms(step['deadline_ms'])},"
            f" predicted {ms(step['predicted_ms'])}, actual {ms(step.get('actual_ms'))})"
        )
        lines += [f"    {line}" for line in step["trace"]]
        if step.get("egress"):
            seqs = ", ".join(str(seq) for seq in step["egress"])
            lines.append(f"    sent: egress ledger entry {seqs} (edgectl egress list)")
    return "\n".join(lines)


def cmd_infer(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Raw OIP inference: a request JSON document (file or -) is sent as it is, with the
    global flags' parameters added to its parameters."""
    doc = json.loads(read_input(args.request))
    if not isinstance(doc, dict):
        raise UsageError("the request document must be a JSON object")
    params = request_params(args)
    if params:
        doc["parameters"] = {**(doc.get("parameters") or {}), **params}
    reply = client.infer_json(args.model, doc, args.version)
    return reply, _explained(reply.get("parameters") or {}, json.dumps(reply, indent=2), args)


def cmd_embed(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Sentence embeddings of the texts (their first figures) and, for more than one text,
    their cosine similarities."""
    model = "text-embedding-int8" if args.int8 else "text-embedding"
    reply = client.task("embed", {"texts": args.texts, "model": model}, **request_params(args))
    vectors = np.asarray(reply["embeddings"], dtype=np.float32)
    lines = [
        f"{t[:40]!r:44} [{', '.join(f'{x:.4f}' for x in v[:4])}, ...]"
        for t, v in zip(args.texts, vectors)
    ]
    if len(args.texts) > 1:
        sims = vectors @ vectors.T
        lines.append("cosine similarity:")
        lines += ["  " + " ".join(f"{x:6.3f}" for x in row) for row in np.asarray(sims)]
    return reply, _explained(reply, "\n".join(lines), args)


def cmd_intent(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The intent of each text, with its score."""
    reply = client.task("intent", {"texts": args.texts}, **request_params(args))
    text = "\n".join(f"{i['intent']:16} {i['score']:.3f}  {i['text']}" for i in reply["intents"])
    return reply, _explained(reply, text, args)


def cmd_ocr(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The lines of text in an image, each with its score."""
    reply = client.task("ocr", raw=read_input(args.image), **request_params(args))
    text = "\n".join(f"{line['score']:.3f}  {line['text']}" for line in reply["lines"])
    return reply, _explained(reply, text, args)


def cmd_vad(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The speech segments of a WAV file."""
    params = request_params(args)
    if args.threshold is not None:
        params["threshold"] = args.threshold
    reply = client.task("vad", raw=read_input(args.wav), **params)
    segments = reply["segments"]
    text = "\n".join(f"{s['start']:8.3f} s -> {s['end']:8.3f} s" for s in segments)
    return reply, _explained(reply, text or "no speech", args)


def cmd_listen(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Stream audio to a stateful model (the wake word by default) and print each event as it
    comes (with --json, each response as a JSON line), then how many: a 16 kHz mono 16-bit WAV
    file, or raw 16 kHz 16-bit little-endian PCM on stdin (``arecord -f S16_LE -r 16000 -c 1
    -t raw | edgectl listen -``)."""
    audio = _pcm_chunks(args.source)
    events = 0
    for event in client.listen(audio, args.model, **request_params(args)):
        if event.get("event") == "error":
            raise ClientError(event["status"], event["error"])
        if event.get("event") == "end":
            break
        events += 1
        outputs = {o["name"]: o["data"] for o in event["outputs"]}
        line = json.dumps(event) if args.json else _event_line(outputs)
        print(line, flush=True)
    return {"events": events}, f"{events} event(s)"


def _event_line(outputs: dict[str, Any]) -> str:
    """One response of ``listen`` as a line: its span in seconds, then what was heard."""
    if "segments" in outputs:  # vad-live
        start, end = outputs["segments"][:2]
        return f"{start:8.2f} s -> {end:8.2f} s  speech"
    if "times" not in outputs or not ("phrase" in outputs or "event" in outputs):
        return json.dumps(outputs)
    start, end = outputs["times"]
    span = f"{start:8.2f} s -> {end:8.2f} s"
    if "phrase" in outputs:  # wake-word
        return f"{span}  wake: {outputs['phrase'][0]}"
    said = outputs["text"][0]  # voice-assistant: the wake phrase, then the command
    if outputs["event"][0] == "wake":
        return f"{span}  wake: {said}"
    if said:
        return f"{span}  command: {said!r} -> {outputs['intent'][0]} ({outputs['score'][0]:.2f})"
    return f"{span}  command: none of the device's phrases"


def _pcm_chunks(source: str) -> Iterator[bytes]:
    """100 ms chunks of 16 kHz mono 16-bit PCM from a WAV file, or raw PCM from stdin."""
    if source == "-":
        stdin = sys.stdin.buffer
        return iter(lambda: stdin.read(3200), b"")
    try:
        with wave.open(source, "rb") as wav:
            shape = (wav.getframerate(), wav.getnchannels(), wav.getsampwidth())
            frames = wav.readframes(wav.getnframes())
    except (OSError, wave.Error, EOFError) as exc:
        raise UsageError(f"cannot read {source} as a WAV file: {exc}") from None
    if shape != (16000, 1, 2):
        raise UsageError(
            f"{source} is {shape[0]} Hz, {shape[1]} channel(s), {8 * shape[2]}-bit: send 16 kHz"
            f" mono 16-bit (sox {source} -r 16000 -c 1 -b 16 out.wav)"
        )
    return (frames[i : i + 3200] for i in range(0, len(frames), 3200))
