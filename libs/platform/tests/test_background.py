"""The one background-task helper: held, named, failures logged once, closed whole."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from turnstile_platform.background import BackgroundTasks, run_to_end


async def test_a_spawned_task_is_held_until_it_ends_even_with_no_other_reference() -> None:
    tasks = BackgroundTasks("test")
    release = asyncio.Event()
    done = asyncio.Event()

    async def work() -> None:
        await release.wait()
        done.set()

    tasks.spawn(work(), name="held")
    gc.collect()  # the loop keeps only weak references: ours must keep it alive
    assert len(tasks) == 1
    release.set()
    await done.wait()
    await tasks.wait()
    assert len(tasks) == 0


async def test_a_failure_is_logged_once_with_its_task_and_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = BackgroundTasks("the owner")

    async def boom() -> None:
        raise RuntimeError("broken")

    with caplog.at_level(logging.ERROR, logger="turnstile_platform.background"):
        tasks.spawn(boom(), name="boom")
        await tasks.wait()
    failures = [r for r in caplog.records if r.getMessage() == "background task failed"]
    assert len(failures) == 1
    assert failures[0].__dict__["task"] == "boom"
    assert failures[0].__dict__["owner"] == "the owner"
    assert failures[0].exc_info is not None


async def test_close_cancels_what_runs_and_waits_for_it_to_end() -> None:
    tasks = BackgroundTasks("test")
    started = asyncio.Event()
    cleaned = asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    task = tasks.spawn(forever(), name="forever")
    await started.wait()
    await tasks.close()
    assert task.cancelled()
    assert cleaned.is_set()
    assert len(tasks) == 0


async def test_shielded_work_finishes_when_its_caller_is_cancelled() -> None:
    tasks = BackgroundTasks("test")
    started = asyncio.Event()
    release = asyncio.Event()
    finished = asyncio.Event()

    async def cleanup() -> None:
        started.set()
        await release.wait()
        finished.set()

    caller = asyncio.create_task(tasks.shielded(cleanup()))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not finished.is_set()
    release.set()
    await tasks.wait()
    assert finished.is_set()


async def test_supervise_restarts_failing_work_until_it_returns() -> None:
    tasks = BackgroundTasks("test")
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"run {runs}")

    task = tasks.supervise(flaky, name="flaky", backoff_s=0.001, max_backoff_s=0.002)
    await task
    assert runs == 3


async def test_run_to_end_finishes_the_work_then_lets_the_cancellation_through() -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    finished = asyncio.Event()

    async def commit() -> None:
        started.set()
        await release.wait()
        finished.set()

    caller = asyncio.create_task(run_to_end(commit()))
    await started.wait()
    caller.cancel()
    await asyncio.sleep(0)
    assert not caller.done()  # it waits for the work, not only for the cancel
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished.is_set()


async def test_supervise_forever_restarts_work_that_returns_and_counts_each_restart() -> None:
    tasks = BackgroundTasks("test")
    runs = 0
    restarts = 0
    third = asyncio.Event()

    async def returns() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            third.set()
            await asyncio.Event().wait()

    def counted() -> None:
        nonlocal restarts
        restarts += 1

    task = tasks.supervise(
        returns,
        name="returns",
        backoff_s=0.001,
        max_backoff_s=0.002,
        forever=True,
        on_restart=counted,
    )
    await third.wait()
    await tasks.stop(task)
    assert (runs, restarts) == (3, 2)
    assert task.cancelled()


async def test_an_adopted_task_is_held_and_its_failure_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = BackgroundTasks("test")
    release = asyncio.Event()

    async def fails_later() -> None:
        await release.wait()
        raise RuntimeError("nobody's to see")

    task = asyncio.get_running_loop().create_task(fails_later())
    tasks.adopt(task)
    assert len(tasks) == 1
    with caplog.at_level(logging.DEBUG):
        release.set()
        await tasks.wait()
    assert len(tasks) == 0
    assert not [r for r in caplog.records if r.name == "turnstile_platform.background"]
