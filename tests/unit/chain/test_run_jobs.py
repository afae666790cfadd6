"""The codec's job runner: when a job fails, every job already running on the pool has ended
before the error reaches the caller (an engine that reloads after a failed patch must not race
a patch job still writing into its weights)."""

import threading
import time

import pytest

from chain.codec.api import map_jobs, run_jobs, usable_cpus

two_cpus = pytest.mark.skipif(usable_cpus() < 2, reason="needs two CPUs this thread may use")


@two_cpus
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


@two_cpus
def test_map_jobs_returns_each_result_in_the_items_order_whichever_thread_ran_it() -> None:
    seen: set[str] = set()

    def square(x: int) -> int:
        seen.add(threading.current_thread().name)
        time.sleep(0.01)
        return x * x

    items = list(range(40))
    assert map_jobs(square, items, lambda x: 1 << 20) == [x * x for x in items]
    assert len(seen) == 2  # both of the codec's threads took some


def test_a_thread_pinned_to_one_cpu_runs_every_job_itself() -> None:
    """vLLM's CPU worker on a 2-core host is pinned to one core: a second thread there only
    takes turns with the first."""
    import os

    seen: set[str] = set()
    got: list = []

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        got.append(map_jobs(lambda x: seen.add(threading.current_thread().name) or x, range(8),
                            lambda x: 1 << 20))

    t = threading.Thread(target=pinned, name="pinned")
    t.start()
    t.join(30)
    assert got == [list(range(8))]
    assert seen == {"pinned"}


@two_cpus
def test_jobs_started_while_the_worker_is_busy_are_joined_without_waiting_for_it() -> None:
    """`start_jobs` begins work on the codec's worker and returns; a second batch started
    meanwhile, its share for the busy worker not begun, is run by the caller's join alone
    instead of waiting behind the first batch (the writer codes one batch while it readies
    the next), and each join returns every job's effect."""
    from chain.codec.api import start_jobs

    release, first_done, ran = threading.Event(), threading.Event(), []

    def slow() -> None:
        if threading.current_thread().name.startswith("codec"):
            assert release.wait(10)
        ran.append("slow")
        first_done.set()

    joined_first = start_jobs([(1 << 20, slow), (1 << 20, lambda: ran.append("quick"))])
    time.sleep(0.05)  # the worker takes `slow`... or the quick job and then `slow`
    second = start_jobs([(1 << 20, lambda i=i: ran.append(i)) for i in range(4)])
    began = time.monotonic()
    second()  # returns while the worker still waits in `slow` (up to 10 s)
    assert time.monotonic() - began < 5
    assert sorted(x for x in ran if isinstance(x, int)) == [0, 1, 2, 3]
    assert not release.is_set()
    release.set()
    joined_first()
    assert first_done.is_set() and ran.count("slow") == 1 and ran.count("quick") == 1
