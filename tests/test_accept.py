"""What the process running out of descriptors, memory or threads is said as, and how often."""

from __future__ import annotations

import errno
import logging
import os
import resource

import pytest
import zmq

from edged.accept import LOG_INTERVAL_S, AcceptFailures, make_room, short_of, why


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (OSError(errno.EMFILE, "Too many open files"), "no file descriptor left, LimitNOFILE="),
        (zmq.ZMQError(errno.EMFILE), "no file descriptor left, LimitNOFILE="),
        (OSError(errno.ENFILE, "Too many open files in system"), "the system has no file descriptor left"),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), "short of memory"),
        (RuntimeError("can't start new thread"), "no more threads, TasksMax="),
    ],
)
def test_running_out_is_said_with_what_ran_out_and_where_to_look(error: BaseException, said: str) -> None:
    assert short_of(error)
    assert said in why(error)


@pytest.mark.parametrize(
    "error", [OSError(errno.ECONNRESET, "reset"), zmq.ZMQError(errno.EADDRINUSE), RuntimeError("other"), ValueError()]
)
def test_other_failures_are_not_taken_for_running_out(error: BaseException) -> None:
    assert not short_of(error)


def test_failures_are_counted_each_time_and_said_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    failures = AcceptFailures("the live view", clock=lambda: now[0])
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.INFO, logger="edged.accept"):
        for _ in range(50):
            failures.failed(emfile)
        failures.accepted()
        failures.failed(emfile)
        now[0] += LOG_INTERVAL_S
        failures.failed(emfile)
        failures.accepted()
    said = [r.getMessage() for r in caplog.records]
    assert failures.count == 52
    assert len(said) == 4, said
    assert said[0].startswith("the live view: cannot take a connection") and "(1 failed since start)" in said[0]
    assert said[1] == "the live view: taking connections again (50 failed since start)"
    assert "(52 failed since start)" in said[2]
    assert said[3] == "the live view: taking connections again (52 failed since start)"


def test_make_room_raises_emfile_without_room_and_leaves_no_descriptor() -> None:
    before = sorted(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = next(fd for fd in range(1 << 20) if not os.path.exists(f"/proc/self/fd/{fd}"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + 2, hard))
    try:
        make_room(2)
        with pytest.raises(OSError) as raised:
            make_room(3)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert raised.value.errno == errno.EMFILE
    assert sorted(os.listdir("/proc/self/fd")) == before
