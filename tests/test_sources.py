"""Camera sources against real files: videos written with cv2.VideoWriter, images written with cv2.imwrite."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal, TypeVar

import cv2
import numpy as np
import pytest
from daemon import write_mjpeg
from images import black_png, lying_jpeg, oversized_png, truncated_jpeg
from test_image_header import exif

from edged.capture import Capture
from edged.errors import ImageError, SourceError
from edged.settings.sources import (
    KINDS,
    FileSourceConfig,
    ImagesSourceConfig,
    SourceBase,
    SyntheticSourceConfig,
    V4l2SourceConfig,
    mask_credentials,
)
from edged.sources.file import FileSource
from edged.sources.images import MAX_FILE_BYTES, ImagesSource, image_size, list_images, read_image
from edged.sources.registry import SOURCES, open_source, sizes_vary
from edged.sources.scenes import SceneGenerator
from edged.sources.synthetic import SyntheticSource
from edged.sources.v4l2 import V4l2Source

W, H = 128, 64
BITS = 7  # frame numbers up to 127, one 16-px column per bit
SEED = 3  # shared with test_capture so the scene textures are built once per run


def coded_frame(number: int, width: int = W, height: int = H) -> np.ndarray:
    """A frame whose number survives lossy codecs: bit k is a black or white 16-px column."""
    img = np.full((height, width, 3), 128, np.uint8)
    for k in range(BITS):
        img[:, 16 * k : 16 * (k + 1)] = 255 if (number >> k) & 1 else 0
    return img


def frame_number(img: np.ndarray | None) -> int:
    assert img is not None
    h = img.shape[0]
    centres = [img[h // 4 : 3 * h // 4, 16 * k + 4 : 16 * k + 12].mean() for k in range(BITS)]
    return sum(1 << k for k, c in enumerate(centres) if c > 128)


def write_video(path: Path, fourcc: str, count: int = 64, fps: float = 30.0) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*fourcc), fps, (W, H))
    if not writer.isOpened():
        pytest.skip(f"this OpenCV cannot write {fourcc} {path.suffix}")
    for i in range(count):
        writer.write(coded_frame(i))
    writer.release()
    return path


S = TypeVar("S", FileSource, ImagesSource, SyntheticSource)


def opened(source: S) -> S:
    source.open()
    return source


@pytest.fixture(params=[("avi", "MJPG"), ("mp4", "mp4v")], ids=["mjpg-avi", "mp4v-mp4"])
def video(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    ext, fourcc = request.param
    return write_video(tmp_path / f"clip.{ext}", fourcc)


# ---- video files -------------------------------------------------------------------------------


def test_video_is_read_in_order_into_the_same_buffer_then_ends(video: Path) -> None:
    src = opened(FileSource(FileSourceConfig(path=video, loop=False, realtime=False)))
    first = src.read(None)
    buf = np.empty_like(first)
    pointer = buf.ctypes.data
    numbers = [frame_number(first)]
    while (img := src.read(buf)) is not None:
        assert img is buf and img.ctypes.data == pointer
        numbers.append(frame_number(img))
    src.close()
    assert numbers == list(range(64))


def test_video_loop_restarts_at_the_first_frame(video: Path) -> None:
    src = opened(FileSource(FileSourceConfig(path=video, loop=True, realtime=False)))
    buf = np.empty((H, W, 3), np.uint8)
    numbers = [frame_number(src.read(buf)) for _ in range(64 + 10)]
    src.close()
    assert numbers == list(range(64)) + list(range(10))


def test_video_grab_skips_frames_unconverted_and_retrieve_converts_the_last_one_into_the_buffer(video: Path) -> None:
    src = opened(FileSource(FileSourceConfig(path=video, loop=True, realtime=False)))
    buf = np.empty((H, W, 3), np.uint8)
    taken = []
    for step in range(20):
        for _ in range(step % 4 + 1):
            assert src.grab()
        image = src.retrieve(buf)
        assert image is buf
        taken.append(frame_number(image))
    src.close()
    grabbed = np.cumsum([step % 4 + 1 for step in range(20)]) - 1
    assert taken == [int(n) % 64 for n in grabbed]  # past the end it loops, through grab alone


def test_video_grab_without_loop_ends_with_false(video: Path) -> None:
    src = opened(FileSource(FileSourceConfig(path=video, loop=False, realtime=False)))
    assert all(src.grab() for _ in range(64))
    assert src.grab() is False
    src.close()


def test_video_retrieve_with_no_frame_grabbed_is_a_source_error_naming_the_file(video: Path) -> None:
    src = opened(FileSource(FileSourceConfig(path=video)))
    with pytest.raises(SourceError, match=f"a frame of video file {video} could not be decoded"):
        src.retrieve(None)
    src.close()


def test_video_realtime_paces_to_the_file_fps(tmp_path: Path) -> None:
    path = write_video(tmp_path / "fast.avi", "MJPG", count=20, fps=50.0)
    assert FileSource(FileSourceConfig(path=path, realtime=False)).pace() is None
    src = opened(FileSource(FileSourceConfig(path=path, realtime=True)))
    assert src.pace() == pytest.approx(1 / 50)
    src.close()

    cap = Capture(lambda: FileSource(FileSourceConfig(path=path, loop=False, realtime=True)), "cam0")
    cap.start()
    taken = []
    while (frame := cap.take(timeout_s=2.0)) is not None:
        taken.append((frame.frame_id, frame.t_capture_ns))
    cap.stop()
    assert cap.state == "ended"
    (first_id, first_ns), (last_id, last_ns) = taken[0], taken[-1]
    assert last_id - first_id >= 10
    # Loose lower bound only: never faster than the file's rate (10% slack for timer granularity).
    assert (last_ns - first_ns) / 1e9 / (last_id - first_id) >= 0.9 / 50


def test_an_unpaced_video_hands_every_frame_to_a_consumer_slower_than_its_decoding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``realtime = false``: the next frame is decoded only once the one before was taken, so a
    consumer slower than FFmpeg (any model) still gets every frame, in order, then the end."""
    caplog.set_level(logging.INFO, logger="edged")
    path = write_video(tmp_path / "shift.avi", "MJPG", count=20, fps=50.0)
    assert FileSource(FileSourceConfig(path=path, realtime=False)).keeps_every_frame()
    assert not FileSource(FileSourceConfig(path=path, realtime=True)).keeps_every_frame()
    cap = Capture(lambda: FileSource(FileSourceConfig(path=path, loop=False, realtime=False)), "cam0")
    cap.start()
    ids = []
    slow = threading.Event()
    while (frame := cap.take(timeout_s=2.0)) is not None:
        ids.append(frame.frame_id)
        slow.wait(0.01)  # the model's time: the file decodes a frame in well under that
    cap.stop()
    assert cap.state == "ended"
    assert ids == list(range(20))
    assert "decoding every frame" in caplog.text  # not "only the frames the model may take"


