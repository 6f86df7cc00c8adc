"""Signed models: ``edged sign`` and openssl's own signatures verify; an unsigned, tampered, relabelled
or foreign-signed model is refused before it is loaded, at start (78) and on reload (the running model stays)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from daemon import RunningDaemon, edged_command, free_port, run_cli, write_config, write_video
from onnx import numpy_helper
from onnx_models import fixed_scene
from waiting import wait_for

import edged.model
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, KeyFileError, ModelError
from edged.model import load_model
from edged.signature import Signed, sign, signature_path, verify

SCENE = [(16.0, 20.0, 8.0, 8.0, 1, 0.9)]


def keypair(folder: Path, name: str = "signing") -> tuple[Path, Path]:
    """An ed25519 pair made by openssl, as a plant would make it: (private, public)."""
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(private)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)], check=True)
    return private, public


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A model signed with ``edged sign`` and its key pair: (model, private, public)."""
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    private, public = keypair(tmp_path)
    result = run_cli("sign", str(model), "--key", str(private))
    assert result.returncode == 0, result.stderr
    assert f"into {model}.sig" in result.stdout
    return model, private, public


def config(model: Path, public: Path, labels: Path | None = None) -> ModelConfig:
    return ModelConfig(path=model, labels=labels, require_signature=True, signature_key=public)


def test_a_model_signed_by_edged_sign_verifies_and_loads(signed: tuple[Path, Path, Path]) -> None:
    model, _, public = signed
    text = signature_path(model).read_text()
    assert text.splitlines()[:3] == Signed.of(model, None).text().splitlines()  # readable: what it vouches for
    loaded = load_model(config(model, public), RuntimeConfig())
    assert loaded.info.sha256 == verify(config(model, public)).model_sha256


def test_a_signature_made_by_openssl_over_the_same_lines_verifies(tmp_path: Path) -> None:
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    private, public = keypair(tmp_path)
    lines = tmp_path / "signed.txt"
    lines.write_text(Signed.of(model, None).text())
    raw = subprocess.run(
        ["openssl", "pkeyutl", "-sign", "-inkey", str(private), "-rawin", "-in", str(lines)],
        check=True,
        capture_output=True,
    ).stdout
    signature_path(model).write_text(f"{lines.read_text()}signature {base64.b64encode(raw).decode()}\n")
    assert verify(config(model, public)) == Signed.of(model, None)


def test_an_unsigned_model_is_refused_saying_how_to_sign_it(tmp_path: Path) -> None:
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    _, public = keypair(tmp_path)
    with pytest.raises(ModelError, match=r"is not signed \(no .*scene.onnx.sig\).*edged sign .*scene.onnx --key"):
        load_model(config(model, public), RuntimeConfig())


def test_a_model_changed_after_signing_is_refused_before_it_is_loaded(signed: tuple[Path, Path, Path]) -> None:
    model, _, public = signed
    model.write_bytes(model.read_bytes() + b"\0")  # one byte more: still a loadable file to the runtime
    with pytest.raises(ModelError, match=r"is not the file .* signs .* it changed after signing"):
        load_model(config(model, public), RuntimeConfig())


def test_a_signature_by_another_key_or_edited_is_refused(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, _, public = signed
    other_private, other_public = keypair(tmp_path, "other")
    with pytest.raises(ModelError, match=r"does not verify with .*other.pub"):
        verify(config(model, other_public))
    sig = signature_path(model)
    lines = sig.read_text().splitlines()
    forged = Signed.of(model, None).model_sha256.replace("0", "1").replace("a", "b")
    sig.write_text("\n".join([lines[0], f"model-sha256 {forged}", *lines[2:]]) + "\n")
    with pytest.raises(ModelError, match="does not verify"):
        verify(config(model, public))
    sig.write_text("signature of a kind\n")
    with pytest.raises(ModelError, match="not an edged signature file"):
        verify(config(model, public))
    with pytest.raises(KeyFileError, match=r"not an ed25519 public key|not a PEM public key"):
        verify(config(model, other_private))


def test_the_labels_are_signed_with_the_model(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, private, public = signed
    labels = tmp_path / "labels.txt"
    labels.write_text("dent\ncrack\n")
    with pytest.raises(ModelError, match=r"signed with the model's own names, and is configured with model.labels"):
        verify(config(model, public, labels))
    signature_path(model).write_text(sign(model, labels, private))
    assert verify(config(model, public, labels))
    labels.write_text("crack\ndent\n")  # the classes swapped: a verdict would name the wrong defect
    with pytest.raises(ModelError, match="signed with another labels file"):
        verify(config(model, public, labels))


def _with_external_data(model: Path, location: str) -> tuple[Path, Path]:
    """``model`` saved again with its constants as initializers kept in an external data file, as
    onnx.save(..., save_as_external_data=True) keeps a large model's: (model, data file)."""
    graph = onnx.load(str(model))
    for node in [n for n in graph.graph.node if n.op_type == "Constant"]:
        graph.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(node.attribute[0].t), node.output[0]))
        graph.graph.node.remove(node)
    external = model.with_name("external.onnx")
    onnx.save(graph, str(external), save_as_external_data=True, location=location, size_threshold=0)
    return external, external.with_name(location)


