"""A polygon point's bytes in a detections message, against which ``edged check`` warns of outlines too
long to send."""

from __future__ import annotations

import numpy as np
import pytest

from edged.check import POINT_BYTES
from edged.segment import Instances


def _outline_bytes(points: np.ndarray) -> int:
    """The bytes of a detection with the outline ``points`` in a detections message, as edged builds it."""
    instance = Instances(
        np.array([[0, 0, 1, 1]], np.float32),
        np.array([0.5], np.float32),
        np.array([0], np.int32),
        polygons=(points,),
        area_px=(1,),
        sides=((1.0, 1.0),),
    )
    return len(instance.message_fields(str, None, None)["detections"][0].model_dump_json().encode())


@pytest.mark.parametrize(("width", "height"), [(10000, 3317), (3317, 10000), (7680, 4320), (1280, 720)])
def test_a_polygon_point_takes_at_most_point_bytes_of_a_detections_message(width: int, height: int) -> None:
    # The widest: a side of 10000 pixels or more, which an image may have, and a 4-digit other side.
    none = _outline_bytes(np.empty((0, 2), np.float32))
    for x, y in ((width, height), (width - 0.55, height - 0.55), (0.05, 0.05)):
        points = np.tile(np.array([[x, y]], np.float32), (1000, 1))
        assert (_outline_bytes(points) - none) / 1000 <= POINT_BYTES, (x, y)
