"""Image file headers read from real files made with cv2.imencode, cut short, padded and garbled."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from edged.sources.image_header import Header, read_header

pytestmark = pytest.mark.unit


def encoded(suffix: str, params: tuple[int, ...] = ()) -> bytes:
    """A 96x128 picture with detail in every row, so that each cut loses some of it."""
    rows = np.linspace(0, 255, 96, dtype=np.uint8)[:, None, None]
    image = (rows + np.arange(128, dtype=np.uint8)[None, :, None] * 3 + np.array([0, 80, 160], np.uint8)).astype(np.uint8)
    ok, data = cv2.imencode(suffix, image, list(params))
    assert ok
    return data.tobytes()


def decodes(data: bytes) -> bool:
    try:
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) is not None
    except cv2.error:
        return False


JPEGS = {"baseline": encoded(".jpg"), "progressive": encoded(".jpg", (cv2.IMWRITE_JPEG_PROGRESSIVE, 1))}


@pytest.mark.parametrize(("suffix", "kind", "signature"), [(".jpg", "JPEG", 3), (".png", "PNG", 8), (".webp", "WebP", 12)])
def test_a_whole_file_is_whole_and_every_shorter_one_is_cut(suffix: str, kind: str, signature: int) -> None:
    data = encoded(suffix)
    assert read_header(data) == Header(kind, None)
    for end in range(signature, len(data)):
        header = read_header(data[:end])
        assert header is not None and header.kind == kind and header.cut, end


@pytest.mark.parametrize("name", list(JPEGS))
def test_a_jpeg_cut_in_its_image_data_is_cut_although_libjpeg_decodes_it(name: str) -> None:
    data = JPEGS[name]
    half = data[: len(data) // 2]
    header = read_header(half)
    assert header is not None and header.cut == "it ends before its end-of-image marker"
    assert read_header(data[:-2]) == header  # all of the image data there, only the marker missing


def test_padding_or_a_trailer_after_the_end_of_a_jpeg_leaves_it_whole() -> None:
    data = JPEGS["baseline"]
    for after in (b"\x00" * 4096, b"\xff" * 7, b"SEFH trailer\xff\xd8 of a phone\x00SEFT"):
        assert read_header(data + after) == Header("JPEG", None) and decodes(data + after)


def test_a_jpeg_cut_after_a_thumbnail_that_ends_with_its_own_marker_is_cut() -> None:
    # An EXIF thumbnail is a whole JPEG, end-of-image marker and all, inside the header.
    main, thumbnail = JPEGS["baseline"], JPEGS["progressive"]
    app1 = b"Exif\x00\x00" + thumbnail
    data = main[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + main[2:]
    assert read_header(data) == Header("JPEG", None) and decodes(data)
    header = read_header(data[: len(data) - len(main) // 2])
    assert header is not None and header.cut == "it ends before its end-of-image marker"


def test_garbage_before_a_marker_and_fill_bytes_are_skipped_as_libjpeg_skips_them() -> None:
    data = JPEGS["baseline"]
    assert data[20:22] == b"\xff\xdb"  # after the JFIF segment
    garbled = data[:20] + b"junk\xff\x00" + b"\xff" * 5 + data[20:]
    assert read_header(garbled) == Header("JPEG", None) and decodes(garbled)


def test_any_bytes_after_a_jpeg_or_png_signature_give_an_answer() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tail = rng.integers(0, 256, int(rng.integers(0, 300)), np.uint8).tobytes()
        for start in (b"\xff\xd8\xff", b"\xff\xd8\xff\xda", b"\x89PNG\r\n\x1a\n", b"RIFF\xff\xff\xff\xffWEBP"):
            assert isinstance(read_header(start + tail), Header)


def test_other_formats_are_not_read() -> None:
    assert read_header(encoded(".bmp")) is None and read_header(encoded(".tiff")) is None
    assert read_header(b"") is None and read_header(b"GIF89a") is None


@pytest.mark.parametrize("suffix", [".png", ".webp", ".bmp", ".tiff"])
def test_opencv_refuses_the_other_formats_cut_short_itself(suffix: str) -> None:
    # Only a JPEG cut short is decoded (its missing rows grey); these are refused by OpenCV, so a
    # BMP or TIFF still being written is skipped as unreadable without a check of its own.
    data = encoded(suffix)
    assert decodes(data)
    assert not any(decodes(data[:end]) for end in range(0, len(data) - 1, max(1, len(data) // 97)))
    assert not decodes(data[:-1])
