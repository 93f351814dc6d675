"""The numpy replacements of OpenCV (edged/pipelines/contours.py, geometry.py, resample.py)
against OpenCV itself, which stays a test-only dependency: function by function on generated
inputs, then the whole OCR pipeline on drawn text, old (OpenCV) against new.

Exact where OpenCV's result is a matter of definition (contours' hulls, dilation, areas, the
polygon fill inside the image); within one grey level where it depends on OpenCV's vector code
or floating point (resize, warp); rectangles equal except where two of equal area tie and
OpenCV breaks the tie by the order of a contour's points, which the hulls do not carry.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from edged.pipelines import contours, geometry, ocr_ops, resample
from tests.media import FONT

cv2: Any = pytest.importorskip(
    "cv2", reason="OpenCV (opencv-python-headless, the `test` extra) is not installed"
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the reference: the OpenCV code that ocr_ops used before ---------------------------------


class OpenCvReference:
    """ocr_ops' processing as it was on OpenCV (edged 0.1.0), kept to compare against."""

    @staticmethod
    def decode(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as probe:
            has_alpha = probe.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
                probe.mode == "P" and "transparency" in probe.info
            )
        flags = cv2.IMREAD_UNCHANGED if has_alpha else cv2.IMREAD_COLOR
        image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
        if image.dtype == np.uint16:
            image = (image >> 8).astype(np.uint8)
        if image.ndim == 2:
            return cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
        channels = image.shape[2]
        if channels in (2, 4):
            alpha = image[:, :, -1:].astype(np.float32) / 255.0
            color = image[:, :, :1] if channels == 2 else image[:, :, :3]
            blended = color.astype(np.float32) * alpha + 255.0 * (1.0 - alpha)
            out = np.clip(blended + 0.5, 0, 255).astype(np.uint8)
            return cv2.cvtColor(out, cv2.COLOR_GRAY2BGR) if channels == 2 else out
        return np.ascontiguousarray(image[:, :, :3])

    @staticmethod
    def det_preprocess(image: np.ndarray, limit: int = 960) -> tuple[np.ndarray, ocr_ops.DetScale]:
        h, w = image.shape[:2]
        ratio = min(1.0, limit / max(h, w))
        cap = max(1, limit // 32)
        new_h = 32 * max(1, min(cap, round(h * ratio / 32)))
        new_w = 32 * max(1, min(cap, round(w * ratio / 32)))
        resized = cv2.resize(image, (new_w, new_h))
        mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
        x = (resized.astype(np.float32) / 255.0 - mean) / std
        tensor = np.ascontiguousarray(x.transpose(2, 0, 1)[np.newaxis], dtype=np.float32)
        return tensor, ocr_ops.DetScale(new_h / h, new_w / w)

    @staticmethod
    def box_score(pred: np.ndarray, points: np.ndarray) -> float:
        h, w = pred.shape
        x0 = int(np.clip(np.floor(points[:, 0].min()), 0, w - 1))
        x1 = int(np.clip(np.ceil(points[:, 0].max()), 0, w - 1))
        y0 = int(np.clip(np.floor(points[:, 1].min()), 0, h - 1))
        y1 = int(np.clip(np.ceil(points[:, 1].max()), 0, h - 1))
        mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
        shifted = (points - np.array([x0, y0], dtype=np.float32)).astype(np.int32)
        cv2.fillPoly(mask, [shifted], 1)
        return float(cv2.mean(pred[y0 : y1 + 1, x0 : x1 + 1], mask)[0])

    @classmethod
    def det_postprocess(
        cls,
        prob_map: np.ndarray,
        shape: Sequence[int],
        scale: ocr_ops.DetScale,
        unclip_ratio: float = 1.6,
    ) -> tuple[np.ndarray, np.ndarray]:
        import pyclipper

        pred = np.asarray(prob_map, dtype=np.float32).reshape(prob_map.shape[-2:])
        orig_h, orig_w = int(shape[0]), int(shape[1])
        bitmap = cv2.dilate((pred > 0.3).astype(np.uint8), np.ones((2, 2), np.uint8))
        found, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        boxes, scores = [], []
        for contour in found[:1000]:
            rect = cv2.minAreaRect(contour)
            if min(rect[1]) < 3:
                continue
            points = cv2.boxPoints(rect)
            score = cls.box_score(pred, points)
            if score < 0.5:
                continue
            area = cv2.contourArea(points)
            perimeter = cv2.arcLength(points, True)
            if perimeter <= 0:
                continue
            offset = pyclipper.PyclipperOffset()
            offset.AddPath(points.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
            paths = offset.Execute(area * unclip_ratio / perimeter)
            if not paths:
                continue
            largest = max(paths, key=lambda p: abs(cv2.contourArea(np.array(p, np.float32))))
            rect = cv2.minAreaRect(np.array(largest, dtype=np.float32))
            if min(rect[1]) < 5:
                continue
            box = ocr_ops._order_clockwise(cv2.boxPoints(rect))
            box[:, 0] = np.clip(box[:, 0] / scale.ratio_w, 0, orig_w - 1)
            box[:, 1] = np.clip(box[:, 1] / scale.ratio_h, 0, orig_h - 1)
            if np.linalg.norm(box[0] - box[1]) <= 3 or np.linalg.norm(box[0] - box[3]) <= 3:
                continue
            boxes.append(box)
            scores.append(score)
        if not boxes:
            return np.zeros((0, 4, 2), np.float32), np.zeros((0,), np.float32)
        order = ocr_ops._reading_order(boxes)
        return (
            np.stack([boxes[i] for i in order]).astype(np.float32),
            np.array([scores[i] for i in order], dtype=np.float32),
        )

    @staticmethod
    def crop_text(image: np.ndarray, box: np.ndarray) -> np.ndarray:
        pts = np.asarray(box, dtype=np.float32)
        width = max(1, int(max(np.linalg.norm(pts[0] - pts[1]), np.linalg.norm(pts[2] - pts[3]))))
        height = max(1, int(max(np.linalg.norm(pts[0] - pts[3]), np.linalg.norm(pts[1] - pts[2]))))
        target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
        matrix = cv2.getPerspectiveTransform(pts, target)
        crop = cv2.warpPerspective(
            image, matrix, (width, height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE
        )
        if height / width >= 1.5:
            crop = np.ascontiguousarray(np.rot90(crop))
        return crop


# -- contours, hulls, rectangles --------------------------------------------------------------


def binary_maps() -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(
        np.uint8,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40),
        elements=st.integers(0, 1),
    )


def point_set(points: np.ndarray) -> list[tuple[float, float]]:
    return sorted(map(tuple, np.asarray(points).reshape(-1, 2).tolist()))


def same_rect(ours: geometry.RotatedRect, theirs: Any) -> bool:
    return tuple(ours) == (tuple(theirs[0]), tuple(theirs[1]), theirs[2])


def equal_area(ours: geometry.RotatedRect, theirs: Any) -> bool:
    return math.isclose(ours.size[0] * ours.size[1], theirs[1][0] * theirs[1][1], rel_tol=1e-5)


@SETTINGS
@given(binary_maps(), st.booleans())
def test_contour_hulls_are_the_hulls_of_opencvs_contours(bitmap: np.ndarray, dilate: bool) -> None:
    if dilate:
        bitmap = cv2.dilate(bitmap, np.ones((2, 2), np.uint8))
    found, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    hulls = contours.contour_hulls(bitmap)
    assert len(hulls) == len(found)
    for contour, hull in zip(found, hulls):
        assert point_set(hull) == point_set(cv2.convexHull(contour))
        ours, theirs = geometry.min_area_rect(hull, is_hull=True), cv2.minAreaRect(contour)
        assert same_rect(ours, theirs) or equal_area(ours, theirs), (ours, theirs)


def test_rectangles_of_many_maps_match_opencv() -> None:
    """The counts behind the claim in the module docstring, printed for the record."""
    rng = np.random.default_rng(7)
    contours_seen = exact = ties = 0
    for i in range(300):
        h, w = rng.integers(1, 80, 2)
        bitmap = (rng.random((h, w)) < rng.uniform(0.1, 0.9)).astype(np.uint8)
        if i % 2:
            bitmap = cv2.dilate(bitmap, np.ones((2, 2), np.uint8))
        found, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        hulls = contours.contour_hulls(bitmap)
        assert len(hulls) == len(found)
        assert [len(h) for h in contours.contour_hulls(bitmap, 5)] == [len(h) for h in hulls[:5]]
        for contour, hull in zip(found, hulls):
            contours_seen += 1
            ours, theirs = geometry.min_area_rect(hull, is_hull=True), cv2.minAreaRect(contour)
            if same_rect(ours, theirs):
                exact += 1
                assert np.array_equal(geometry.box_points(ours), cv2.boxPoints(theirs))
            else:
                assert equal_area(ours, theirs), (ours, theirs)
                ties += 1
    print(f"\n{contours_seen} contours: {exact} rectangles bit for bit, {ties} equal-area ties")
    assert ties <= contours_seen // 1000


@SETTINGS
@given(
    hnp.arrays(np.int32, st.tuples(st.integers(1, 12), st.just(2)), elements=st.integers(-50, 50)),
    st.booleans(),
)
def test_hull_and_min_area_rect_of_points(points: np.ndarray, as_float: bool) -> None:
    if len(np.unique(points, axis=0)) < len(points):
        return  # which of two equal points OpenCV keeps is its sort's business
    pts = points.astype(np.float32) + (np.float32(0.25) if as_float else 0)
    for clockwise in (True, False):
        assert np.array_equal(
            geometry.convex_hull(pts, clockwise),
            cv2.convexHull(pts, clockwise=clockwise).reshape(-1, 2),
        )
    ours, theirs = geometry.min_area_rect(pts), cv2.minAreaRect(pts)
    assert same_rect(ours, theirs), (ours, theirs)
    assert np.array_equal(geometry.box_points(ours), cv2.boxPoints(theirs))


@SETTINGS
@given(
    st.floats(-100, 1000, width=32),
    st.floats(-100, 1000, width=32),
    st.floats(0, 500, width=32),
    st.floats(0, 500, width=32),
    st.floats(-90, 0, width=32, exclude_max=True),
)
def test_box_points(cx: float, cy: float, w: float, h: float, angle: float) -> None:
    rect = ((cx, cy), (w, h), angle)
    assert np.array_equal(geometry.box_points(geometry.RotatedRect(*rect)), cv2.boxPoints(rect))


@SETTINGS
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 30), st.just(2)),
        elements=st.floats(-1e3, 1e3, width=32),
    )
)
def test_polygon_area_and_perimeter(points: np.ndarray) -> None:
    assert geometry.polygon_area(points) == abs(cv2.contourArea(points))
    assert geometry.polygon_perimeter(points) == cv2.arcLength(points, True)


