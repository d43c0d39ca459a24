"""`StopSignals`: the first SIGINT or SIGTERM stops a command, the next few are ignored."""

import os
import signal

import pytest

from megatron_lorafusion.lifetime import StopSignals, Terminated


@pytest.fixture
def stop():
    """A `StopSignals` installed here, the test process's own handlers put back after."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    handler = StopSignals()
    handler.install()
    handler.before = before  # what the test process had
    try:
        yield handler
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


def _signal(signum: int) -> None:
    os.kill(os.getpid(), signum)  # handled before the next line runs


def test_stop_signals_first_raises_then_ignores_within_the_grace_then_raises_again(stop):
    assert StopSignals.current() is stop
    with pytest.raises(KeyboardInterrupt) as first:
        _signal(signal.SIGINT)
    assert not isinstance(first.value, Terminated)
    _signal(signal.SIGINT)  # the stop is under way: ignored
    _signal(signal.SIGTERM)
    stop.since -= StopSignals.GRACE_S  # the grace is over: the user insists
    with pytest.raises(Terminated):
        _signal(signal.SIGTERM)
    stop.done = True  # the line is printed: nothing raises any more
    stop.since -= StopSignals.GRACE_S
    _signal(signal.SIGINT)


def test_stop_signals_uninstall_ignores_both_for_good_once_one_came(stop):
    with pytest.raises(KeyboardInterrupt):
        _signal(signal.SIGINT)
    stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_stop_signals_uninstall_gives_back_the_handlers_when_none_came(stop):
    stop.uninstall()
    assert {s: signal.getsignal(s) for s in stop.before} == stop.before
    assert StopSignals.current() is None
