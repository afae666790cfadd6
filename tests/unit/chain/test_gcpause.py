"""The collector pause around bulk passes: off while any pass runs on any thread, back to what
it was when the last one ends, and never turned on where the caller had it off."""

import gc
import threading

import pytest

from chain.gcpause import gc_paused, without_gc


def test_overlapping_passes_on_two_threads_keep_it_off_until_the_last_ends() -> None:
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pass still runs
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_caller_that_had_it_off_keeps_it_off_and_errors_still_restore_it() -> None:
    @without_gc
    def fails() -> None:
        assert not gc.isenabled()
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        fails()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