@SETTINGS
@given(binary_maps())
def test_dilate(bitmap: np.ndarray) -> None:
    assert np.array_equal(
        contours.dilate_2x2(bitmap), cv2.dilate(bitmap, np.ones((2, 2), np.uint8))
    )


@SETTINGS
@given(st.data(), st.integers(1, 40), st.integers(1, 40))
def test_fill_polygon_inside_the_image(data: st.DataObject, h: int, w: int) -> None:
    xs = data.draw(hnp.arrays(np.int32, 4, elements=st.integers(0, w - 1)))
    ys = data.draw(hnp.arrays(np.int32, 4, elements=st.integers(0, h - 1)))
    pts = np.stack([xs, ys], axis=1)
    ours, theirs = np.zeros((h, w), np.uint8), np.zeros((h, w), np.uint8)
    geometry.fill_polygon(ours, pts, 1)
    cv2.fillPoly(theirs, [pts], 1)
    assert np.array_equal(ours, theirs)


def test_fill_polygon_across_the_edge_differs_by_a_few_pixels_at_most() -> None:
    """Where a box leaves the score map, OpenCV clips its edges before stepping along them;
    ours steps differently there. The box score is a mean over hundreds of pixels: a few at the
    map's edge move it by a percent or so."""
    rng = np.random.default_rng(3)
    differing, worst = 0, 0
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(2, 40, 2))
        pts = np.stack([rng.integers(-8, w + 8, 4), rng.integers(-8, h + 8, 4)], 1).astype(np.int32)
        ours, theirs = np.zeros((h, w), np.uint8), np.zeros((h, w), np.uint8)
        geometry.fill_polygon(ours, pts, 1)
        cv2.fillPoly(theirs, [pts], 1)
        wrong = int((ours != theirs).sum())
        differing += wrong > 0
        worst = max(worst, wrong)
    print(f"\nfill across the edge: {differing}/2000 masks differ, by {worst} pixels at most")
    assert worst <= 32