@pytest.mark.parametrize(
    "location", ["external.onnx.data", "weights-" + "w" * 150 + ".bin"]
)  # its entry's length: 1 and 2 bytes
def test_a_model_keeping_its_weights_in_an_external_file_is_neither_signed_nor_served(tmp_path: Path, location: str) -> None:
    """A signature covers the model file: weights in a file beside it could be swapped unseen."""
    model, data = _with_external_data(fixed_scene(tmp_path / "scene.onnx", SCENE), location)
    assert load_model(ModelConfig(path=model), RuntimeConfig()).num_classes == 3  # served unsigned, as before
    private, public = keypair(tmp_path)
    result = run_cli("sign", str(model), "--key", str(private))
    assert result.returncode == EXIT_CONFIG and "keeps weights in external data files" in result.stderr, result.stderr
    assert not signature_path(model).exists()
    lines = tmp_path / "signed.txt"  # signed all the same, as openssl would sign the model's sha256
    lines.write_text(
        f"edged-model-signature 1\nmodel-sha256 {hashlib.sha256(model.read_bytes()).hexdigest()}\nlabels-sha256 model\n"
    )
    raw = subprocess.run(
        ["openssl", "pkeyutl", "-sign", "-inkey", str(private), "-rawin", "-in", str(lines)], check=True, capture_output=True
    ).stdout
    signature_path(model).write_text(f"{lines.read_text()}signature {base64.b64encode(raw).decode()}\n")
    with pytest.raises(ModelError, match=r"external.onnx keeps weights in external data files.*save it as one file"):
        load_model(config(model, public), RuntimeConfig())
    assert data.is_file()


