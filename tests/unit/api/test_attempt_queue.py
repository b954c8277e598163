"""The admission queue's policy: FIFO while the server keeps up, newest-first with old
waiters shed once the queue stands, and slots never leak (cancellation, hand-over races).

The clock that decides 'standing' is a test clock; the wait timers are the event loop's,
set long enough here that they never fire unless a test means them to."""

from __future__ import annotations

import asyncio

import pytest

from service.api.attempt_queue import AttemptQueue
from service.errors import Overloaded


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue(running: int = 1, target_s: float = 5.0, interval_s: float = 50.0) -> tuple[AttemptQueue, Clock, list[int]]:
    clock, shed = Clock(), []
    q = AttemptQueue(running, target_s, interval_s, on_shed=lambda: shed.append(1), clock=clock)
    return q, clock, shed


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_free_slots_admit_without_waiting() -> None:
    q, _, _ = queue(running=2)
    assert await q.enter(1.0) == 0.0
    assert await q.enter(1.0) == 0.0
    assert q.running == 2 and q.waiting == 0
    q.leave(0.0)
    q.leave(0.0)
    assert q.running == 0


async def test_waiters_run_first_in_first_out_while_the_server_keeps_up() -> None:
    q, clock, shed = queue()
    await q.enter(10.0)
    order: list[str] = []

    async def wait(name: str) -> None:
        await q.enter(10.0)
        order.append(name)

    tasks = [asyncio.create_task(wait(n)) for n in "abc"]
    await settle()
    assert q.waiting == 3 and not q.standing()
    for _ in range(3):
        clock.now += 1.0  # well inside the interval: a slot was free at 0
        q.leave(0.0)
        await settle()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"] and not shed
    assert q.running == 1 and q.waiting == 0


async def test_a_standing_queue_sheds_old_waiters_and_serves_the_newest() -> None:
    q, clock, shed = queue(target_s=5.0, interval_s=50.0)
    await q.enter(100.0)
    clock.now = 1.0
    old = [asyncio.create_task(q.enter(100.0)) for _ in range(2)]
    await settle()
    clock.now = 60.0  # no slot free for longer than the interval
    assert q.standing()
    new = asyncio.create_task(q.enter(100.0))
    await settle()
    clock.now = 61.0
    q.leave(0.0)
    await settle()
    assert new.done() and new.result() == pytest.approx(1.0)  # the newest got the slot, after 1 s
    for task in old:  # waited 60 s > the 5 s target: shed, not served
        with pytest.raises(Overloaded, match="waited"):
            await task
    assert len(shed) == 2 and q.running == 1 and q.waiting == 0


async def test_a_free_slot_ends_the_standing_state() -> None:
    q, clock, _ = queue(interval_s=50.0)
    await q.enter(100.0)
    clock.now = 60.0
    assert q.standing()
    q.leave(0.0)  # nobody waits: the slot stands free
    assert not q.standing() and q.running == 0


async def test_a_standing_queue_sheds_a_waiter_at_the_target_even_without_a_free_slot() -> None:
    shed: list[int] = []
    q = AttemptQueue(1, target_s=0.01, interval_s=0.05, on_shed=lambda: shed.append(1))
    await q.enter(10.0)
    await asyncio.sleep(0.1)  # the one slot has been taken for longer than the interval
    assert q.standing()
    with pytest.raises(Overloaded):  # its timer is the 10 ms target, not the 10 s deadline
        await asyncio.wait_for(q.enter(10.0), 5.0)
    assert shed == [1] and q.waiting == 0 and q.running == 1


async def test_arrivals_to_a_standing_queue_shed_the_stale_waiters() -> None:
    q, clock, shed = queue(target_s=5.0, interval_s=50.0)
    await q.enter(100.0)
    old = asyncio.create_task(q.enter(100.0))  # waits from 0, timer at its 100 s deadline
    await settle()
    clock.now = 60.0
    new = asyncio.create_task(q.enter(100.0))  # arrives to a standing queue
    await settle()
    with pytest.raises(Overloaded):
        await old
    assert not new.done() and q.waiting == 1 and shed == [1]
    q.leave(0.0)
    await settle()
    assert new.done() and q.running == 1


async def test_the_window_stretches_to_twice_the_time_an_attempt_holds_its_slot() -> None:
    q, clock, _ = queue(target_s=0.5, interval_s=1.0)
    for _ in range(50):  # attempts of ~10 s each (a slow rerank, in test seconds)
        await q.enter(100.0)
        q.leave(10.0)
    await q.enter(100.0)
    clock.now = 15.0  # busy for 15 s: longer than the interval, shorter than two attempts
    assert not q.standing()
    clock.now = 25.0
    assert q.standing()


async def test_the_callers_deadline_caps_the_wait() -> None:
    q, _, shed = queue(interval_s=1000.0)
    await q.enter(10.0)
    with pytest.raises(Overloaded):
        await asyncio.wait_for(q.enter(0.0), 5.0)  # no time left: shed at once, not after 1000 s
    assert shed == [1]


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    q, _, shed = queue()
    await q.enter(10.0)
    task = asyncio.create_task(q.enter(10.0))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.waiting == 0
    q.leave(0.0)
    assert q.running == 0 and not shed


async def test_a_slot_handed_to_a_caller_who_just_left_passes_on() -> None:
    q, _, _ = queue()
    await q.enter(10.0)
    gone = asyncio.create_task(q.enter(10.0))
    await settle()
    nxt = asyncio.create_task(q.enter(10.0))
    await settle()
    q.leave(0.0)  # hands the slot to `gone`...
    gone.cancel()  # ...who is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.wait_for(nxt, 5.0)  # the slot went on to the next waiter
    assert q.running == 1
    q.leave(0.0)
    assert q.running == 0 and q.waiting == 0


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="max_running_attempts"):
        AttemptQueue(0, 0.005, 0.1)
    with pytest.raises(ValueError, match="admission_target_ms"):
        AttemptQueue(1, 0.0, 0.1)
    with pytest.raises(ValueError, match="admission_target_ms"):
        AttemptQueue(1, 0.2, 0.1)