# -- resampling -----------------------------------------------------------------------------


@SETTINGS
@given(
    hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 70), st.integers(1, 70), st.sampled_from([1, 3])),
        elements=st.integers(0, 255),
    ),
    st.integers(1, 100),
    st.integers(1, 100),
)
def test_resize_within_one_grey_level(image: np.ndarray, width: int, height: int) -> None:
    if image.shape[2] == 1:
        image = image[:, :, 0]
    ours = resample.resize_linear(image, width, height)
    theirs = cv2.resize(image, (width, height))
    assert ours.shape == theirs.shape
    assert np.abs(ours.astype(int) - theirs).max() <= 1


@SETTINGS
@given(st.data(), st.integers(4, 80), st.integers(4, 80))
def test_perspective_crop_within_one_grey_level(data: st.DataObject, h: int, w: int) -> None:
    image = data.draw(hnp.arrays(np.uint8, (h, w, 3), elements=st.integers(0, 255)))
    coord = st.floats(-5, 5, width=32)
    jitter = np.array([[data.draw(coord), data.draw(coord)] for _ in range(4)], np.float32)
    quad = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32) * 0.8 + jitter + w * 0.1
    width = max(1, int(np.linalg.norm(quad[0] - quad[1])))
    height = max(1, int(np.linalg.norm(quad[0] - quad[3])))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], np.float32)
    try:
        theirs_m = cv2.getPerspectiveTransform(quad, target)
    except cv2.error:
        return  # a degenerate quadrilateral
    ours_m = resample.perspective_transform(quad, target)
    assert np.allclose(ours_m, theirs_m, rtol=1e-6, atol=1e-6)
    ours = resample.warp_perspective_cubic(image, ours_m, width, height)
    theirs = cv2.warpPerspective(
        image, theirs_m, (width, height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE
    )
    assert np.abs(ours.astype(int) - theirs).max() <= 1


# -- decoding -------------------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def test_decode_matches_opencv() -> None:
    rng = np.random.default_rng(5)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (37, 53, 4), dtype=np.uint8), "RGBA")
    gray = rgb.convert("L")
    la = rgba.convert("LA")
    gray16 = Image.fromarray(rng.integers(0, 65536, (20, 30), dtype=np.uint16))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    exif = Image.Exif()
    exif[0x0112] = 6
    samples = {
        "png rgb": encoded(rgb, "PNG"),
        "png rgba": encoded(rgba, "PNG"),
        "png gray": encoded(gray, "PNG"),
        "png gray+alpha": encoded(la, "PNG"),
        "png 16-bit gray": encoded(gray16, "PNG"),
        "png palette": encoded(palette, "PNG"),
        "png palette+transparency": encoded(palette, "PNG", transparency=3),
        "jpeg": encoded(rgb, "JPEG", quality=80),
        "jpeg gray": encoded(gray, "JPEG"),
        "jpeg rotated by exif": encoded(rgb, "JPEG", exif=exif.tobytes()),
        "bmp": encoded(rgb, "BMP"),
        "tiff": encoded(rgb, "TIFF"),
        "webp lossless": encoded(rgb, "WEBP", lossless=True),
    }
    for name, data in samples.items():
        ours, theirs = ocr_ops.decode_image(data), OpenCvReference.decode(data)
        assert ours.shape == theirs.shape, name
        assert np.abs(ours.astype(int) - theirs).max() <= 1, name