def test_labels_changed_while_the_model_loads_are_refused(
    signed: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names served are read once, and are the bytes whose sha256 the signature covers."""
    model, private, public = signed
    labels = tmp_path / "labels.txt"
    labels.write_text("dent\ncrack\nscratch\n")
    signature_path(model).write_text(sign(model, labels, private))
    opened = edged.model.open_engine

    def swapping(*args: Any, **kwargs: Any) -> Any:
        labels.write_text("crack\ndent\nscratch\n")  # swapped after the signature was checked
        return opened(*args, **kwargs)

    monkeypatch.setattr(edged.model, "open_engine", swapping)
    with pytest.raises(ModelError, match=r"labels file .*labels.txt changed while the model was loaded"):
        load_model(config(model, public, labels), RuntimeConfig())


def test_a_signed_model_is_never_run_from_the_optimised_model_cache(
    signed: tuple[Path, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache holds a graph edged wrote: swapped on the disk, it would run under the signed model's name."""
    model, _, public = signed
    cache = tmp_path / "scene.opt.onnx"
    runtime = RuntimeConfig(optimized_model_path=cache)
    unsigned = load_model(ModelConfig(path=model), runtime)  # writes the cache and its stamp
    stamp_path = cache.with_name(cache.name + ".json")
    stamp = json.loads(stamp_path.read_text())
    other = fixed_scene(tmp_path / "other.onnx", [(40.0, 40.0, 10.0, 10.0, 2, 0.8)])
    cache.write_bytes(other.read_bytes())  # the stamp still names the signed model; its digest is the swapped file's
    stamp_path.write_text(json.dumps({**stamp, "cache_sha256": hashlib.sha256(other.read_bytes()).hexdigest()}))
    frame = np.zeros(unsigned.contract.shape, np.float32)
    assert unsigned.engine.infer(frame)[0][0, 4:, 0].tolist() == pytest.approx([0.0, 0.9, 0.0])
    assert load_model(ModelConfig(path=model), runtime).engine.infer(frame)[0][0, 4:, 0].tolist() == pytest.approx(
        [0.0, 0.0, 0.8]
    )  # unsigned, the cache runs: what the signature keeps out
    with caplog.at_level(logging.WARNING):
        loaded = load_model(config(model, public), runtime)
    assert loaded.engine.infer(frame)[0][0, 4:, 0].tolist() == pytest.approx([0.0, 0.9, 0.0])
    assert "runtime.optimized_model_path" in caplog.text and "not used with model.require_signature" in caplog.text


@pytest.mark.integration
def test_the_daemon_refuses_an_unsigned_model_with_78_and_keeps_a_signed_one_over_a_reload_to_an_unsigned(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    model, _, public = signed
    write_video(tmp_path / "clip.avi", [(90, 90, 90)] * 10)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": model.name, "require_signature": True, "signature_key": public.name},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
    }
    unsigned = fixed_scene(tmp_path / "unsigned.onnx", [(30.0, 30.0, 8.0, 8.0, 0, 0.9)])
    unsigned_doc = {**doc, "model": {**doc["model"], "path": unsigned.name}}
    refused = run_cli("run", "--config", str(write_config(tmp_path / "refused.toml", unsigned_doc)))
    assert refused.returncode == 78 and "unsigned.onnx is not signed" in refused.stderr + refused.stdout
    checked = run_cli("check", "--config", str(write_config(tmp_path / "edged.toml", doc)), "--no-bind")
    assert checked.returncode == 0 and f"signature  verified with {public}" in checked.stdout, (
        checked.stdout + checked.stderr
    )
    d = RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint)
    try:
        first = d.collect("detections", 1)[0]
        assert first.model.sha256 == Signed.of(model, None).model_sha256  # type: ignore[union-attr]
        write_config(tmp_path / "edged.toml", unsigned_doc)
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reload refused" in d.log(), 20), d.log()
        assert "unsigned.onnx is not signed" in d.log()
        after = d.collect("detections", 3)
        assert {m.model.sha256 for m in after} == {first.model.sha256}  # type: ignore[union-attr]
    finally:
        d.stop()


@pytest.mark.parametrize("target", ["key", "model", "labels"])
def test_sign_refuses_to_write_its_signature_over_the_key_the_model_or_the_labels(tmp_path: Path, target: str) -> None:
    # --out over the key replaced the private key with the signature.
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\n")
    private, _ = keypair(tmp_path)
    paths = {"key": private, "model": model, "labels": labels}
    before = {path: path.read_bytes() for path in paths.values()}
    result = run_cli("sign", str(model), "--labels", str(labels), "--key", str(private), "--out", str(paths[target]))
    assert result.returncode == 2 and "writing it would destroy it" in result.stderr, result.stderr
    assert {path: path.read_bytes() for path in paths.values()} == before


