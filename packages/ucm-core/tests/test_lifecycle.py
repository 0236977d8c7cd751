import threading
import time

import pytest
from ucm.core.lifecycle import DumpTracker
from ucm.core.store.task import OK, KeyResult, Status, Task


def pending_task(n=2):
    return Task(n)


def complete(task, status=Status.OK):
    for i in range(len(task)):
        task.set_result(i, KeyResult(status, "disk full" if status is not Status.OK else ""))


def test_finished_request_with_dumps_in_flight_is_held_until_done():
    t = DumpTracker()
    task = pending_task()
    t.submit("a", task)
    assert t.finish("a") is True  # keep its blocks
    assert t.pop_finished() == set()
    complete(task)
    assert t.pop_finished() == {"a"}
    assert len(t) == 0 and t.counts.ok == 2


def test_finished_request_without_pending_dumps_is_released_at_once():
    t = DumpTracker()
    t.submit("a", Task.completed([OK]))
    assert t.finish("a") is False
    assert t.finish("never-dumped") is False
    assert len(t) == 0


def test_failures_are_counted_and_released():
    t = DumpTracker()
    task = pending_task(3)
    t.submit("a", task)
    t.finish("a")
    complete(task, Status.ERROR)
    assert t.pop_finished() == {"a"}
    assert t.counts.failed == 3 and len(t) == 0


def test_reap_drops_completed_tasks_of_running_requests():
    t = DumpTracker()
    done, running = Task.completed([OK]), pending_task()
    t.submit("a", done)
    t.submit("a", running)
    t.reap()
    assert t.pending("a") == 1


def test_flush_waits_only_the_preempted_requests():
    t = DumpTracker()
    slow, other = pending_task(1), pending_task(1)
    t.submit("preempted", slow)
    t.submit("running", other)
    threading.Timer(0.05, complete, args=(slow,)).start()
    t.flush(["preempted"])
    assert slow.done() and not other.done()
    assert t.pending("preempted") == 0 and t.pending("running") == 1


def test_flush_timeout_cancels():
    t = DumpTracker()
    stuck = pending_task(1)
    t.submit("p", stuck)
    t.flush(["p"], timeout=0.01)
    assert stuck.cancelled


def test_pop_finished_can_block():
    t = DumpTracker()
    task = pending_task(1)
    t.submit("a", task)
    t.finish("a")
    threading.Timer(0.05, complete, args=(task,)).start()
    assert t.pop_finished(timeout=None) == {"a"}


def test_discard_forgets_and_cancels():
    t = DumpTracker()
    task = pending_task()
    t.submit("a", task)
    t.finish("a")
    t.discard("a")
    assert len(t) == 0 and task.cancelled


@pytest.mark.stress
def test_100k_requests_leave_no_state():
    t = DumpTracker()
    held = []
    for i in range(100_000):
        task = pending_task(1)
        t.submit(i, task)
        t.submit(i, Task.completed([OK]))
        if i % 3 == 0:
            complete(task)
            t.finish(i)
        elif i % 3 == 1:
            t.finish(i)  # held: dumps in flight
            held.append((i, task))
        else:
            complete(task, Status.ERROR)
            t.flush([i])  # preempted, then aborted
            t.discard(i)
        if i % 1000 == 999:
            for _, task in held:
                complete(task)
            held.clear()
            t.pop_finished()
        t.reap()
    for _, task in held:
        complete(task)
    t.pop_finished()
    assert len(t) == 0
    assert t._tasks == {} and t._finished == set()
    assert t.counts.ok + t.counts.failed == 200_000


def test_a_thread_that_waits_does_the_work_it_is_offered_until_none_is_left():
    task = Task(3)
    left = [0, 1, 2]
    ran_on = []

    def work() -> bool:
        if not left:
            return False
        index = left.pop(0)
        ran_on.append(threading.current_thread().name)
        task.set_result(index, OK)
        return True

    task.help_with(work)
    assert task.wait(1.0) == [OK] * 3
    assert ran_on == [threading.current_thread().name] * 3


def test_a_thread_that_waits_starts_no_work_once_its_time_is_out():
    task = Task(1)  # never finished by anybody
    calls = []

    def work() -> bool:
        calls.append(time.monotonic())
        time.sleep(0.1)
        return True  # more left, always

    task.help_with(work)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        task.wait(0.25)
    assert len(calls) == 3 and all(c - started < 0.25 for c in calls)
    assert time.monotonic() - started < 0.5


def test_keys_a_worker_leaves_undone_are_handed_back_and_the_others_recorded():
    task = Task(4)
    assert task.try_keys([0, 1, 2], lambda: [OK, None, OK]) == [1]
    assert task.partial() == [OK, None, OK, None]
    task.run_keys([1, 3], lambda: [OK, OK])
    assert task.wait(0) == [OK] * 4
    cancelled = Task(2)
    cancelled.cancel()
    assert cancelled.try_keys([0, 1], lambda: [None, None]) == []  # never run
    assert [r.status for r in cancelled.wait(0)] == [Status.CANCELLED] * 2


def test_a_cancel_tells_every_part_even_when_one_is_still_busy():
    first, second = Task(1), Task(1)
    whole = Task.combine(2, [([0], first), ([1], second)])
    inside, release = threading.Event(), threading.Event()

    def busy():
        inside.set()
        assert release.wait(10)
        return OK

    runner = threading.Thread(target=first.run_key, args=(0, busy))
    runner.start()
    assert inside.wait(10)
    assert whole.cancel(wait=0) is False  # the first part's key is in progress
    second.run_key(0, lambda: OK)  # not started before the cancel: never run
    release.set()
    runner.join(10)
    assert [r.status for r in whole.wait(1)] == [Status.OK, Status.CANCELLED]


def test_a_cancel_waits_for_a_part_an_earlier_part_starts_while_the_cancel_waits_for_it():
    whole, first, later = Task(1), Task(1), Task(1)
    whole.add_part(first)
    inside, cancelling, release = threading.Event(), threading.Event(), threading.Event()

    def held():
        inside.set()
        assert release.wait(10)
        return OK

    def start_later(done):  # as a tiered store reads below once the local tier missed
        threading.Thread(target=later.run_key, args=(0, held)).start()
        assert cancelling.wait(10)
        time.sleep(0.1)  # the cancel has begun, waiting for this callback (first's work)
        whole.add_part(later)

    first.add_done_callback(start_later)
    later.add_done_callback(lambda done: whole.set_result(0, done.wait(0)[0]))
    runner = threading.Thread(target=first.run_key, args=(0, lambda: OK))
    runner.start()
    assert inside.wait(10)
    cancelling.set()
    assert whole.cancel(wait=0.5) is False  # the later part's key is still in progress
    release.set()
    runner.join(10)
    assert whole.cancel(wait=10) is True and whole.done()


def test_a_thread_that_waits_does_the_work_a_part_offers():
    whole, part = Task(2), Task(2)
    whole.add_part(part)
    part.add_done_callback(lambda done: whole.set_results([0, 1], done.wait(0)))
    left = [0, 1]
    ran_on = []

    def work() -> bool:
        if not left:
            return False
        ran_on.append(threading.current_thread().name)
        part.set_result(left.pop(0), OK)
        return True

    part.help_with(work)
    assert whole.wait(1.0) == [OK] * 2
    assert ran_on == [threading.current_thread().name] * 2
