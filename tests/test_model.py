"""Loading a model: dynamic exports served at a known size, float16 inputs, and the refusals users meet."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from daemon import free_port, images_config, run_cli
from onnx import TensorProto, helper
from onnx_models import colour_probe, dynamic_probe, solid_frame

from edged.config import ModelConfig, RuntimeConfig
from edged.errors import ContractError, ModelError
from edged.model import load_model
from edged.pipeline import FramePipeline

ULTRALYTICS = {"author": "Ultralytics", "description": "Ultralytics YOLOv8n model trained on coco.yaml"}


@pytest.mark.parametrize(
    ("imgsz", "metadata", "input_hw"),
    [
        (64, {}, (64, 64)),
        ((64, 96), {}, (64, 96)),  # rectangular, [h, w] as ultralytics orders it
        ((96, 64), {"imgsz": "[64, 64]"}, (96, 64)),
        (None, {"imgsz": "[32, 64]", "stride": "32"}, (32, 64)),  # the size it was exported at
    ],
)
def test_a_dynamic_export_is_served_at_the_configured_or_exported_size(
    tmp_path: Path, imgsz: object, metadata: dict[str, str], input_hw: tuple[int, int]
) -> None:
    cfg = ModelConfig(path=dynamic_probe(tmp_path / "dyn.onnx", metadata=metadata), imgsz=imgsz)
    model = load_model(cfg, RuntimeConfig())
    assert (model.contract.height, model.contract.width) == input_hw
    plan = FramePipeline(model, 128, 96, "bgr")
    assert plan.preprocess.tensor.shape == (1, 3, *input_hw)
    detections, _ = plan.process(solid_frame((0, 0, 255)))
    assert detections.class_ids.tolist() == [0] and model.label(0) == "red"


def test_a_dynamic_export_with_no_size_to_serve_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"no imgsz metadata; set model\.imgsz") as info:
        load_model(ModelConfig(path=dynamic_probe(tmp_path / "dyn.onnx")), RuntimeConfig())
    assert info.value.exit_code == 78


def test_a_fixed_size_model_refuses_another_imgsz(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"model\.imgsz = \[320, 320\] but input 'images' is fixed at \[1, 3, 64, 64\]"):
        load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx"), imgsz=320), RuntimeConfig())


def test_a_labels_file_that_lists_no_class_or_is_no_file_is_refused(tmp_path: Path) -> None:
    # An empty file was taken for "no labels": the model's own names gave way to class ids.
    model = colour_probe(tmp_path / "m.onnx")
    (tmp_path / "empty.txt").write_text("\n  \n")
    os.mkfifo(tmp_path / "pipe")  # with no writer, reading it waited for ever
    for labels, says in ((tmp_path / "empty.txt", "lists no class"), (tmp_path / "pipe", "is not a regular file")):
        with pytest.raises(ModelError, match=says):
            load_model(ModelConfig(path=model, labels=labels), RuntimeConfig())


def test_a_labels_file_naming_a_class_with_a_control_character_is_refused_saying_where(tmp_path: Path) -> None:
    """An escape in a name rewrote the terminal `edged check` printed it on and made journalctl show each
    log line naming the class as blob data; a right-to-left override reordered the text after it."""
    model = colour_probe(tmp_path / "m.onnx")
    for name, says in (
        ("bl\x1b[2Jue", "U+001B at character 3 is a control character"),
        ("\u202eder", "U+202E at character 1 is a bidirectional control"),
    ):
        (tmp_path / "labels.txt").write_text(f"red\n{name}\n")
        with pytest.raises(ModelError) as info:
            load_model(ModelConfig(path=model, labels=tmp_path / "labels.txt"), RuntimeConfig())
        assert str(info.value) == (
            f"labels file {tmp_path / 'labels.txt'}: class 1's name {name!r} cannot be published or logged: {says}"
        )
        assert info.value.exit_code == 78
    (tmp_path / "labels.txt").write_text("red\nblue \u200d\U0001f527\n")  # a joiner, as emoji sequences hold
    assert (
        load_model(ModelConfig(path=model, labels=tmp_path / "labels.txt"), RuntimeConfig()).labels[1]
        == "blue \u200d\U0001f527"
    )


def test_names_metadata_with_a_control_character_gives_way_to_class_ids_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = colour_probe(tmp_path / "m.onnx", metadata={"names": "{0: 'red', 1: 'bl\\tue'}"})
    loaded = load_model(ModelConfig(path=model), RuntimeConfig())
    assert (loaded.labels, loaded.class_names) == ([], ("0", "1"))
    assert "the model's names metadata cannot name its classes" in caplog.text
    caplog.clear()
    assert load_model(ModelConfig(path=colour_probe(tmp_path / "ok.onnx")), RuntimeConfig()).labels
    assert "names metadata" not in caplog.text


def test_a_labels_file_saved_with_a_byte_order_mark_names_its_first_class_without_it(tmp_path: Path) -> None:
    """Windows' Notepad saves one: the first class was named "\\ufeffscratch", unseen in every output,
    and ``inspect.ng_classes = ["scratch"]`` was refused as a class the model does not have."""
    (tmp_path / "labels.txt").write_bytes("\ufeffscratch\r\ncrack\r\n".encode())
    cfg = ModelConfig(path=colour_probe(tmp_path / "m.onnx"), labels=tmp_path / "labels.txt")
    assert load_model(cfg, RuntimeConfig()).labels == ["scratch", "crack"]


@pytest.mark.parametrize(("labels", "says"), [("red\n", "lists 1 class but"), ("red\nblue\ngreen\n", "lists 3 classes but")])
def test_a_labels_file_that_does_not_match_the_model_is_refused_counting_in_words(
    tmp_path: Path, labels: str, says: str
) -> None:
    (tmp_path / "labels.txt").write_text(labels)
    cfg = ModelConfig(path=colour_probe(tmp_path / "m.onnx"), labels=tmp_path / "labels.txt")
    with pytest.raises(ContractError, match=f"labels.txt {says} the model outputs 2$"):
        load_model(cfg, RuntimeConfig())


@pytest.mark.parametrize(
    ("labels", "names", "says"),
    [
        (
            "crack\ncrack\n",
            None,
            r"labels.txt names more than one class alike: 'crack' \(class ids 0, 1\); give each class its own name",
        ),
        (
            None,
            {0: "red", 1: "red"},
            r"the model's names metadata names more than one class alike: 'red' \(class ids 0, 1\); "
            "set model.labels to a file naming each class once",
        ),
        # One code point, and an e with a combining accent: alike in every output (before: accepted).
        ("caf\u00e9\ncafe\u0301\n", None, r"names more than one class alike: 'caf\u00e9' \(class ids 0, 1\)"),
    ],
)
def test_labels_that_name_two_classes_alike_are_refused_naming_them(
    tmp_path: Path, labels: str | None, names: dict[int, str] | None, says: str
) -> None:
    # inspect.ng_classes = ['crack'] made only the last class of the name NG: a class-0 crack was OK.
    model = colour_probe(tmp_path / "m.onnx", metadata={"names": str(names)} if names else None)
    if labels is not None:
        (tmp_path / "labels.txt").write_text(labels)
    cfg = ModelConfig(path=model, labels=tmp_path / "labels.txt" if labels is not None else None)
    with pytest.raises(ContractError, match=says):
        load_model(cfg, RuntimeConfig())


def test_check_and_run_refuse_labels_that_name_two_classes_alike_with_exit_78(tmp_path: Path) -> None:
    made = tmp_path / "made"
    made.mkdir()
    (tmp_path / "m.labels").write_text("crack\ncrack\n")
    cv2.imwrite(str(made / "part.png"), solid_frame((0, 0, 255)))
    config = images_config(
        tmp_path,
        colour_probe(made / "m.onnx"),
        [made / "part.png"],
        f"tcp://127.0.0.1:{free_port()}",
        model={"labels": "m.labels"},
        inspect={"ng_classes": ["crack"]},
    )
    for command in ("check", "run"):
        result = run_cli(command, "--config", str(config))
        assert result.returncode == 78, result.stdout + result.stderr
        assert "names more than one class alike: 'crack' (class ids 0, 1)" in result.stderr


def test_a_float16_model_is_fed_what_ultralytics_feeds_it(tmp_path: Path) -> None:
    # ultralytics gives a float16 input im.half() / 255: float32 v / 255 rounded to float16.
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx", dtype=np.float16)), RuntimeConfig())
    plan = FramePipeline(model, 64, 64, "bgr")
    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)
    plan.process(frame)
    expected = (frame[..., ::-1].transpose(2, 0, 1)[None].astype(np.float32) / np.float32(255)).astype(np.float16)
    np.testing.assert_array_equal(plan.preprocess.tensor.view(np.uint16), expected.view(np.uint16))
    detections, _ = plan.process(solid_frame((255, 0, 0), 64, 64))
    assert detections.class_ids.tolist() == [1] and model.label(1) == "blue"


def test_an_ultralytics_export_refuses_bgr(tmp_path: Path) -> None:
    path = colour_probe(tmp_path / "m.onnx", metadata=ULTRALYTICS)
    assert load_model(ModelConfig(path=path), RuntimeConfig()).contract.channel_order == "rgb"
    with pytest.raises(ContractError) as info:
        load_model(ModelConfig(path=path, channel_order="bgr"), RuntimeConfig())
    assert "model.channel_order = 'bgr'" in str(info.value) and "author 'Ultralytics'" in str(info.value)


def _segmentation_export(path: Path, metadata: dict[str, str]) -> Path:
    """The colour probe with a second output of mask prototypes [1, 32, 16, 16], as a segment export has."""
    model = onnx.load(str(colour_probe(path, metadata=metadata)))
    shape = onnx.numpy_helper.from_array(np.array([1, 32, 16, 16], np.int64))
    model.graph.node.extend(
        [
            helper.make_node("Constant", [], ["proto_shape"], value=shape),
            helper.make_node("ConstantOfShape", ["proto_shape"], ["output1"]),
        ]
    )
    model.graph.output.append(helper.make_tensor_value_info("output1", TensorProto.FLOAT, [1, 32, 16, 16]))
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("metadata", "words"),
    [({"task": "segment"}, ["a segment head [1, 4+nc+32, N] needs >= 37"]), ({}, ["a segment head", "needs >= 37"])],
)
def test_prototypes_beside_a_detection_output_without_coefficients_are_refused_naming_the_layout(
    tmp_path: Path, metadata: dict[str, str], words: list[str]
) -> None:
    with pytest.raises(ContractError) as info:
        load_model(ModelConfig(path=_segmentation_export(tmp_path / "seg.onnx", metadata)), RuntimeConfig())
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("task", "name"), [("pose", "pose estimation"), ("obb", "oriented bounding boxes")])
def test_other_tasks_are_refused_by_name_without_a_useless_hint(tmp_path: Path, task: str, name: str) -> None:
    path = colour_probe(tmp_path / "m.onnx", metadata={"task": task})
    with pytest.raises(ContractError) as info:
        load_model(ModelConfig(path=path), RuntimeConfig())
    assert f"model task '{task}' ({name}) is not supported" in str(info.value)
    assert "model.head" not in str(info.value)


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_a_model_file_larger_than_onnx_allows_is_refused_unread(tmp_path: Path, engine: str) -> None:
    # Each engine reads the model's bytes once, to run what it hashed: a 3 GiB file (a sparse one
    # here; a wrong file on a board) would have been read whole into memory first.
    huge = tmp_path / "huge.onnx"
    with huge.open("wb") as f:
        f.truncate(3 << 30)
    if engine == "openvino":
        pytest.importorskip("openvino")
    with pytest.raises(ModelError, match=r"holds 3221225472 bytes, more than an ONNX file can"):
        load_model(ModelConfig(path=huge, engine=engine), RuntimeConfig())