def test_sign_says_what_it_cannot_read_or_write_without_a_traceback(tmp_path: Path) -> None:
    # A model it could not read, or a folder it could not write the signature into, was a traceback.
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    private, _ = keypair(tmp_path)
    private.chmod(0o600)
    (tmp_path / "sealed").mkdir()
    sealed_model = tmp_path / "sealed" / "m.onnx"
    sealed_model.write_bytes(model.read_bytes())
    (tmp_path / "sealed").chmod(0o555)
    unprivileged = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c"]  # root, as any user is
    model.chmod(0)
    result = subprocess.run(
        [*unprivileged, shlex.join(edged_command("sign", str(model), "--key", str(private)))], capture_output=True, text=True
    )
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert f"cannot read model {model}: Permission denied" in result.stderr
    model.chmod(0o644)
    out = tmp_path / "sealed" / "scene.onnx.sig"
    result = subprocess.run(
        [*unprivileged, shlex.join(edged_command("sign", str(model), "--key", str(private), "--out", str(out)))],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "cannot be written by this user" in result.stderr, result.stderr
    result = subprocess.run(  # the signature's default place, beside the model
        [*unprivileged, shlex.join(edged_command("sign", str(sealed_model), "--key", str(private)))],
        capture_output=True,
        text=True,
    )
    assert result.returncode == EXIT_FAILURE and f"cannot write {sealed_model}.sig: Permission denied" in result.stderr
    assert list((tmp_path / "sealed").iterdir()) == [sealed_model]


def test_sign_warns_of_a_private_key_others_may_read(tmp_path: Path) -> None:
    model = fixed_scene(tmp_path / "scene.onnx", SCENE)
    private, _ = keypair(tmp_path)
    private.chmod(0o644)
    result = run_cli("sign", str(model), "--key", str(private))
    assert result.returncode == 0 and f"others may read the private key {private}: chmod 600" in result.stderr
    private.chmod(0o600)
    assert "warning" not in run_cli("sign", str(model), "--key", str(private)).stderr


def test_a_signature_key_or_labels_that_is_a_pipe_or_huge_is_refused_without_reading_it(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    # Each was read with read_text or hashed whole: a pipe hung edged for ever (SIGTERM too), and a
    # 1 GB sparse signature took 2.2 GB of memory.
    model, _, public = signed
    os.mkfifo(tmp_path / "pipe")
    huge = tmp_path / "huge"
    with huge.open("wb") as f:
        f.truncate(1 << 30)
    for path in (tmp_path / "pipe", huge):
        with pytest.raises(ModelError, match=f"model signature {path} cannot be read"):
            verify(ModelConfig(path=model, require_signature=True, signature_key=public, signature=path))
        with pytest.raises(KeyFileError, match=f"public key {path} cannot be read"):
            verify(config(model, path))
        with pytest.raises(KeyFileError, match=f"private key {path} cannot be read"):
            sign(model, None, path)
        with pytest.raises(ModelError, match=f"cannot read the labels: {path}"):
            verify(config(model, public, labels=path))
    with pytest.raises(ModelError, match="holds 1073741824 bytes, more than"):  # refused by its size, unread
        verify(config(model, public, labels=huge))


def test_signed_labels_that_are_missing_or_a_folder_are_a_model_error(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    # A candidate's labels file mistyped, with signatures on: FileNotFoundError and IsADirectoryError
    # ended edged at start and after a reload, where a candidate that does not load is to be reported.
    model, _, public = signed
    for labels, says in ((tmp_path / "no-such.labels", "No such file or directory"), (tmp_path, "is not a regular file")):
        with pytest.raises(ModelError, match=says):
            verify(config(model, public, labels=labels))


def test_the_model_run_is_the_file_verified_though_it_is_replaced_as_the_runtime_reads_it(
    signed: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signature was checked on the file, and ONNX Runtime then opened the path again: a file
    # replaced in between ran unsigned under the signed model's sha256 (22 loads in 300, in a race).
    model, _, public = signed
    verified = model.read_bytes()
    other = fixed_scene(tmp_path / "other.onnx", [(8.0, 8.0, 4.0, 4.0, 0, 0.5)] * 20)  # another model, unsigned
    real = ort.InferenceSession

    def replaced_first(source: Any, *args: Any, **kwargs: Any) -> ort.InferenceSession:
        if other.exists():
            other.replace(model)  # as the runtime comes to read it
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", replaced_first)
    loaded = load_model(config(model, public), RuntimeConfig())
    assert model.read_bytes() != verified  # it was replaced
    expected = [o.shape for o in real(verified, providers=["CPUExecutionProvider"]).get_outputs()]
    assert [o.shape for o in loaded.engine.output_meta] == expected  # and what runs is what was verified
    assert loaded.info.sha256 == hashlib.sha256(verified).hexdigest()


def test_a_signed_model_grown_past_what_onnx_holds_is_refused_before_it_is_hashed(
    signed: tuple[Path, Path, Path],
) -> None:
    # Hashed whole first: 4 GB took 7.8 s of the loop's thread when a reload brought it as a candidate.
    model, _, public = signed
    with model.open("r+b") as f:
        f.truncate(3 << 30)
    with pytest.raises(ModelError, match=r"holds 3221225472 bytes, more than an ONNX file can"):
        verify(config(model, public))