def test_video_with_implausible_fps_is_paced_at_the_fallback(tmp_path: Path) -> None:
    path = write_video(tmp_path / "odd.avi", "MJPG", count=4, fps=1000.0)
    src = opened(FileSource(FileSourceConfig(path=path)))
    assert src.pace() == pytest.approx(1 / 25.0)
    src.close()


def test_missing_video_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.mp4"
    with pytest.raises(SourceError, match=r"nowhere\.mp4 does not exist"):
        FileSource(FileSourceConfig(path=path)).open()


def test_corrupt_video_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.avi"
    path.write_bytes(b"RIFF\x00\x00\x00\x00not a video at all" * 50)
    with pytest.raises(SourceError, match=r"broken\.avi"):
        src = FileSource(FileSourceConfig(path=path, loop=False))
        src.open()
        src.read(None)


def test_a_video_deleted_while_it_plays_is_named_gone_when_it_loops(tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.avi", "MJPG", count=4)
    src = opened(FileSource(FileSourceConfig(path=path, loop=True)))
    assert [src.grab() for _ in range(4)] == [True] * 4
    path.unlink()
    with pytest.raises(SourceError, match=r"clip\.avi does not exist"):
        src.grab()  # the end, and the file reopened for the next pass: it is gone, not unrecognised
    src.close()


def test_an_empty_video_file_is_named_empty(tmp_path: Path) -> None:
    path = tmp_path / "upload.mp4"
    path.touch()
    with pytest.raises(SourceError, match=r"upload\.mp4 is empty \(0 bytes\)"):
        FileSource(FileSourceConfig(path=path)).open()


def test_a_video_whose_frames_are_over_the_limit_is_refused_before_one_is_decoded(tmp_path: Path) -> None:
    # 4.7 MB of 10000x10000 frames: FFmpeg decoded each, 790 MB at the first, and edged planned for them.
    path = write_mjpeg(tmp_path / "huge.mjpeg", 10000, 10000)
    src = FileSource(FileSourceConfig(path=path))
    why = r"huge\.mjpeg has frames of 10000x10000 pixels, over the 33177600 pixels \(7680x4320\) edged takes \(make a copy"
    with pytest.raises(SourceError, match=why):
        src.open()
    src.close()


def test_a_video_replaced_by_one_over_the_limit_while_it_plays_is_refused_when_it_loops(tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.avi", "MJPG", count=4)
    src = opened(FileSource(FileSourceConfig(path=path, loop=True)))
    assert [src.grab() for _ in range(4)] == [True] * 4
    write_mjpeg(tmp_path / "new.mjpeg", 8000, 4200).replace(path)
    with pytest.raises(SourceError, match=r"clip\.avi has frames of 8000x4200 pixels, over the 33177600 pixels"):
        src.grab()  # the end, and the file reopened for the next pass
    src.close()


def test_a_video_that_ends_before_the_frames_its_container_lists_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole = write_video(tmp_path / "whole.avi", "MJPG", count=40)
    cut = tmp_path / "cut.avi"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a copy cut short
    for path in (whole, cut):
        src = opened(FileSource(FileSourceConfig(path=path, loop=True)))
        played = [src.grab() for _ in range(100)]  # past the end of either, twice
        assert all(played)
        src.close()
    [line] = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    assert str(cut) in line and "of the 40 frames its container lists" in line and "truncated or damaged" in line


def write_vfr_video(path: Path, durations_s: list[float]) -> Path:
    """A Matroska MJPEG file whose frame i lasts durations_s[i]: a variable frame rate, as a phone or
    a recorder that writes only on change gives, in a container that lists no frame count."""
    gi = pytest.importorskip("gi")
    gi.require_version("Gst", "1.0")
    from gi.repository import Gst

    Gst.init(None)
    pipeline = Gst.parse_launch(
        f"appsrc name=src format=time caps=video/x-raw,format=BGR,width={W},height={H},framerate=0/1 "
        f"! videoconvert ! jpegenc ! matroskamux ! filesink location={path}"
    )
    src = pipeline.get_by_name("src")
    pipeline.set_state(Gst.State.PLAYING)
    t_ns = 0
    for i, duration_s in enumerate(durations_s):
        buffer = Gst.Buffer.new_wrapped(coded_frame(i).tobytes())
        buffer.pts, buffer.duration = t_ns, round(duration_s * Gst.SECOND)
        t_ns += buffer.duration
        src.emit("push-buffer", buffer)
    src.emit("end-of-stream")
    pipeline.get_bus().timed_pop_filtered(Gst.CLOCK_TIME_NONE, Gst.MessageType.EOS | Gst.MessageType.ERROR)
    pipeline.set_state(Gst.State.NULL)
    return path


def test_a_variable_frame_rate_video_played_to_its_end_is_not_said_to_be_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its container lists its duration times a nominal rate, several times the frames it holds: the
    last frame's time at the file's end tells it whole; the same file cut short is still said."""
    whole = write_vfr_video(tmp_path / "vfr.mkv", [1 / 30] * 40 + [0.5] * 20)
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for path in (whole, cut):
        src = opened(FileSource(FileSourceConfig(path=path, loop=False)))
        while src.grab():
            pass
        src.close()
    said = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    assert len(said) == 1 and str(cut) in said[0], said


# ---- image folders and globs -------------------------------------------------------------------


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "shots"
    folder.mkdir()
    for i, name in [(2, "b.png"), (0, "03.jpg"), (1, "a.bmp"), (3, "c.PNG"), (4, "d.tiff")]:
        cv2.imwrite(str(folder / name), coded_frame(i))
    (folder / "notes.txt").write_text("not an image")
    (folder / "b2.png").write_bytes(b"\x89PNG truncated")
    return folder


def test_folder_is_read_sorted_skipping_unreadable_images(image_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert [Path(p).name for p in list_images(str(image_dir))] == ["03.jpg", "a.bmp", "b.png", "b2.png", "c.PNG", "d.tiff"]
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    buf = np.empty((H, W, 3), np.uint8)
    numbers = []
    while (img := src.read(buf)) is not None:
        assert img is buf
        numbers.append(frame_number(img))
    assert numbers == [0, 1, 2, 3, 4]
    assert src.skipped == 1
    assert sum("b2.png" in r.getMessage() for r in caplog.records) == 1


def test_an_image_over_what_opencv_decodes_is_skipped_as_unreadable(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    oversized_png(image_dir / "b3.png")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    numbers = []
    while (img := src.read(None)) is not None:
        numbers.append(frame_number(img))
    assert numbers == [0, 1, 2, 3, 4]
    assert src.skipped == 2
    assert sum("b3.png" in r.getMessage() for r in caplog.records) == 1


def test_a_jpeg_cut_short_is_skipped_as_truncated_and_one_padded_after_its_end_is_read(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A camera's upload still being written was decoded with its missing rows grey and judged as real.
    truncated_jpeg(image_dir / "b1.jpg", coded_frame(7))
    padded = cv2.imencode(".jpg", coded_frame(5))[1]
    (image_dir / "b0.jpg").write_bytes(padded.tobytes() + bytes(512))  # some cameras pad after the end
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    numbers = []
    while (img := src.read(None)) is not None:
        numbers.append(frame_number(img))
    assert numbers == [0, 1, 2, 5, 3, 4]
    assert src.skipped == 2  # b1.jpg and b2.png
    [line] = [r.getMessage() for r in caplog.records if "b1.jpg" in r.getMessage()]
    assert "truncated JPEG" in line and "is it still being written" in line, line


def test_an_image_claiming_more_pixels_than_a_camera_gives_is_skipped_before_it_is_decoded(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 8000x4400 in a few kilobytes was decoded into 106 MB; 30000x30000 would take 2.7 GB, all of a 4 GB board.
    black_png(image_dir / "b3.png", 8000, 4400)
    lying_jpeg(image_dir / "b4.jpg", 4400, 8000)
    black_png(image_dir / "b5.png", 4320, 7680)  # 8K on its side is read
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    sizes = []
    while (img := src.read(None)) is not None:
        sizes.append(img.shape[:2])
    assert sizes == [(H, W)] * 3 + [(7680, 4320)] + [(H, W)] * 2
    assert src.skipped == 3  # b2.png, b3.png and b4.jpg
    lines = [r.getMessage() for r in caplog.records]
    limit = "pixels, over the 33177600 pixels (7680x4320) edged decodes"
    assert any("b3.png" in line and f"its PNG header claims 8000x4400 {limit}" in line for line in lines), lines
    assert any("b4.jpg" in line and f"its JPEG header claims 4400x8000 {limit}" in line for line in lines), lines


def test_an_image_with_a_side_longer_than_edged_decodes_is_skipped_before_it_is_decoded(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1000000x33 in 96 KB is within MAX_PIXELS, but an anomaly model's resize held 2 GB for its width.
    black_png(image_dir / "b3.png", 1000000, 33)
    black_png(image_dir / "b4.png", 65535, 2)  # a JPEG's longest side is read
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    sizes = []
    while (img := src.read(None)) is not None:
        sizes.append(img.shape[:2])
    assert sizes == [(H, W)] * 3 + [(2, 65535)] + [(H, W)] * 2
    assert src.skipped == 2  # b2.png and b3.png
    [line] = [r.getMessage() for r in caplog.records if "b3.png" in r.getMessage()]
    assert "its PNG header claims 1000000x33 pixels, a side longer than the 65535 edged decodes" in line, line


def test_a_jpeg_claiming_a_side_longer_than_a_jpeg_holds_is_skipped_naming_the_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # libjpeg decodes at most 65500 a side: such a header was skipped as "a corrupt JPEG", not saying why.
    cv2.imwrite(str(tmp_path / "a.png"), coded_frame(1))
    lying_jpeg(tmp_path / "b.jpg", 100, 65501)
    src = opened(ImagesSource(ImagesSourceConfig(path=str(tmp_path), loop=False)))
    assert frame_number(src.read(None)) == 1 and src.read(None) is None and src.skipped == 1
    [line] = [r.getMessage() for r in caplog.records if "b.jpg" in r.getMessage()]
    assert "its JPEG header claims 100x65501 pixels, a side longer than the 65500 a JPEG holds" in line, line
    assert image_size(str(tmp_path / "b.jpg")) is None


def test_an_image_of_a_format_whose_size_is_not_read_first_is_skipped_naming_those_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A glob or a file may name any format OpenCV decodes; only those whose header is read are.
    cv2.imwrite(str(tmp_path / "a.png"), coded_frame(1))
    cv2.imwrite(str(tmp_path / "b.ppm"), coded_frame(2))
    src = opened(ImagesSource(ImagesSourceConfig(path=str(tmp_path / "*"), loop=False)))
    assert frame_number(src.read(None)) == 1 and src.read(None) is None and src.skipped == 1
    [line] = [r.getMessage() for r in caplog.records if "b.ppm" in r.getMessage()]
    assert "not a JPEG, PNG, WebP, BMP or TIFF image" in line, line


def test_a_file_larger_than_any_image_is_skipped_without_being_read(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open(image_dir / "b3.png", "wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk is used
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    while src.read(None) is not None:
        pass
    assert src.skipped == 2
    [line] = [r.getMessage() for r in caplog.records if "b3.png" in r.getMessage()]
    assert "265 MB, more than any image of 33177600 pixels (7680x4320) takes" in line, line


def test_folder_loops_and_logs_an_unreadable_image_once(image_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=True)))
    numbers = [frame_number(src.read(None)) for _ in range(12)]
    assert numbers == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert src.skipped == 2
    assert sum("b2.png" in r.getMessage() for r in caplog.records) == 1
    assert src.pace() == pytest.approx(1 / 5.0)


def test_an_unpaced_folder_asks_for_every_image_and_names_each_by_its_file(image_dir: Path) -> None:
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False, pace=False)))
    assert src.pace() is None and src.keeps_every_frame()
    names = []
    while src.read(None) is not None:
        names.append(src.frame_name())
    assert names == ["03.jpg", "a.bmp", "b.png", "c.PNG", "d.tiff"]  # b2.png is unreadable, skipped
    glob = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir / "*.png"), loop=False)))
    glob.read(None)
    assert glob.frame_name() == str(image_dir / "b.png") and not glob.keeps_every_frame()


def test_each_pass_reads_the_folder_as_it_is_then(image_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "edged.sources.images")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=True, pace=False)))
    assert frame_number(src.read(None)) == 0 and src.frame_name() == "03.jpg"
    (image_dir / "c.PNG").rename(image_dir / "e.png")  # renamed, and one added, while it is read
    cv2.imwrite(str(image_dir / "f.png"), coded_frame(5))
    names = []
    while len(names) < 10:
        assert src.read(None) is not None
        names.append(src.frame_name())
    assert names == ["a.bmp", "b.png", "d.tiff", "03.jpg", "a.bmp", "b.png", "d.tiff", "e.png", "f.png", "03.jpg"]
    assert src.skipped == 3  # b2.png in each pass, c.PNG in the first alone
    assert any("7 images now (6 before this pass)" in r.getMessage() for r in caplog.records)


def test_a_folder_whose_images_all_went_says_why_none_could_be_read(image_dir: Path) -> None:
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=True)))
    for image in image_dir.iterdir():
        image.unlink()
    with pytest.raises(SourceError, match=r"none of the 6 images .* \(the last, .*d\.tiff: No such file or directory"):
        src.read(None)


def test_a_file_name_with_control_characters_is_logged_on_one_line(
    image_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (image_dir / "b2.png").rename(image_dir / "b2\n2026-01-01 00:00:00 INFO edged: forged\x1b[2K.png")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    while src.read(None) is not None:
        pass
    [line] = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "b2\\n2026" in line and "\\x1b[2K.png" in line


def test_glob_selects_and_sorts_matching_files(image_dir: Path) -> None:
    assert [Path(p).name for p in list_images(str(image_dir / "*.png"))] == ["b.png", "b2.png"]
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir / "*.png"), loop=False)))
    assert frame_number(src.read(None)) == 2
    assert src.read(None) is None
    assert src.skipped == 1


def test_a_recursive_glob_lists_what_globs_does_and_each_image_once_through_links_back_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "line"
    for name in ("x.png", "sub/y.png", "sub/deep/z.PNG", ".cache/h.png", "sub/.hid.png", "sub/deep/n.txt"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    patterns = ["line/**/*.png", "line/**", "line/*/*.png", "line/**/deep/*", "**/*.PNG", f"{tree}/**/.*"]
    for pattern in patterns:  # without links, exactly glob's own list
        assert list_images(pattern) == sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)), pattern
    (tree / "loop").symlink_to(".")  # a link back up: glob listed x.png 41 times, and with two, never returned
    (tree / "sub" / "up").symlink_to("..")
    (tree / "today").symlink_to("sub")  # the same folder by a second path: listed once, under the first met
    found: list[list[str]] = []
    thread = threading.Thread(target=lambda: found.append(list_images(f"{tree}/**/*.png")), daemon=True)
    thread.start()
    thread.join(30)
    assert found == [[str(tree / "sub" / "y.png"), str(tree / "x.png")]]


def test_image_of_another_size_comes_back_as_a_new_array(tmp_path: Path) -> None:
    cv2.imwrite(str(tmp_path / "0.png"), coded_frame(5))
    cv2.imwrite(str(tmp_path / "1.png"), coded_frame(6, width=W * 2, height=H * 2))
    src = opened(ImagesSource(ImagesSourceConfig(path=str(tmp_path), loop=False)))
    buf = np.empty((H, W, 3), np.uint8)
    assert src.read(buf) is buf
    bigger = src.read(buf)
    assert bigger is not None and bigger is not buf and bigger.shape == (H * 2, W * 2, 3)


def test_empty_folder_missing_folder_and_unmatched_glob_raise(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    for path, message in [
        (tmp_path / "empty", "no images found"),
        (tmp_path / "gone", "does not exist"),
        (tmp_path / "*.jpg", "no images found"),
    ]:
        with pytest.raises(SourceError, match=message):
            ImagesSource(ImagesSourceConfig(path=str(path))).open()


def test_folder_with_only_unreadable_images_raises_instead_of_spinning(tmp_path: Path) -> None:
    (tmp_path / "x.jpg").write_bytes(b"junk")
    (tmp_path / "y.jpg").write_bytes(b"junk")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(tmp_path), loop=True)))
    with pytest.raises(SourceError, match="none of the 2 images"):
        src.read(None)


# ---- v4l2 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "named"), [("/dev/video97", "/dev/video97"), ("97", "/dev/video97"), ("²", "²")])
def test_missing_v4l2_device_says_what_to_check(device: str, named: str) -> None:
    """``²`` is a digit to ``str.isdigit`` and none to ``int``: it stopped the capture thread."""
    src = V4l2Source(V4l2SourceConfig(device=device))
    with pytest.raises(SourceError, match=rf"{named} does not exist.*plugged in"):
        src.open()
    src.close()


def test_v4l2_on_a_file_that_is_no_camera_fails_clearly(tmp_path: Path) -> None:
    fake = tmp_path / "video0"
    fake.write_bytes(b"")
    with pytest.raises(SourceError, match=r"cannot open camera .*video0 with V4L2"):
        V4l2Source(V4l2SourceConfig(device=str(fake))).open()


class NegotiatedCapture:
    """A V4L2 camera as OpenCV opens it, giving frames of ``size`` whatever is asked."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.values = {cv2.CAP_PROP_FRAME_WIDTH: size[0], cv2.CAP_PROP_FRAME_HEIGHT: size[1], cv2.CAP_PROP_FPS: 30.0}
        self.values[cv2.CAP_PROP_FOURCC] = cv2.VideoWriter.fourcc(*"MJPG")
        self.released = False

    def isOpened(self) -> bool:
        return True

    def set(self, prop: int, value: float) -> bool:
        return True

    def get(self, prop: int) -> float:
        return float(self.values.get(prop, 0))

    def release(self) -> None:
        self.released = True


def test_a_v4l2_camera_that_gives_frames_over_the_limit_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asked for at most 8K, a camera may give what it likes; before, its frames were taken.
    device = tmp_path / "video0"
    device.touch()
    camera = NegotiatedCapture((10000, 10000))
    monkeypatch.setattr(cv2, "VideoCapture", lambda target, api: camera)
    src = V4l2Source(V4l2SourceConfig(device=str(device)))
    why = r"video0 gives frames of 10000x10000 pixels, over the 33177600 pixels \(7680x4320\) edged takes, not the 1280x720"
    with pytest.raises(SourceError, match=why):
        src.open()
    src.close()
    assert camera.released


# ---- synthetic -----------------------------------------------------------------------------------


def test_synthetic_is_deterministic_renders_in_place_and_frame_i_is_scene_i() -> None:
    cfg = SyntheticSourceConfig(width=96, height=64, fps=100.0, seed=SEED)
    a, b = opened(SyntheticSource(cfg)), opened(SyntheticSource(cfg))
    buf = np.empty((64, 96, 3), np.uint8)
    generator = SceneGenerator(width=96, height=64, seed=SEED)
    for index in range(5):
        image = a.read(buf)
        assert image is buf
        expected = generator.render(index)  # so the generator's boxes are the ground truth of frame `index`
        np.testing.assert_array_equal(image, expected.image)
        np.testing.assert_array_equal(b.read(None), expected.image)
    assert a.pace() == pytest.approx(0.01)


def test_synthetic_grab_skips_scenes_and_retrieve_renders_the_last_one() -> None:
    src = opened(SyntheticSource(SyntheticSourceConfig(width=96, height=64, seed=SEED)))
    generator = SceneGenerator(width=96, height=64, seed=SEED)
    for _ in range(3):
        assert src.grab()
    np.testing.assert_array_equal(src.retrieve(None), generator.render(2).image)
    np.testing.assert_array_equal(src.read(None), generator.render(3).image)


def test_synthetic_retrieve_before_grab_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="grab"):
        opened(SyntheticSource(SyntheticSourceConfig(width=96, height=64, seed=SEED))).retrieve(None)


def test_synthetic_renders_a_new_array_when_the_buffer_does_not_fit() -> None:
    src = opened(SyntheticSource(SyntheticSourceConfig(width=96, height=64, seed=SEED)))
    wrong = np.empty((10, 10, 3), np.uint8)
    image = src.read(wrong)
    assert image is not wrong and image.shape == (64, 96, 3)


# ---- registry ------------------------------------------------------------------------------------


def test_open_source_picks_the_class_for_each_type(tmp_path: Path) -> None:
    cases: list[tuple[SourceBase, type]] = [
        (SyntheticSourceConfig(), SyntheticSource),
        (FileSourceConfig(path=tmp_path / "x.mp4"), FileSource),
        (ImagesSourceConfig(path=str(tmp_path)), ImagesSource),
        (V4l2SourceConfig(), V4l2Source),
    ]
    for cfg, cls in cases:
        source = open_source(cfg)
        assert type(source) is cls
        assert source.channel_order == "bgr"


@pytest.mark.parametrize("name", list(SOURCES))
def test_each_registered_type_name_is_the_one_its_config_declares(name: str) -> None:
    config = KINDS[name]
    assert config.model_fields["type"].default == name


def test_credentials_are_masked_and_an_abstract_socket_name_is_left_alone() -> None:
    assert mask_credentials("rtsp://admin:s3cret@10.0.0.5/cam") == "rtsp://***@10.0.0.5/cam"
    assert mask_credentials("ipc://@edged-trigger") == "ipc://@edged-trigger"  # no user: it read ipc://***@


def test_only_a_video_file_source_reports_a_missing_file(tmp_path: Path) -> None:
    gone = tmp_path / "gone.mp4"
    assert FileSourceConfig(path=gone).file_problems() == [f"source.path: video file {gone} does not exist"]
    folder = tmp_path / "clip.mp4"
    folder.mkdir()
    [problem] = FileSourceConfig(path=folder).file_problems()
    assert "is a folder, not a video file" in problem and 'type = "images"' in problem
    gone.write_bytes(b"x")
    assert FileSourceConfig(path=gone).file_problems() == []
    assert FileSourceConfig(path=tmp_path / ("x" * 5000)).file_problems() != []
    for cfg in (SyntheticSourceConfig(), ImagesSourceConfig(path=str(tmp_path / "none")), V4l2SourceConfig(device="/nope")):
        assert cfg.file_problems() == []


@pytest.mark.integration
def test_the_scene_painter_is_loaded_only_when_a_synthetic_source_opens() -> None:
    probe = (
        "import sys\n"
        "from edged.config import Settings\n"
        "from edged.settings.sources import SyntheticSourceConfig\n"
        "from edged.sources.registry import open_source\n"
        "def painter(): return any(name.endswith('.scenes') for name in sys.modules)\n"
        "source = open_source(SyntheticSourceConfig(width=64, height=64))\n"
        "print(painter())\n"
        "source.open()\n"
        "print(painter())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]


def test_only_an_image_folder_declares_frames_of_varying_size() -> None:
    # Each size of an image folder gets its own plan; a camera's new size is a renegotiation.
    assert sizes_vary(ImagesSourceConfig(path="imgs"))
    varying = {kind for kind, source in SOURCES.items() if getattr(source, "frame_sizes_vary", False)}
    assert varying == {"images"}
    assert not sizes_vary(SyntheticSourceConfig()) and not sizes_vary(V4l2SourceConfig(device="/dev/video0"))


def test_every_camera_kind_has_settings_and_a_reader_and_nothing_else_does() -> None:
    assert list(KINDS) == list(SOURCES)
    assert all(config.model_fields["type"].annotation == Literal[kind] for kind, config in KINDS.items())


def test_an_image_that_is_a_link_to_nothing_is_skipped_and_counted(image_dir: Path) -> None:
    (image_dir / "b1.png").symlink_to(image_dir / "gone.png")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    while src.read(None) is not None:
        pass
    assert src.skipped == 2  # b1.png and the truncated b2.png


def test_an_image_that_is_a_link_to_a_pipe_or_a_device_is_skipped_not_waited_on_or_read_without_end(
    image_dir: Path,
) -> None:
    # A pipe's reader waits for a writer that never comes: the capture thread stopped for good.
    os.mkfifo(image_dir.parent / "pipe")
    (image_dir / "b1.png").symlink_to(image_dir.parent / "pipe")
    (image_dir / "b3.png").symlink_to("/dev/zero")  # read to the size limit on every pass
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    frames: list[int] = []

    def read_all() -> None:
        while (image := src.read(None)) is not None:
            frames.append(frame_number(image))

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # let the reader go before failing
        os.close(os.open(image_dir.parent / "pipe", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading an image folder waited on a pipe")
    assert frames == [0, 1, 2, 3, 4]
    assert src.skipped == 3  # the pipe, the device and the truncated b2.png
    with pytest.raises(ImageError, match="not a regular file"):
        read_image(image_dir / "b3.png")


def test_an_image_whose_name_is_not_utf8_is_read(image_dir: Path) -> None:
    # OpenCV's Python binding crashed the daemon (SIGSEGV) on a file name of other bytes.
    os.rename(image_dir / "03.jpg", os.fsencode(image_dir) + b"/03\xe9.jpg")
    src = opened(ImagesSource(ImagesSourceConfig(path=str(image_dir), loop=False)))
    assert frame_number(src.read(None)) == 0
    assert src.frame_name() == "03\ufffd.jpg" and src.skipped == 0  # messages are UTF-8 JSON


def _picture(channels: int, dtype: type[np.generic]) -> np.ndarray:
    """A 97x131 camera-like picture (odd sides, detail everywhere) of ``channels`` and ``dtype``."""
    rng = np.random.default_rng(channels)
    top = 65535 if dtype is np.uint16 else 255
    image = rng.integers(0, top, (97, 131, channels), dtype=dtype)
    return image[:, :, 0] if channels == 1 else image


J = cv2
REAL_ENCODINGS = [
    *(
        (".jpg", channels, np.uint8, params)
        for channels in (1, 3)
        for params in (
            (),
            (J.IMWRITE_JPEG_PROGRESSIVE, 1),
            (J.IMWRITE_JPEG_OPTIMIZE, 1),
            (J.IMWRITE_JPEG_RST_INTERVAL, 1),
            (J.IMWRITE_JPEG_RST_INTERVAL, 3, J.IMWRITE_JPEG_PROGRESSIVE, 1),
            (J.IMWRITE_JPEG_QUALITY, 5),
            (J.IMWRITE_JPEG_QUALITY, 100, J.IMWRITE_JPEG_SAMPLING_FACTOR, J.IMWRITE_JPEG_SAMPLING_FACTOR_444),
            (J.IMWRITE_JPEG_SAMPLING_FACTOR, J.IMWRITE_JPEG_SAMPLING_FACTOR_411),
            (J.IMWRITE_JPEG_LUMA_QUALITY, 10, J.IMWRITE_JPEG_CHROMA_QUALITY, 10),
        )
    ),
    *(
        (".png", 3, np.uint8, (J.IMWRITE_PNG_COMPRESSION, level, J.IMWRITE_PNG_STRATEGY, s))
        for level in (0, 9)
        for s in range(5)
    ),
    *((".png", channels, dtype, ()) for channels in (1, 3, 4) for dtype in (np.uint8, np.uint16)),
    *((".webp", channels, np.uint8, (J.IMWRITE_WEBP_QUALITY, q)) for channels in (1, 3, 4) for q in (1, 90, 101)),
    *(
        (".tiff", channels, dtype, (J.IMWRITE_TIFF_COMPRESSION, compression))
        for channels in (1, 3, 4)
        for dtype in (np.uint8, np.uint16)
        for compression in (1, 5, 8, 32773, 32946)
    ),
    *((".bmp", channels, np.uint8, ()) for channels in (1, 3, 4)),
]


@pytest.mark.unit
@pytest.mark.parametrize(("suffix", "channels", "dtype", "params"), REAL_ENCODINGS)
@pytest.mark.parametrize("flags", [cv2.IMREAD_COLOR, cv2.IMREAD_UNCHANGED, cv2.IMREAD_GRAYSCALE])
def test_every_real_encoding_decodes_as_opencv_reads_it(
    tmp_path: Path, suffix: str, channels: int, dtype: type[np.generic], params: tuple[int, ...], flags: int
) -> None:
    # A good image refused by the header checks would be a camera's frames lost: each cv2 option, each one decoded.
    ok, data = cv2.imencode(suffix, _picture(channels, dtype), list(params))
    assert ok
    path = tmp_path / f"picture{suffix}"
    path.write_bytes(data.tobytes())
    expected = cv2.imread(str(path), flags)
    assert expected is not None
    np.testing.assert_array_equal(read_image(path, flags), expected)


def test_a_phones_portrait_photo_has_the_size_it_is_decoded_at_not_the_one_it_is_stored_at(tmp_path: Path) -> None:
    # Stored 500x300 with its EXIF orientation 6 (turn a quarter) in a 40 KB segment with its thumbnail:
    # OpenCV decodes it 300x500, and `edged check` judged by 500x300 whether inspect.roi fits it.
    jpeg = cv2.imencode(".jpg", np.full((300, 500, 3), 90, np.uint8))[1].tobytes()
    (tmp_path / "portrait.jpg").write_bytes(jpeg[:2] + exif(6, "big", padding=40_000) + jpeg[2:])
    (tmp_path / "landscape.jpg").write_bytes(jpeg[:2] + exif(1, "big", padding=40_000) + jpeg[2:])
    for name in ("portrait.jpg", "landscape.jpg"):
        h, w = read_image(tmp_path / name).shape[:2]
        assert image_size(str(tmp_path / name)) == (w, h)
    assert image_size(str(tmp_path / "portrait.jpg")) == (300, 500)


def test_an_images_size_is_read_from_its_header_past_a_large_exif_block(tmp_path: Path) -> None:
    # A phone's JPEG puts tens of kilobytes (its EXIF thumbnail) before its size; a pipe holds nothing up.
    image = np.full((300, 500, 3), 90, np.uint8)
    jpeg = cv2.imencode(".jpg", image)[1].tobytes()
    (tmp_path / "phone.jpg").write_bytes(jpeg[:2] + b"\xff\xe1" + (50000).to_bytes(2, "big") + bytes(49998) + jpeg[2:])
    cv2.imwrite(str(tmp_path / "b.png"), image)
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "empty.png").touch()
    assert cv2.imread(str(tmp_path / "phone.jpg")).shape == (300, 500, 3)
    assert image_size(str(tmp_path / "phone.jpg")) == image_size(str(tmp_path / "b.png")) == (500, 300)
    assert image_size(str(tmp_path / "pipe.png")) is None and image_size(str(tmp_path / "empty.png")) is None
    # What read_image refuses before decoding has no size either: more pixels, or a longer side, than edged decodes.
    lying_jpeg(tmp_path / "bomb.jpg", 20000, 20000)
    black_png(tmp_path / "long.png", 65536, 2)
    assert image_size(str(tmp_path / "bomb.jpg")) is None and image_size(str(tmp_path / "long.png")) is None
