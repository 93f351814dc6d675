"""OCR without OpenCV against OpenCV: the whole pipeline (decode, detector, classifier,
recognizer) on the equivalence test's images, with edged's numpy/Pillow processing and with the
OpenCV reference kept in tests/unit/edged/test_geometry.py, alternately in one process. Prints
the median of each and the ratio (the models' time is the same on both sides).

    .venv/bin/python -m bench.ocr_opencv [--runs 9] [--cases "four lines" huge]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.unit.edged.test_geometry import CASES, run_pipeline
from tests.unit.edged.test_ocr_ops import MODELS, Ocr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--cases", nargs="*", default=["four lines", "tilted 7 degrees", "huge"])
    args = parser.parse_args()
    ocr = Ocr(MODELS)
    print("| image | numpy/Pillow p50 ms | OpenCV p50 ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name in args.cases:
        data = CASES[name]()
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for reference in (False, True):  # alternately: the machine's noise falls on both
                started = time.perf_counter()
                run_pipeline(ocr, data, reference)
                times[reference].append((time.perf_counter() - started) * 1000)
        ours, theirs = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
