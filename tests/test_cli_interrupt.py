"""Ctrl-C is "interrupted" and exit 130 even when library code turns the KeyboardInterrupt into another exception.

CI once saw `eaglescope train` under SIGINT exit 3 with `internal error: ValueError: could not determine the shape of
object type 'torch.storage.UntypedStorage'`: the interrupt landed inside torch, which re-raised it as a ValueError.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import eaglescope.cli as cli

_ANY_ARGV = ["inspect", "some-draft"]  # parsed for real; the command behind it is replaced


def _command_that(body):
    return lambda func: lambda args: body()


def _interrupted_inside_a_library():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises here, long before the sleep ends
    except KeyboardInterrupt:
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
    return 0


def _fails_without_an_interrupt():
    raise ValueError("a plain bug")


def test_an_interrupt_turned_into_another_exception_is_still_an_interrupt(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_command", _command_that(_interrupted_inside_a_library))
    rc = cli.main(_ANY_ARGV)
    err = capsys.readouterr().err
    assert rc == 130, err
    assert err.strip() == "eaglescope: interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handler outlived the command"


def test_a_bug_without_an_interrupt_is_still_an_internal_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_command", _command_that(_fails_without_an_interrupt))
    rc = cli.main(_ANY_ARGV)
    err = capsys.readouterr().err
    assert rc == 3
    assert err.startswith("eaglescope: internal error: ValueError: a plain bug")


def test_a_parent_that_ignores_sigint_keeps_it_ignored(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_command", _command_that(lambda: 0))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert cli.main(_ANY_ARGV) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _default_handler():
    # A pytest-xdist worker can inherit SIGINT ignored (a fresh clone's run did), and then the CLI rightly leaves it
    # ignored; these tests are about a terminal's default, so they set it and put back what was there.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
