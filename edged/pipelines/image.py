"""Text recognition (OCR): encoded image in, lines of text with boxes and confidences out.

PP-OCRv4's three graphs run as models of the repository: detection (where is text), direction
classification (is the line upside down) and recognition (which characters); the processing
between them is in ``ocr_ops``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.pipelines import ocr_ops
from edged.pipelines.base import Pipeline, parameter, single_blob
from edged.runtimes.base import Tensors

# Lines whose recognition confidence is below this are dropped (PP-OCR's default text_score).
MIN_TEXT_SCORE = 0.5
REC_BATCH = 8
# How far detected text regions are grown before cropping. PP-OCR's 1.5-1.6 crops so tightly
# that recognition drops spaces between words ("Invoicenumber48213"); on DejaVu text at 16-40 px
# and line spacing down to 1.2, 2.0 lost far fewer spaces and never merged lines (at 12 px it
# lost a few that 1.6 kept): docs/BENCHMARKS.md.
UNCLIP_RATIO = 2.0


class TextRecognition(Pipeline):
    """The ``ocr`` pipeline."""

    keys: list[str]

    def prepare(self) -> None:
        """Load the recognition model's character dictionary."""
        self.keys = ocr_ops.load_keys(self.asset("keys.txt"))

    def sample(self) -> Tensors:
        """A small white image with a dark bar, enough to run all three graphs."""
        import io

        from PIL import Image, ImageDraw, ImageFont

        image = Image.new("RGB", (256, 64), "white")
        # Pillow's own font (FreeType, no font file needed), large enough to be detected, so
        # that the warm-up reaches the direction and recognition models too.
        ImageDraw.Draw(image).text((10, 8), "edged", fill="black", font=ImageFont.load_default(40))
        buf = io.BytesIO()
        image.save(buf, "PNG")
        blob = np.empty(1, dtype=object)
        blob[0] = buf.getvalue()
        return {"image": blob}

    async def _graph(self, key: str, tensor: np.ndarray) -> np.ndarray:
        model = self.step(key)
        spec = self.steps.config_of(model)
        out = await self.steps.call(model, {spec.inputs[0].name: tensor})
        return out[spec.outputs[0].name]

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Detect, orient and read every line of text."""
        side = int(parameter(parameters, "limit_side_len", 960, 32, 4096))
        min_score = parameter(parameters, "min_score", MIN_TEXT_SCORE, 0.0, 1.0)
        unclip = parameter(parameters, "unclip_ratio", UNCLIP_RATIO, 1.0, 4.0)
        data = single_blob("image", inputs["image"])
        image = await self.offload(ocr_ops.decode_image, data, self.settings.now().max_image_pixels)
        tensor, scale = await self.offload(ocr_ops.det_preprocess, image, side)
        prob = await self._graph("det_model", tensor)
        boxes, _ = await self.offload(
            ocr_ops.det_postprocess, prob, image.shape, scale, unclip_ratio=unclip
        )
        if len(boxes) == 0:
            return _answer([], np.zeros((0, 4, 2), np.float32), [])
        crops = [await self.offload(ocr_ops.crop_text, image, box) for box in boxes]
        cls_out = await self._graph("cls_model", await self.offload(ocr_ops.cls_preprocess, crops))
        crops = await self.offload(ocr_ops.apply_cls, crops, cls_out)
        # Recognise crops of similar aspect ratio together: less padding in each batch.
        order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / crops[i].shape[0])
        texts = [""] * len(crops)
        scores = [0.0] * len(crops)
        for start in range(0, len(order), REC_BATCH):
            batch = order[start : start + REC_BATCH]
            tensor = await self.offload(ocr_ops.rec_preprocess, [crops[i] for i in batch])
            rec_out = await self._graph("rec_model", tensor)
            part_texts, part_scores = ocr_ops.ctc_decode(rec_out, self.keys)
            for i, text, score in zip(batch, part_texts, part_scores):
                texts[i] = text
                scores[i] = float(score)
        keep = [i for i, (t, s) in enumerate(zip(texts, scores)) if t and s >= min_score]
        return _answer([texts[i] for i in keep], boxes[keep], [scores[i] for i in keep])


def _answer(texts: list[str], boxes: np.ndarray, scores: list[float]) -> Tensors:
    text = np.empty(len(texts), dtype=object)
    text[:] = [t.encode("utf-8") for t in texts]
    return {
        "text": text,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4, 2),
        "scores": np.asarray(scores, dtype=np.float32),
    }
