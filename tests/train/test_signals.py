"""Stop signals: SIGHUP is a stop request like SIGTERM, never escalates, and stays ignored under nohup."""

from __future__ import annotations

import os
import signal

import pytest

from grpo_cli.train.supervise.signals import SignalFlag


@pytest.fixture
def sighup_default():
    """A terminal's SIGHUP disposition (not `nohup`), whatever an earlier test in this process left behind."""
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, old)


def test_sighup_twice_is_one_stop_request(sighup_default):
    with SignalFlag() as flag:
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)  # the shell forwards the hang-up the kernel already sent
        assert flag.signum == signal.SIGHUP
        assert flag.reason == "SIGHUP (the terminal or ssh session closed)"
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_second_sigterm_stops_at_once():
    with SignalFlag() as flag, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)


def test_nohup_keeps_sighup_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with SignalFlag() as flag:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert flag.signum is None
    finally:
        signal.signal(signal.SIGHUP, old)