# -- the whole pipeline ---------------------------------------------------------------------


def drawn(
    lines: Sequence[str],
    size: int = 28,
    angle: float = 0,
    contrast: int = 0,
    noise: float = 0,
    canvas: tuple[int, int] = (900, 320),
    seed: int = 0,
) -> bytes:
    font = ImageFont.truetype(str(FONT), size)
    image = Image.new("RGB", canvas, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((30, 20 + int(size * 2.2) * i), line, fill=(contrast,) * 3, font=font)
    if angle:
        image = image.rotate(angle, expand=True, fillcolor=(255, 255, 255))
    if noise:
        rng = np.random.default_rng(seed)
        arr = np.asarray(image).astype(np.float32) + rng.normal(0, noise, (*image.size[::-1], 3))
        image = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).filter(ImageFilter.SMOOTH)
    return encoded(image, "PNG")


CASES: dict[str, Callable[[], bytes]] = {
    "four lines": lambda: drawn(
        [
            "The quick brown fox jumps over the lazy dog.",
            "Edge inference daemon 2024: OCR test",
            "Invoice #48213 total $1,234.56 due 03/15",
        ]
    ),
    "small text": lambda: drawn(["small print, 14 px", "second line 0123456789"], size=14),
    "large text": lambda: drawn(["LARGE 64"], size=64, canvas=(700, 200)),
    "tilted 7 degrees": lambda: drawn(["A tilted line of text", "and its neighbour"], angle=7),
    "tilted -20 degrees": lambda: drawn(["Steeper still"], angle=-20, canvas=(500, 200)),
    "upside down": lambda: drawn(["Edge inference daemon", "Invoice #48213"], angle=180),
    "vertical": lambda: drawn(["Sideways words"], angle=90, canvas=(500, 160)),
    "low contrast": lambda: drawn(["faint grey text on white"], contrast=170),
    "noisy": lambda: drawn(["Noise does not stop it", "second line"], noise=25, seed=1),
    "blank": lambda: encoded(Image.new("RGB", (640, 480), "white"), "PNG"),
    "tiny": lambda: encoded(Image.new("RGB", (3, 2), "black"), "PNG"),
    "tall and narrow": lambda: drawn(["ab"], size=20, canvas=(60, 900)),
    "wide": lambda: drawn(["a very wide strip of text " * 6], size=20, canvas=(4000, 80)),
    "huge": lambda: drawn(["text on a large page"], size=90, canvas=(5000, 3000)),
    "jpeg": lambda: encoded(
        Image.open(io.BytesIO(drawn(["JPEG artefacts 123"]))).convert("RGB"), "JPEG", quality=60
    ),
}


