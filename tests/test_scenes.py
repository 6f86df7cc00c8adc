"""edged.sources.scenes: reproducible frames whose boxes hold exactly the painted defects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from edged.sources.scenes import CACHE_BYTES, CLASS_NAMES, Scene, SceneGenerator, _keep

pytestmark = pytest.mark.tools

FRAMES = range(24)


@pytest.fixture(scope="module")
def gen() -> SceneGenerator:
    return SceneGenerator(1280, 720, seed=7)


def test_same_inputs_give_identical_frames(gen: SceneGenerator) -> None:
    a, b = gen.render(3), SceneGenerator(1280, 720, seed=7).render(3)
    assert a.image.tobytes() == b.image.tobytes()
    np.testing.assert_array_equal(a.boxes, b.boxes)
    np.testing.assert_array_equal(a.class_ids, b.class_ids)


def test_different_index_or_seed_differs(gen: SceneGenerator) -> None:
    assert not np.array_equal(gen.render(3).image, gen.render(4).image)
    assert not np.array_equal(gen.render(3).image, SceneGenerator(1280, 720, seed=8).render(3).image)


def _check_boxes(scene: Scene, width: int, height: int) -> None:
    assert scene.image.shape == (height, width, 3) and scene.image.dtype == np.uint8
    assert scene.boxes.dtype == np.float32 and scene.boxes.shape == (len(scene.class_ids), 4)
    assert scene.class_ids.dtype == np.int32
    assert np.all((scene.class_ids >= 0) & (scene.class_ids < len(CLASS_NAMES)))
    x1, y1, x2, y2 = scene.boxes.T
    assert np.all((x1 >= 0) & (y1 >= 0) & (x2 <= width) & (y2 <= height))
    assert np.all((x2 > x1) & (y2 > y1))


def test_boxes_lie_in_frame_and_have_area(gen: SceneGenerator) -> None:
    for i in FRAMES:
        _check_boxes(gen.render(i), 1280, 720)


def test_defects_stay_visible_after_downscaling(gen: SceneGenerator) -> None:
    for i in FRAMES:
        scene = gen.render(i)
        w, h = (scene.boxes[:, 2:] - scene.boxes[:, :2]).T
        for cls, bw, bh in zip(scene.class_ids, w, h, strict=True):
            if CLASS_NAMES[cls] == "spot":
                assert min(bw, bh) >= 14
            else:
                assert max(bw, bh) >= 24


def test_all_classes_and_empty_frames_occur(gen: SceneGenerator) -> None:
    scenes = [gen.render(i) for i in range(60)]
    seen = set(np.concatenate([s.class_ids for s in scenes]).tolist())
    assert seen == set(range(len(CLASS_NAMES)))
    assert any(len(s.class_ids) == 0 for s in scenes)


def test_painted_pixels_are_inside_tight_boxes(gen: SceneGenerator) -> None:
    margin = 3
    for i in FRAMES:
        scene = gen.render(i)
        diff = np.abs(scene.image.astype(np.int16) - gen._render_background(i)).sum(2)
        inside = np.zeros(diff.shape, bool)
        for x1, y1, x2, y2 in scene.boxes.astype(int):
            inside[max(0, y1 - margin) : y2 + margin, max(0, x1 - margin) : x2 + margin] = True
            box = diff[y1:y2, x1:x2] > 8
            rows, cols = np.flatnonzero(box.any(1)), np.flatnonzero(box.any(0))
            assert rows.size and cols.size, "every box holds a visible defect"
            assert rows[0] <= margin and rows[-1] >= box.shape[0] - 1 - margin
            assert cols[0] <= margin and cols[-1] >= box.shape[1] - 1 - margin
        assert diff[~inside].max(initial=0) == 0


def test_render_into_out_reuses_the_buffer(gen: SceneGenerator) -> None:
    out = np.zeros((720, 1280, 3), np.uint8)
    scene = gen.render(5, out=out)
    assert scene.image is out
    assert np.array_equal(out, gen.render(5).image)
    with pytest.raises(ValueError):
        gen.render(5, out=np.zeros((720, 1280, 4), np.uint8))


@pytest.mark.parametrize("size", [(640, 480), (320, 320), (333, 257)])
def test_arbitrary_frame_sizes(size: tuple[int, int]) -> None:
    width, height = size
    small = SceneGenerator(width, height, seed=1)
    for i in range(6):
        _check_boxes(small.render(i), width, height)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SceneGenerator(16, 720)
    with pytest.raises(ValueError):
        SceneGenerator(max_defects=-1)


def test_masks_hold_exactly_the_painted_pixels(gen: SceneGenerator) -> None:
    assert gen.render(3).masks is None
    for i in FRAMES:
        scene = gen.render(i, masks=True)
        assert np.array_equal(scene.image, gen.render(i).image), "masks do not change the frame"
        assert scene.masks is not None and scene.masks.dtype == bool
        assert scene.masks.shape == (len(scene.boxes), 720, 1280)
        diff = np.abs(scene.image.astype(np.int16) - gen._render_background(i)).sum(2)
        painted = np.zeros(diff.shape, bool)
        for mask, (x1, y1, x2, y2) in zip(scene.masks, scene.boxes.astype(int), strict=True):
            ys, xs = np.nonzero(mask)
            assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x1, y1, x2, y2), "box is the mask's extent"
            painted |= mask
        grown = cv2.dilate(painted.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)  # 3 px each way
        assert diff[~grown].max(initial=0) == 0, "nothing is painted outside the masks (blur aside)"
        if painted.any():
            assert np.median(diff[painted]) > 0, "masked pixels are really painted"


# ---- the texture cache ----------------------------------------------------------------------

RENDER = """
import sys
import numpy as np
from edged.sources.scenes import SceneGenerator
generator = SceneGenerator(320, 240, seed=int(sys.argv[1]))
np.save(sys.argv[2], np.stack([generator.render(i).image for i in range(6)]))
"""


def render_in_a_new_process(tmp_path: Path, seed: int, **cache: str) -> tuple[np.ndarray, str]:
    """Six frames rendered by a fresh process whose cache variables are ``cache``; its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("CACHE_DIRECTORY", "XDG_CACHE_HOME")} | cache
    out = tmp_path / f"frames-{len(list(tmp_path.glob('frames-*')))}.npy"
    proc = subprocess.run(
        [sys.executable, "-c", RENDER, str(seed), str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return np.load(out), proc.stderr


def test_the_textures_one_process_makes_are_read_by_the_next_and_give_the_same_frames(tmp_path: Path) -> None:
    nowhere = tmp_path / "a-file"
    nowhere.write_text("not a folder")
    made, _ = render_in_a_new_process(tmp_path, 4242, XDG_CACHE_HOME=str(nowhere))  # no cache: made every time
    folder = tmp_path / "user" / "edged" / "scenes"
    first, _ = render_in_a_new_process(tmp_path, 4242, XDG_CACHE_HOME=str(tmp_path / "user"))
    files = {p.name: p.stat().st_ino for p in folder.iterdir()}
    assert sorted(name.split("-")[0] for name in files) == ["noise", "textures"]
    for p in folder.iterdir():
        os.utime(p, ns=(0, 0))
    second, errors = render_in_a_new_process(tmp_path, 4242, XDG_CACHE_HOME=str(tmp_path / "user"))
    assert {p.name: p.stat().st_ino for p in folder.iterdir()} == files  # read, not made and written again
    assert all(p.stat().st_mtime_ns > 0 for p in folder.iterdir())  # and marked as used now
    assert made.tobytes() == first.tobytes() == second.tobytes()
    assert errors == ""


def test_a_damaged_cache_file_is_made_again_and_older_versions_files_are_dropped(tmp_path: Path) -> None:
    user = str(tmp_path / "user")
    expected, _ = render_in_a_new_process(tmp_path, 4243, XDG_CACHE_HOME=user)
    folder = tmp_path / "user" / "edged" / "scenes"
    textures = next(folder.glob("textures-*"))
    textures.write_bytes(b"\x93NUMPY garbage")
    stale = folder / "textures-4243-0123456789abcdef.npy"  # as a version before this one named it
    stale.write_bytes(b"old")
    frames, errors = render_in_a_new_process(tmp_path, 4243, XDG_CACHE_HOME=user)
    assert frames.tobytes() == expected.tobytes()
    assert f"scene cache {textures} could not be read" in errors and "making it again" in errors
    assert not stale.exists()
    assert np.load(textures).shape == (10, 1024, 1024, 3)


def test_a_service_keeps_its_textures_in_its_own_cache_directory(tmp_path: Path) -> None:
    render_in_a_new_process(
        tmp_path, 4244, CACHE_DIRECTORY=f"{tmp_path / 'service'}:{tmp_path / 'other'}", XDG_CACHE_HOME=str(tmp_path / "user")
    )
    assert len(list((tmp_path / "service" / "scenes").glob("textures-4244-*.npy"))) == 1
    assert not (tmp_path / "user").exists() and not (tmp_path / "other").exists()


def test_the_cache_keeps_the_most_recently_used_files_within_its_bound(tmp_path: Path) -> None:
    folder = tmp_path / "user" / "edged" / "scenes"
    folder.mkdir(parents=True)
    older = [folder / f"noise-{seed}-8000x8000-0123456789abcdef.npy" for seed in (97, 98, 99)]
    for age, path in enumerate(older):  # a third of the bound each (sparse), the first the least recently used
        with path.open("wb") as f:
            f.truncate(CACHE_BYTES // 3)
        os.utime(path, ns=(age, age))
    render_in_a_new_process(tmp_path, 4245, XDG_CACHE_HOME=str(tmp_path / "user"))
    assert [p.exists() for p in older] == [False, True, True]
    assert sorted(p.name.split("-")[0] for p in folder.glob("*-4245-*.npy")) == ["noise", "textures"]


def test_a_cache_file_is_on_the_disk_before_it_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renamed before its data reached the disk, a power cut could leave the name on a file of zeros of
    the right size, which the next start would read as black textures."""
    done: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (done.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (done.append(f"replace {a}"), replace(a, b))[1])
    path = tmp_path / "textures-1-0123456789abcdef.npy"
    _keep(path, np.ones((4, 4), np.uint8), "textures")
    assert len(done) >= 2 and done[0].startswith("fsync ") and done[1] == f"replace {done[0].removeprefix('fsync ')}"
    assert np.load(path).tolist() == np.ones((4, 4), np.uint8).tolist()
