#!/usr/bin/env python3
"""Train the wake-word model for a phrase from synthetic speech, and export it to ONNX.

    .venv/bin/python -m models.wakeword.train [--phrase "hey jetson"] [--repository models]
        [--out models/wakeword/hey-jetson.onnx] [--seed 47] [--windows 80000] [--epochs 12]

Without --phrase, the phrase is the first of wake-word's ``phrases`` parameter in the
repository's models/wake-word/config.pbtxt (the operator names it there). With --repository,
the model is installed as the next version of ``wake-net`` there, with a config.pbtxt of its
own that names its phrase and threshold (edged loads it like any new version: a rollout, a
rollback); ``make wake-model`` does that for the default repository.

Needs the build extra (torch, scipy: ``pip install -e '.[models]'``) and the voices' packages
(Debian's espeak-ng, flite, festival with festvox-kallpc16k, festvox-kdlpc16k; fortunes for
other speech). Every step is seeded (the clips, the windows, the weights' start; two runs
giving the same model bit for bit is not checked yet). The model reads log-mel frames
(edged/pipelines/logmel.py) of a 1.5 s window and gives the probability that the whole phrase
is in it, and where it starts and ends (seconds before the window's end). A card beside the
ONNX file (``.json``) records the phrase, the settings, the voices, the threshold chosen on
the training voices and the time it took.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edged.pipelines import logmel  # noqa: E402
from models.wakeword import data, voices  # noqa: E402

FRAMES = logmel.count(data.WINDOW)


def lifter(bands: int, keep: int) -> Any:
    """[bands, bands]: a DCT, its first ``keep`` coefficients, and back (a smoothed log-mel)."""
    import torch

    n = np.arange(bands)
    dct = np.cos(np.pi / bands * (n[:, None] + 0.5) * n[None, :]) * np.sqrt(2 / bands)
    dct[:, 0] /= np.sqrt(2)
    keep_only = dct[:, :keep] @ dct[:, :keep].T
    return torch.tensor(keep_only, dtype=torch.float32)


def network(width: int = 48) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dilation: int) -> None:
            super().__init__()
            self.conv = nn.Conv1d(width, width, 3, padding=dilation, dilation=dilation)
            self.norm = nn.BatchNorm1d(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.norm(self.conv(x)))

    class WakeNet(nn.Module):
        """[B, frames, bands] log-mel -> (probability [B], times [B, 2])."""

        def __init__(self) -> None:
            super().__init__()
            self.inorm = nn.BatchNorm1d(logmel.BANDS)
            self.register_buffer("lifter", lifter(logmel.BANDS, 20))
            self.stem = nn.Sequential(
                nn.Conv1d(logmel.BANDS, width, 5, stride=2, padding=2),
                nn.BatchNorm1d(width),
                nn.ReLU(),
            )  # 20 ms steps from here
            self.body = nn.Sequential(
                Block(1),
                Block(2),
                nn.MaxPool1d(2),
                Block(2),
                Block(4),
                Block(8),
            )
            self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = x.transpose(1, 2)
            # the window's own mean per band (gain, channel), then the spectrum's envelope
            # only: its first 20 cepstral coefficients (the pitch's harmonics are the voice's,
            # not the phrase's)
            x = x - x.mean(dim=2, keepdim=True)
            x = torch.einsum("bft,fg->bgt", x, self.lifter)
            h = self.body(self.stem(self.inorm(x))).amax(dim=2)
            out = self.head(h)
            return out[:, 0], out[:, 1:]

    return WakeNet()


_BANK: list[data.Bank] = []  # the bank a worker draws from (inherited when it forks)


def _windows(job: tuple[int, int]) -> tuple[np.ndarray, ...]:
    seed, n = job
    batch = data.Sampler(_BANK[0], seed).batch(n)
    return (
        logmel.frames(batch.audio).astype(np.float16),
        batch.label,
        np.stack([batch.start, batch.end], axis=1),
    )


def windows(bank: data.Bank, n: int, seed: int, workers: int) -> tuple[np.ndarray, ...]:
    """``n`` augmented windows as log-mel frames, made ``workers`` at a time, seeded (the
    workers fork with the bank: it is never pickled)."""
    size = 500
    jobs = [(seed * 100003 + i, min(size, n - i * size)) for i in range(-(-n // size))]
    _BANK[:] = [bank]
    try:
        if workers > 1:
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                parts = list(pool.map(_windows, jobs))
        else:
            parts = [_windows(j) for j in jobs]
    finally:
        _BANK.clear()
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def fit(
    features: np.ndarray,
    labels: np.ndarray,
    times: np.ndarray,
    *,
    epochs: int,
    seed: int,
    width: int = 48,
    log: Any = print,
) -> Any:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    model = network(width)
    steps = epochs * (-(-len(labels) // 128))
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=3e-3, total_steps=steps)
    rng = np.random.default_rng(seed)
    x_all = torch.from_numpy(features)
    y_all = torch.from_numpy(labels)
    t_all = torch.from_numpy(times)
    model.train()
    for epoch in range(epochs):
        order = rng.permutation(len(labels))
        total = 0.0
        for i in range(0, len(order), 128):
            idx = torch.from_numpy(order[i : i + 128])
            x = x_all[idx].float()
            if epoch > 0:  # masks of time and frequency (SpecAugment), after the first epoch
                x = _mask(x, rng)
            y, t = y_all[idx], t_all[idx]
            logit, when = model(x)
            # a false accept costs more than a miss: negatives weigh twice
            weight = torch.where(y > 0, 1.0, 2.0)
            loss = F.binary_cross_entropy_with_logits(logit, y, weight=weight)
            pos = y > 0
            if pos.any():
                loss = loss + F.smooth_l1_loss(when[pos], t[pos])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
            total += float(loss.detach()) * len(idx)
        log(f"epoch {epoch + 1}/{epochs}: loss {total / len(labels):.4f}")
    model.eval()
    return model


def _mask(x: Any, rng: np.random.Generator) -> Any:
    x = x.clone()
    for row in range(x.shape[0]):
        if rng.random() < 0.5:
            f = int(rng.integers(1, 6))
            f0 = int(rng.integers(0, logmel.BANDS - f))
            x[row, :, f0 : f0 + f] = x[row, :, f0 : f0 + f].mean()
        if rng.random() < 0.3:
            t = int(rng.integers(1, 8))
            t0 = int(rng.integers(0, x.shape[1] - t))
            x[row, t0 : t0 + t, :] = x[row, t0 : t0 + t, :].mean()
    return x


def scores(model: Any, features: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = [
            model(torch.from_numpy(features[i : i + 512]).float())[0]
            for i in range(0, len(features), 512)
        ]
    return torch.sigmoid(torch.cat(out)).numpy()


def export(model: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(1, FRAMES, logmel.BANDS)
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["features"],
        output_names=["logit", "times"],
        dynamic_axes={"features": {0: "batch"}, "logit": {0: "batch"}, "times": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )


def train(
    phrase: str,
    out: Path,
    *,
    seed: int = 47,
    speakers: list[str] | None = None,
    per_voice: int = 12,
    near: int = 12000,
    speech: int = 5000,
    count: int = 80000,
    epochs: int = 12,
    width: int = 48,
    workers: int = 2,
    cache: Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Train, choose the threshold, export ``out`` and its card; return the card."""
    began = time.monotonic()
    wanted = speakers if speakers is not None else voices.TRAIN
    speakers, missing = voices.available(wanted)
    for reason in missing:
        log(f"left out: {reason}")
    if not speakers:
        raise SystemExit("no voice to train with: " + "; ".join(missing))
    bank = data.build_bank(
        phrase,
        speakers,
        per_voice=per_voice,
        near=near,
        speech=speech,
        seed=seed,
        workers=workers,
        cache=cache,
    )
    made = time.monotonic()
    log(
        f"bank: {len(bank.positive)} phrases, {len(bank.near)} near misses,"
        f" {len(bank.speech)} sentences ({made - began:.0f} s)"
    )
    features, labels, times = windows(bank, count, seed, workers)
    check = windows(bank, max(count // 10, 200), seed + 1, workers)
    drawn = time.monotonic()
    log(f"windows: {len(labels)} ({drawn - made:.0f} s)")
    model = fit(features, labels, times, epochs=epochs, seed=seed, width=width, log=log)
    trained = time.monotonic()
    p = scores(model, check[0])
    neg = np.sort(p[check[1] == 0])
    # the threshold: no more than 1 in 1000 held-back negative windows above it
    threshold = float(max(0.5, neg[int(len(neg) * 0.999)] if len(neg) else 0.5))
    recall = float(np.mean(p[check[1] == 1] >= threshold))
    export(model, out)
    card = {
        "phrase": phrase,
        "seed": seed,
        "threshold": round(threshold, 4),
        "window_s": data.WINDOW_S,
        "frames": FRAMES,
        "bands": logmel.BANDS,
        "check": {"windows": len(check[1]), "recall": round(recall, 4)},
        "bank": {
            "positive": len(bank.positive),
            "near": len(bank.near),
            "speech": len(bank.speech),
        },
        "windows": len(labels),
        "epochs": epochs,
        "width": width,
        "voices": speakers,
        "seconds": {
            "bank": round(made - began),
            "windows": round(drawn - made),
            "training": round(trained - drawn),
        },
        "bytes": out.stat().st_size,
    }
    out.with_suffix(".json").write_text(json.dumps(card, indent=1) + "\n")
    log(
        f"threshold {threshold:.3f}: {recall:.1%} of the held-back positive windows;"
        f" {out} ({card['bytes']} bytes)"
    )
    return card


def configured_phrase(repository: Path) -> str:
    """The first phrase of wake-word's ``phrases`` parameter in ``repository``."""
    text = (repository / "wake-word" / "config.pbtxt").read_text()
    found = re.search(r'key: "phrases"\s*value \{ string_value: "([^"=;]+)', text)
    if found is None:
        raise SystemExit(f"{repository}/wake-word/config.pbtxt names no phrase (its phrases)")
    return " ".join(found.group(1).lower().split())


def set_parameter(config: str, key: str, value: str) -> str:
    """A string parameter of a config.pbtxt, set."""
    pattern = rf'(key: "{key}"\s*value \{{ string_value: )"[^"]*"'
    return re.sub(pattern, lambda m: f'{m.group(1)}"{value}"', config)


def install(repository: Path, model: Path, card: dict[str, Any]) -> Path:
    """``model`` as the next version of wake-net in ``repository``, with its own config (the
    model's one, its phrase and threshold set)."""
    entry = repository / "wake-net"
    config = (entry / "config.pbtxt").read_text()
    config = set_parameter(config, "phrase", card["phrase"])
    config = set_parameter(config, "threshold", str(card["threshold"]))
    versions = [int(d.name) for d in entry.iterdir() if d.is_dir() and d.name.isdigit()]
    staging = entry / f".staging-{os.getpid()}"
    staging.mkdir()
    shutil.copy2(model, staging / "model.onnx")
    shutil.copy2(model.with_suffix(".json"), staging / "card.json")
    (staging / "config.pbtxt").write_text(config)
    target = entry / str(max(versions, default=0) + 1)
    os.rename(staging, target)  # whole, or not there: edged never sees half a version
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phrase", help="(default: the one wake-word's config names)")
    parser.add_argument("--repository", type=Path, help="install it as wake-net's next version")
    parser.add_argument("--out", type=Path, help="(default: models/wakeword/<phrase>.onnx)")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--windows", type=int, default=80000)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--per-voice", type=int, default=12)
    parser.add_argument("--near", type=int, default=12000)
    parser.add_argument("--speech", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=ROOT / "models" / ".build" / "wakeword")
    args = parser.parse_args(argv)
    try:
        import scipy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"training needs the build extra (pip install -e '.[models]'): {e}", file=sys.stderr)
        return 2
    phrase = args.phrase or configured_phrase(args.repository or ROOT / "models")
    slug = re.sub(r"[^a-z0-9]+", "-", phrase)
    out = args.out or ROOT / "models" / "wakeword" / f"{slug}.onnx"
    unknown = data.unknown_words(phrase)
    if unknown:
        print(
            f"cannot train {phrase!r}: not in the dictionary: {', '.join(unknown)}", file=sys.stderr
        )
        return 2
    card = train(
        phrase,
        out,
        seed=args.seed,
        per_voice=args.per_voice,
        near=args.near,
        speech=args.speech,
        count=args.windows,
        epochs=args.epochs,
        workers=args.workers,
        cache=args.cache,
    )
    if args.repository is not None:
        print(f"installed as {install(args.repository, out, card)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
