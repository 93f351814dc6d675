#!/usr/bin/env python3
"""OCR: spaces lost between words against the detector's unclip ratio.

Five lines of DejaVu Sans at several sizes and line spacings, read with the repository's
PP-OCRv4 graphs and edged's ocr_ops (no daemon). Prints, per setting and ratio, the boxes
found, the spaces lost and the characters wrong apart from spaces.

    .venv/bin/python bench/ocr_unclip.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edged.pipelines import ocr_ops  # noqa: E402
from tests.media import FONT, edit_distance  # noqa: E402

MODELS = ROOT / "models"
LINES = [
    "Invoice number 48213",
    "Total due: 1,250.00 EUR",
    "Edge inference on Jetson",
    "Pay to the order of ACME Robotics",
    "Serial 7Q-1142 shipped on 2026-11-30",
]
SETTINGS = [(40, 1.2), (28, 1.25), (16, 1.3), (12, 1.4)]  # font px, line spacing
RATIOS = [1.6, 2.0]


def draw(size: int, spacing: float) -> np.ndarray:
    font = ImageFont.truetype(str(FONT), size)
    width = max(int(font.getlength(line)) for line in LINES) + 40
    image = Image.new("RGB", (width, int(len(LINES) * size * spacing) + 40), "white")
    pen = ImageDraw.Draw(image)
    for i, line in enumerate(LINES):
        pen.text((20, 20 + i * int(size * spacing)), line, fill="black", font=font)
    return np.array(image)[:, :, ::-1].copy()


def main() -> None:
    det, rec = (
        ort.InferenceSession(
            str(MODELS / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        for name in ("ocr-det", "ocr-rec")
    )
    keys = ocr_ops.load_keys(MODELS / "ocr" / "1" / "keys.txt")
    truth = " ".join(LINES)
    print("| font px | spacing | unclip | boxes | spaces lost | other chars wrong |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size, spacing in SETTINGS:
        image = draw(size, spacing)
        tensor, scale = ocr_ops.det_preprocess(image, 960)
        prob = det.run(None, {"x": tensor})[0]
        for ratio in RATIOS:
            boxes, _ = ocr_ops.det_postprocess(prob, image.shape, scale, unclip_ratio=ratio)
            crops = [ocr_ops.crop_text(image, box) for box in boxes]
            texts = ocr_ops.ctc_decode(
                rec.run(None, {"x": ocr_ops.rec_preprocess(crops)})[0], keys
            )[0]
            found = " ".join(texts)
            lost = truth.count(" ") - found.count(" ")
            wrong = edit_distance(found.replace(" ", ""), truth.replace(" ", ""))
            print(f"| {size} | {spacing} | {ratio} | {len(boxes)} | {lost} | {wrong} |")


if __name__ == "__main__":
    main()
