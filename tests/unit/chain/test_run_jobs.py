"""The codec's job runner: when a job fails, every job already running on the pool has ended
before the error reaches the caller (an engine that reloads after a failed patch must not race
a patch job still writing into its weights)."""

import threading
import time

import pytest

from chain.codec.api import run_jobs


def test_an_error_reaches_the_caller_only_after_the_pool_threads_job_ended() -> None:
    caller = threading.current_thread()
    on_pool, done = threading.Event(), threading.Event()

    def job() -> None:  # whichever thread takes it: the caller's fails, the pool's is slow
        if threading.current_thread() is caller:
            assert on_pool.wait(10)
            raise ValueError("bad patch")
        on_pool.set()
        time.sleep(0.3)
        done.set()

    with pytest.raises(ValueError, match="bad patch"):
        run_jobs([(1 << 20, job), (1 << 20, job)], threads=2)
    assert done.is_set()
