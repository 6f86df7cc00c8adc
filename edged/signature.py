"""Signed models: a detached ed25519 signature over a model file's sha256 and its labels.

``edged sign`` makes it, with a private key kept off the board; with ``model.require_signature``
edged checks it before the model file is handed to the runtime, at start and on every reload, so
a model that was swapped, retrained elsewhere or given another labels file never goes live. The
signature file (``<model>.sig`` beside the model unless ``model.signature`` names another) is
text a person can read; its first three lines are what is signed::

    edged-model-signature 1
    model-sha256 <hex>
    labels-sha256 <hex of model.labels, or "model" when the names are the model's own metadata>
    signature <base64 of the 64-byte ed25519 signature>

Keys are PEM files as ``openssl genpkey -algorithm ed25519`` writes them (the public half:
``openssl pkey -pubout``), so a plant can sign with its own tooling too. The `cryptography`
package (extra ``signing``; Debian's python3-cryptography) is imported only here, only when a
signature is made or checked.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.engines import holds_external_data, read_model
from edged.errors import KeyFileError, MissingDependency, ModelError
from edged.files import labels_bytes, read_regular

if TYPE_CHECKING:
    from edged.config import ModelConfig

HEADER = "edged-model-signature 1"
FROM_MODEL = "model"  # the labels-sha256 of a model whose names are in its own metadata
INSTALL = "pip install 'edged[signing]', or apt install python3-cryptography"
# A signature or a PEM key is a few hundred bytes: read no more than this of one, and never a pipe.
MAX_TEXT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Signed:
    """What a signature vouches for: a model file's sha256 and its labels'."""

    model_sha256: str
    labels_sha256: str  # `FROM_MODEL` when the names come from the model's metadata

    @classmethod
    def of(cls, model: Path, labels: Path | None) -> Signed:
        """The model and labels files as they are now; `ModelError` where one cannot be read (the
        labels also where they are no regular file, or larger than any labels file), or where the
        model keeps weights in external data files, which its sha256 does not cover."""
        labels_sha256 = FROM_MODEL
        if labels is not None:
            labels_sha256 = hashlib.sha256(labels_bytes(labels)).hexdigest()
        data, identity = read_model(model)
        if holds_external_data(data):
            raise ModelError(
                f"model {model} keeps weights in external data files, which a signature does not cover: "
                "save it as one file (onnx.save without save_as_external_data; any model under 2 GB fits) and sign that"
            )
        return cls(identity.sha256, labels_sha256)

    def text(self) -> str:
        """The signed lines."""
        return f"{HEADER}\nmodel-sha256 {self.model_sha256}\nlabels-sha256 {self.labels_sha256}\n"


def signature_path(model: Path, signature: Path | None = None) -> Path:
    """Where a model's signature is: ``signature`` when given, else ``<model>.sig`` beside it."""
    return signature if signature is not None else model.with_name(model.name + ".sig")


def sign(model: Path, labels: Path | None, private_key: Path) -> str:
    """The signature file's text for ``model`` (and ``labels``) with the PEM ``private_key``."""
    serialization, ed25519, _ = _crypto()
    key = _read_key(private_key, lambda data: serialization.load_pem_private_key(data, password=None), "private")
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise KeyFileError(f"{private_key} is not an ed25519 private key (openssl genpkey -algorithm ed25519)")
    signed = Signed.of(model, labels).text()
    return f"{signed}signature {base64.b64encode(key.sign(signed.encode())).decode()}\n"


def verify(cfg: ModelConfig) -> Signed:
    """Check ``cfg.path``'s signature against ``cfg.signature_key``; returns what it vouches for, which
    the bytes then loaded must still be (`edged.model.load_model`).

    Raises `ModelError` naming what does not match (exit 78: at start the daemon does not start,
    on a reload the running model stays), `KeyFileError` for an unusable key, and
    `MissingDependency` without the `cryptography` package.
    """
    assert cfg.signature_key is not None  # the settings require it with require_signature
    serialization, ed25519, invalid = _crypto()
    key = _read_key(cfg.signature_key, serialization.load_pem_public_key, "public")
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise KeyFileError(f"model.signature_key {cfg.signature_key} is not an ed25519 public key")
    path = signature_path(cfg.path, cfg.signature)
    sign_it = f"sign it with: edged sign {cfg.path}{f' --labels {cfg.labels}' if cfg.labels else ''} --key PRIVATE.pem"
    try:
        lines = read_regular(path, MAX_TEXT_BYTES).decode().splitlines()
    except FileNotFoundError:
        raise ModelError(f"model {cfg.path} is not signed (no {path}); model.require_signature is on: {sign_it}") from None
    except (OSError, ValueError) as e:  # a pipe, a device, a file far larger than a signature, not UTF-8
        raise ModelError(f"model signature {path} cannot be read: {e}") from None
    fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
    if not lines or lines[0] != HEADER or set(fields) != {"model-sha256", "labels-sha256", "signature"}:
        raise ModelError(f"model signature {path} is not an edged signature file (made by edged sign)")
    claimed = Signed(fields["model-sha256"], fields["labels-sha256"])
    try:
        key.verify(base64.b64decode(fields["signature"], validate=True), claimed.text().encode())
    except (invalid, binascii.Error, ValueError):
        raise ModelError(f"model signature {path} does not verify with {cfg.signature_key}: not made by its key") from None
    actual = Signed.of(cfg.path, cfg.labels)
    if actual.model_sha256 != claimed.model_sha256:
        raise ModelError(
            f"model {cfg.path} is not the file {path} signs (sha256 {actual.model_sha256[:12]}, signed "
            f"{claimed.model_sha256[:12]}): it changed after signing; {sign_it}"
        )
    if actual.labels_sha256 != claimed.labels_sha256:
        signed_labels = "the model's own names" if claimed.labels_sha256 == FROM_MODEL else "another labels file"
        now = f"model.labels {cfg.labels}" if cfg.labels else "the model's own names"
        raise ModelError(f"model {cfg.path} was signed with {signed_labels}, and is configured with {now}; {sign_it}")
    return actual


def _read_key(path: Path, load: Any, kind: str) -> Any:
    try:
        data = read_regular(path, MAX_TEXT_BYTES)
    except OSError as e:
        raise KeyFileError(f"{kind} key {path} cannot be read: {e.strerror or e}") from None
    except ValueError as e:  # a pipe, a device, a file far larger than a key
        raise KeyFileError(f"{kind} key {path} cannot be read: {e}") from None
    try:
        return load(data)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"{path} is not a PEM {kind} key: {e}") from None


def _crypto() -> tuple[Any, Any, type[Exception]]:
    """The parts of `cryptography` that signing uses, or `MissingDependency` saying how to install it."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise MissingDependency(f"signed models need the cryptography package ({e}): {INSTALL}") from None
    return serialization, ed25519, InvalidSignature