@pytest.fixture(scope="module")
def ocr() -> Any:
    from tests.unit.edged.test_ocr_ops import MODELS, Ocr

    return Ocr(MODELS)


def run_pipeline(
    ocr: Any, data: bytes, reference: bool
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """decode, det, cls, rec: with the current functions or with the OpenCV reference."""
    ref = OpenCvReference
    image = ref.decode(data) if reference else ocr_ops.decode_image(data)
    x, scale = ref.det_preprocess(image) if reference else ocr_ops.det_preprocess(image, 960)
    prob = ocr.det.run(None, {"x": x})[0]
    post = ref.det_postprocess if reference else ocr_ops.det_postprocess
    boxes, _ = post(prob, image.shape, scale, unclip_ratio=2.0)
    crop = ref.crop_text if reference else ocr_ops.crop_text
    crops = [crop(image, box) for box in boxes]
    if not crops:
        return boxes, [], np.zeros(0, np.float32)
    cls_out = ocr.cls.run(None, {"x": ocr_ops.cls_preprocess(crops)})[0]
    crops = ocr_ops.apply_cls(crops, cls_out)
    rec_out = ocr.rec.run(None, {"x": ocr_ops.rec_preprocess(crops)})[0]
    texts, conf = ocr_ops.ctc_decode(rec_out, ocr.keys)
    return boxes, texts, conf


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_reads_what_opencv_read(ocr: Any, name: str) -> None:
    """Same boxes (within a pixel), same text, confidences within 0.01."""
    if not FONT.is_file():
        pytest.skip(f"{FONT} is missing (Debian package fonts-dejavu-core)")
    data = CASES[name]()
    ours = run_pipeline(ocr, data, reference=False)
    theirs = run_pipeline(ocr, data, reference=True)
    print(f"\n{name}: {theirs[1]}")
    assert ours[0].shape == theirs[0].shape
    if len(ours[0]):
        assert np.abs(ours[0] - theirs[0]).max() <= 1.5
    assert ours[1] == theirs[1]
    assert np.allclose(ours[2], theirs[2], atol=0.01)
