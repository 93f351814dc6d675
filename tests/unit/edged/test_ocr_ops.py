"""PP-OCRv4 pre/post-processing: synthetic checks, and the real det/cls/rec ONNX graphs on text
drawn with PIL (the test is the glue the daemon would be)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from edged.common.errors import InvalidRequest, PayloadTooLarge
from edged.pipelines import ocr_ops
from tests.conftest import skip_or_fail
from tests.media import FONT, char_accuracy

REPO = Path(__file__).resolve().parents[3]
MODELS = Path(os.environ.get("EDGED_TEST_MODELS", REPO / "models"))
LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Edge inference daemon 2024: OCR test",
    "Invoice #48213 total $1,234.56 due 03/15",
    "PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS",
]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def text_image(lines: list[str] = LINES) -> Image.Image:
    if not FONT.is_file():
        skip_or_fail(f"{FONT} is missing (Debian package fonts-dejavu-core)")
    font = ImageFont.truetype(str(FONT), 28)
    image = Image.new("RGB", (900, 300), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((30, 30 + 65 * i), line, fill="black", font=font)
    return image


class Ocr:
    """The three sessions plus the glue a pipeline would hold."""

    def __init__(self, root: Path) -> None:
        import onnxruntime as ort

        paths = {n: root / n / "1" / "model.onnx" for n in ("ocr-det", "ocr-cls", "ocr-rec")}
        keys = root / "ocr" / "1" / "keys.txt"
        missing = [str(p) for p in [*paths.values(), keys] if not p.is_file()]
        if missing:
            skip_or_fail(f"OCR models not built ({', '.join(missing)}); run `make models`")
        opts = ort.SessionOptions()
        # Idle intra-op threads of one session spin and starve the next session's on few cores:
        # on 2 cores, turning spinning off halved det, cls and rec times.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.det, self.cls, self.rec = (
            ort.InferenceSession(str(paths[n]), opts, providers=["CPUExecutionProvider"])
            for n in ("ocr-det", "ocr-cls", "ocr-rec")
        )
        self.keys = ocr_ops.load_keys(keys)
        self.ms: dict[str, float] = {}

    def __call__(self, image: np.ndarray) -> tuple[np.ndarray, list[str], np.ndarray]:
        t0 = time.perf_counter()
        x, scale = ocr_ops.det_preprocess(image, 960)
        prob = self.det.run(None, {"x": x})[0]
        boxes, _ = ocr_ops.det_postprocess(prob, image.shape, scale)
        t1 = time.perf_counter()
        crops = [ocr_ops.crop_text(image, box) for box in boxes]
        if crops:
            cls_out = self.cls.run(None, {"x": ocr_ops.cls_preprocess(crops)})[0]
            crops = ocr_ops.apply_cls(crops, cls_out)
        t2 = time.perf_counter()
        texts: list[str] = []
        conf = np.zeros(0, np.float32)
        if crops:
            rec_out = self.rec.run(None, {"x": ocr_ops.rec_preprocess(crops)})[0]
            texts, conf = ocr_ops.ctc_decode(rec_out, self.keys)
        t3 = time.perf_counter()
        self.ms = {"det": (t1 - t0) * 1e3, "cls": (t2 - t1) * 1e3, "rec": (t3 - t2) * 1e3}
        return boxes, texts, conf


@pytest.fixture(scope="module")
def ocr() -> Ocr:
    return Ocr(MODELS)


def test_reads_drawn_text(ocr: Ocr) -> None:
    image = ocr_ops.decode_image(png(text_image()))
    ocr(image)  # warm-up: the first run allocates
    boxes, texts, conf = ocr(image)
    accuracy = char_accuracy("".join(texts), "".join(LINES))
    print(f"\nOCR accuracy {accuracy:.4f}; ms {ocr.ms}; texts {texts}")
    assert accuracy >= 0.9, texts
    assert len(texts) == len(LINES)  # one box per line, in reading order
    for text, line in zip(texts, LINES):
        assert char_accuracy(text, line) >= 0.8, (text, line)
    assert np.all(conf > 0.5)
    assert boxes.dtype == np.float32 and boxes.shape == (len(LINES), 4, 2)
    assert np.all(boxes[:, 0, 0] < boxes[:, 1, 0])  # clockwise from top-left
    assert np.all(boxes[:, 1, 1] < boxes[:, 2, 1])
    for i, box in enumerate(boxes):  # each box covers its line's baseline area
        top = 30 + 65 * i
        assert top - 12 <= box[:, 1].min() <= top + 12 and box[:, 0].min() < 40


def test_reads_upside_down_text(ocr: Ocr) -> None:
    """The classifier turns the crops of a 180-degree rotated page back upright.

    Not all lines: the classifier squeezes a long line into 192 pixels and is unsure about
    some (P(180) 0.74-0.81 for the pangram and the capitals upside down, under the 0.9
    threshold, so those crops stay upside down and read as garbage).
    """
    lines = LINES[1:3]
    upside_down = text_image(lines).rotate(180)
    _, texts, _ = ocr(ocr_ops.decode_image(png(upside_down)))
    assert char_accuracy("".join(texts), "".join(reversed(lines))) >= 0.9, texts


def test_blank_image_has_no_boxes(ocr: Ocr) -> None:
    boxes, texts, conf = ocr(ocr_ops.decode_image(png(Image.new("RGB", (640, 480), "white"))))
    assert boxes.shape == (0, 4, 2) and texts == [] and conf.shape == (0,)


def test_keys_match_the_rec_model(ocr: Ocr) -> None:
    meta = ocr.rec.get_modelmeta().custom_metadata_map
    assert ocr_ops.keys_from_onnx_metadata(meta) == ocr.keys
    classes = ocr.rec.get_outputs()[0].shape[-1]
    assert classes == len(ocr.keys) + 2  # blank first, space last
    assert "\u3000" in ocr.keys  # a whitespace entry that naive stripping would lose


def test_non_image_bytes() -> None:
    for data in (b"", b"hello, world", b"\x89PNG\r\n\x1a\n" + b"\0" * 20):
        with pytest.raises(InvalidRequest, match="not an image"):
            ocr_ops.decode_image(data)


def test_decode_gray_alpha_and_limit() -> None:
    gray = ocr_ops.decode_image(png(Image.new("L", (40, 30), 77)))
    assert gray.shape == (30, 40, 3) and gray.dtype == np.uint8 and np.all(gray == 77)
    rgba = Image.new("RGBA", (20, 10), (0, 0, 0, 0))
    rgba.putpixel((5, 5), (255, 0, 0, 255))  # opaque red
    out = ocr_ops.decode_image(png(rgba))
    assert out.shape == (10, 20, 3) and np.all(out[0, 0] == 255)  # transparent -> white
    assert out[5, 5].tolist() == [0, 0, 255]  # BGR
    with pytest.raises(PayloadTooLarge):
        ocr_ops.decode_image(png(Image.new("RGB", (200, 100))), max_pixels=19_999)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    Image.new("RGB", (60, 20), "white").save(buf, "JPEG", exif=exif.tobytes())
    assert ocr_ops.decode_image(buf.getvalue()).shape == (60, 20, 3)  # as a phone shows it


def test_det_preprocess_shapes() -> None:
    for h, w, limit in ((300, 900, 960), (2000, 1000, 960), (10, 10, 960), (700, 500, 1010)):
        x, scale = ocr_ops.det_preprocess(np.full((h, w, 3), 255, np.uint8), limit)
        assert x.dtype == np.float32 and x.shape[:2] == (1, 3)
        assert x.shape[2] % 32 == 0 and x.shape[3] % 32 == 0
        assert max(x.shape[2:]) <= max(limit, 32)
        assert scale.ratio_h == pytest.approx(x.shape[2] / h)
        assert scale.ratio_w == pytest.approx(x.shape[3] / w)


def test_det_postprocess_synthetic() -> None:
    """Two blobs on a half-size map come back in original pixels, in reading order."""
    prob = np.zeros((1, 1, 64, 128), np.float32)
    prob[0, 0, 40:50, 20:60] = 0.9  # second line
    prob[0, 0, 10:20, 70:120] = 0.9  # first line, right
    prob[0, 0, 10:20, 5:40] = 0.9  # first line, left
    prob[0, 0, 55:58, 100:102] = 0.9  # too small
    scale = ocr_ops.DetScale(0.5, 0.5)
    boxes, scores = ocr_ops.det_postprocess(prob, (128, 256), scale)
    assert boxes.shape == (3, 4, 2) and np.all((scores > 0.7) & (scores <= 0.9))
    # Blobs in original pixels (x0, y0, x1, y1), in reading order: unclip grows each box by
    # about 15 px (offset area * 1.6 / perimeter on the map, times 2), then it is clipped.
    blobs = [(10, 20, 80, 40), (140, 20, 240, 40), (40, 80, 120, 100)]
    for box, (x0, y0, x1, y1) in zip(boxes, blobs):
        assert box[0].tolist() == [box[:, 0].min(), box[:, 1].min()]  # axis-aligned, clockwise
        assert box[2].tolist() == [box[:, 0].max(), box[:, 1].max()]
        assert max(0, x0 - 20) <= box[0, 0] <= x0 - 8 and x1 + 8 <= box[2, 0] <= x1 + 20
        assert y0 - 20 <= box[0, 1] <= y0 - 8 and y1 + 8 <= box[2, 1] <= y1 + 20
    assert boxes[0, 0, 0] == 0 and boxes[:, :, 0].max() <= 255  # clipped to the image


def test_crop_text_and_rotation() -> None:
    image = np.zeros((100, 200, 3), np.uint8)
    image[20:40, 50:150] = 200
    box = np.array([[50, 20], [150, 20], [150, 40], [50, 40]], np.float32)
    crop = ocr_ops.crop_text(image, box)
    assert crop.shape == (20, 100, 3) and crop[5:15, 10:90].min() == 200
    tall = ocr_ops.crop_text(image, np.array([[10, 0], [30, 0], [30, 90], [10, 90]], np.float32))
    assert tall.shape == (20, 90, 3)  # vertical text is turned to lie horizontal


def test_cls_and_rec_preprocess() -> None:
    crops = [np.full((24, 48, 3), 255, np.uint8), np.full((30, 600, 3), 0, np.uint8)]
    x = ocr_ops.cls_preprocess(crops)
    assert x.shape == (2, 3, 48, 192) and x.dtype == np.float32
    assert np.all(x[0, :, :, :96] == 1.0) and np.all(x[0, :, :, 96:] == 0.0)  # padded
    assert np.all(x[1] == -1.0)  # wider than 192: squeezed to fit
    r = ocr_ops.rec_preprocess(crops)
    assert r.shape == (2, 3, 48, 960)  # 600 / 30 * 48
    assert np.all(r[0, :, :, :96] == 1.0) and np.all(r[0, :, :, 96:] == 0.0)
    assert ocr_ops.rec_preprocess(crops[:1]).shape == (1, 3, 48, 320)  # PaddleOCR's floor


def test_apply_cls() -> None:
    crops = [np.arange(6, dtype=np.uint8).reshape(1, 2, 3)] * 3
    out = ocr_ops.apply_cls(crops, np.array([[0.05, 0.95], [0.2, 0.8], [0.99, 0.01]]))
    assert out[0].tolist() == crops[0][:, ::-1].tolist()  # flipped
    assert out[1] is crops[1] and out[2] is crops[2]  # unsure or upright: unchanged


def test_ctc_decode() -> None:
    keys = ["a", "b", "\u3000"]

    def onehot(seq: list[int], p: float = 0.9) -> np.ndarray:
        out = np.full((len(seq), 5), (1 - p) / 4, np.float32)
        out[np.arange(len(seq)), seq] = p
        return out

    batch = np.stack([onehot([0, 1, 1, 0, 1, 2, 2, 4, 3]), onehot([0, 0, 0, 0, 0, 0, 0, 0, 0])])
    texts, conf = ocr_ops.ctc_decode(batch, keys)
    assert texts == ["aab \u3000", ""]
    assert conf.dtype == np.float32 and conf[0] == pytest.approx(0.9) and conf[1] == 0.0
    assert ocr_ops.ctc_decode(batch[:, :, :4], keys)[0] == ["aab\u3000", ""]  # no space class
    with pytest.raises(ValueError, match="classes"):
        ocr_ops.ctc_decode(batch, keys[:1])


def test_keys_file_round_trip(tmp_path: Path) -> None:
    keys = ["'", "\u3000", "a", "中"]
    path = tmp_path / "keys.txt"
    ocr_ops.save_keys(keys, path)
    assert ocr_ops.load_keys(path) == keys
    path.write_bytes(b"x\r\ny\r\n")
    assert ocr_ops.load_keys(path) == ["x", "y"]
    meta: dict[str, Any] = {"character": "'\n\u3000\na\n中"}
    assert ocr_ops.keys_from_onnx_metadata(meta) == keys
    with pytest.raises(ValueError):
        ocr_ops.keys_from_onnx_metadata({})
    with pytest.raises(ValueError):
        ocr_ops.save_keys(["a\nb"], path)
