"""A run of many blocks moved in steps by a :class:`~ucm.kernels.mover.Mover`, the caches
held by the caller for the whole call (FastDeploy's ``write`` and ``read``), the stored
prefix kept whole.

Each step is a batch of about ``step_bytes`` on the batch's route:

* **in place**: the store writes and reads the caches' memory; nothing to copy, no rows to
  bound, so a run goes in a few large steps;
* **the store's memory**: a write step's gather into the room the store reserved runs
  while the previous step is committed, and the gather of the first step of the caller's
  next run (:class:`Ahead`) while the last one is: the copies run back to back across a
  sliced write's slices; a read step's lent blocks are copied out while the next step's
  checks are waited for;
* **rows**: up to ``depth`` steps in flight; a write gathers the next step while the store
  writes the previous ones, and may gather the first steps of the caller's next run early
  (:class:`Ahead`); a read scatters each verified step while the next ones load.

Both keep the stored prefix whole:

* a write reports how many leading blocks are stored.  Past a failed block or the deadline
  it cancels the rest (a block being written when cancelled is not published), waits the
  grace for the store to let go of the buffers, and removes any block that landed past the
  first gap, so a later lookup finds exactly the reported prefix;
* a read uses only the leading blocks that loaded and verified, and stops at the first one
  that did not.  Before it returns, the store has stopped writing the caches: loads not
  started are cancelled and loads in progress are waited for (the grace).

Rows go back to the pool only once the store is done with them (a timed-out task may still
be using them after the call returns).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from ucm.core import SlotReads, Status, Task, first_problem, verified_prefix

from ucm.kernels.mover.mover import BAD_DIGEST, Batch, CopyOut, Mover, RoomWrite, wait_until
from ucm.kernels.mover.route import Route
from ucm.kernels.mover.rows import RowPool, deferred_payloads, row_buffers
from ucm.kernels.segments import BlockSegments

log = logging.getLogger(__name__)

#: In place, a run goes in this many steps at most.  A step costs a store task and a
#: wake-up of the caller (1 GiB read in place in steps of 8 blocks: 9.2-10 GB/s, against
#: 10.5-11.5 in 8 steps), and buys only an earlier stop after a failed block.
IN_PLACE_STEPS = 8


@attrs.define
class _Step:
    offset: int  # first block of the step, counted from the run's first block
    count: int
    task: Task
    rows: list[torch.Tensor] | None  # our rows; None in place or lent
    lent: SlotReads | None = None  # a read's blocks the store lends where they lie


@attrs.define
class _LentCopy:
    """A read step's checked blocks being copied out of the store's memory, its copy
    possibly still running: the blocks are given back once it is done, while the next
    step's checks are waited for."""

    offset: int
    count: int  # blocks of the step
    good: int  # leading blocks lent (and checked by the store)
    lent: SlotReads
    copy: CopyOut | None  # None: the copy refused the store's memory
    why: str = ""  # why not every block of the step is copied

    def finish(self) -> tuple[int, str]:
        """Wait for the copy and give every block back.  How many leading blocks were
        copied (and passed their check on the way) while still lent (the cache blocks past
        them may hold anything), and where and why the step stopped short ("" where it did
        not)."""
        copied = 0
        try:
            if self.copy is not None:
                ok = self.copy.settle()
                copied = next((i for i, good in enumerate(ok) if not good), len(ok))
                if copied < self.good:
                    self.why = BAD_DIGEST.detail
        finally:  # every loan ends, whatever happened
            held = self.lent.release()
        kept = next((i for i in range(copied) if not held[i]), copied)
        why = "the store took it back before it was copied" if kept < copied else self.why
        return kept, "" if kept == self.count else f"block {self.offset + kept}: {why}"


@attrs.define
class Ahead:
    """Steps of the caller's next run, gathered while the writes of this one finish: into
    rows, or into room the store reserved in its memory.

    A run ends by waiting for its last writes; gathering the next run's first steps
    meanwhile keeps the copy and the store busy at once across runs (on a GPU, the link
    would otherwise idle while the host commits one run's last step and starts the next
    run's first: a few hundred microseconds a run, a third of a 100-block slice of 512 KiB
    blocks).  The gather only reads the caches, so a next run that never comes costs
    nothing but the copy: :meth:`release` returns its rows and gives its room back
    unwritten."""

    pool: RowPool
    ready: dict[tuple[Any, ...], list[torch.Tensor]] = attrs.Factory(dict)
    rooms: dict[tuple[Any, ...], RoomWrite] = attrs.Factory(dict)

    def take(self, block_ids: Sequence[Any]) -> list[torch.Tensor] | None:
        return self.ready.pop(_ids_key(block_ids), None)

    def take_room(self, part: Batch) -> RoomWrite | None:
        """The room gathered for exactly ``part``'s blocks and keys, if any."""
        if not self.rooms:  # (every step asks: no key made where none is kept)
            return None
        return self.rooms.pop(_part_key(part), None)

    def release(self) -> None:
        for rows in self.ready.values():
            self.pool.give(rows)
        self.ready.clear()
        rooms, self.rooms = list(self.rooms.values()), {}
        for room in rooms:
            room.abort()


def _ids_key(block_ids: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(tuple(b) if isinstance(b, (list, tuple)) else b for b in block_ids)


def _part_key(part: Batch) -> tuple[Any, ...]:
    return (_ids_key(part.block_ids), tuple(part.keys), id(part.store), part.tag, part.nbytes)


@attrs.define
class _Run:
    """What every step of one run shares."""

    mover: Mover
    batch: Batch  # the whole run
    deadline: float
    label: str

    @property
    def step(self) -> int:
        return max(1, self.mover.settings.step_bytes // self.batch.nbytes)

    def stop(self, steps: Sequence[_Step]) -> bool:
        """Cancel ``steps`` and wait up to the grace until the store has let go of their
        buffers (the caches, in place); whether it has."""
        end = time.monotonic() + self.mover.settings.grace_s
        quiet = True
        for s in steps:
            quiet = s.task.cancel(wait=max(0.0, end - time.monotonic())) and quiet
        return quiet


# -- writes ----------------------------------------------------------------------------------


def write_run(
    mover: Mover,
    batch: Batch,
    deadline: float,
    label: str,
    ahead: Ahead | None = None,
    next_ids: Sequence[Any] = (),
    next_keys: Sequence[bytes] = (),
) -> int:
    """Store the run's blocks; how many leading blocks are stored.

    With ``ahead``, steps gathered by the previous call are used, and the caller's next
    run (blocks ``next_ids``, under ``next_keys``) is begun while this call's writes
    finish: through rows, its first steps gathered; into the store's memory, its first
    step gathered into room reserved for it (where ``next_keys`` are given, and this run
    wrote every step)."""
    run = _Run(mover, batch, deadline, label)
    n = len(batch)
    steps: deque[_Step] = deque()
    try:
        route, segments = mover.route(batch, cache_lent=True)
        if segments is not None:  # nothing to copy, no rows to bound
            step = max(run.step, -(-n // IN_PLACE_STEPS))
            for off in range(0, n, step):
                count = min(step, n - off)
                payloads = deferred_payloads(segments, range(off, off + count))
                task = batch.store.dump(list(batch.keys[off : off + count]), payloads, batch.tag)
                steps.append(_Step(off, count, task, None))
        else:
            into_store = route is Route.STORE_MEMORY
            following = None
            if ahead is not None and into_store and next_keys:
                count = min(run.step, len(next_ids), len(next_keys))
                following = attrs.evolve(batch, block_ids=next_ids[:count], keys=next_keys[:count])
            _write_steps(run, steps, ahead, into_store, following)
            if ahead is not None and not into_store:
                _gather_ahead(run, steps, next_ids, ahead)
    except Exception as exc:  # noqa: BLE001 - a failing store never fails the engine
        log.warning("ucm %s: write of blocks %d.. failed: %s", label,
                    sum(s.count for s in steps), exc)  # fmt: skip
    return _settle(run, steps)


def _write_steps(
    run: _Run,
    steps: deque[_Step],
    ahead: Ahead | None,
    into_store: bool,
    following: Batch | None = None,
) -> None:
    """Write in steps, each into the store's memory (``into_store``) where it has room,
    else through rows.  A step copied into the store's memory is committed once the next
    step's copy is under way, the last one once the copy of ``following`` (the first step
    of the caller's next run) is, into room kept in ``ahead``: the copies run back to
    back."""
    n = len(run.batch)
    step = run.step
    copying: tuple[int, int, RoomWrite] | None = None  # offset, count, its room
    whole = True  # every step was begun
    try:
        for off in range(0, n, step):
            # Bound the rows: wait for the oldest step before gathering another.
            while sum(not s.task.done() for s in steps) >= run.mover.settings.depth:
                oldest = next(s for s in steps if not s.task.done())
                if not wait_until(oldest.task, run.deadline):
                    break
            if time.monotonic() >= run.deadline or any(
                s.task.done() and verified_prefix(s.task.partial()) < s.count for s in steps
            ):
                whole = False
                break
            count = min(step, n - off)
            part = run.batch.part(off, off + count)
            room = None
            if into_store:
                room = ahead.take_room(part) if ahead is not None else None
                room = room or run.mover.start_room_write(part)
            if copying is not None:  # in order: before this step, through rows or not
                (at, size, done), copying = copying, None
                steps.append(_Step(at, size, done.commit(), None))
            if room is not None:
                copying = (off, count, room)
                continue
            _write_step(run, off, part, steps, ahead)
        if copying is not None:
            if whole and following is not None and ahead is not None:
                room = run.mover.start_room_write(following)  # queued behind the last copy
                if room is not None:
                    ahead.rooms[_part_key(following)] = room
            (at, size, done), copying = copying, None
            steps.append(_Step(at, size, done.commit(), None))
    finally:
        if copying is not None:  # something failed meanwhile: its room goes back
            copying[2].abort()


def _write_step(run: _Run, off: int, part: Batch, steps: deque[_Step], ahead: Ahead | None) -> None:
    """One step through rows."""
    pool = run.mover.pool
    rows = ahead.take(part.block_ids) if ahead is not None else None
    try:
        if rows is None:
            rows = run.mover.take_rows(part)
            run.mover.gather_rows(part, rows)
        task = part.store.dump(list(part.keys), row_buffers(rows), part.tag)
    except Exception:
        if rows is not None:
            pool.give(rows)
        raise
    task.add_done_callback(lambda _t, r=rows: pool.give(r))
    steps.append(_Step(off, len(part), task, rows))


def _gather_ahead(run: _Run, steps: deque[_Step], next_ids: Sequence[Any], ahead: Ahead) -> None:
    step = run.step
    for off in range(0, len(next_ids), step):
        busy = any(not s.task.done() for s in steps)
        full = len(ahead.ready) >= run.mover.settings.depth
        if not busy or full or time.monotonic() >= run.deadline:
            return
        ids = next_ids[off : off + step]
        # the next run's blocks: only their caches and size matter to a gather
        part = attrs.evolve(run.batch, block_ids=ids, keys=[b""] * len(ids))
        rows = run.mover.take_rows(part)
        try:
            run.mover.gather_rows(part, rows)
        except Exception:  # noqa: BLE001 - the next run gathers it again and reports
            run.mover.pool.give(rows)
            return
        ahead.ready[_ids_key(ids)] = rows


def _settle(run: _Run, steps: deque[_Step]) -> int:
    """The leading stored blocks; nothing past the first gap stays in the store."""
    for s in steps:
        if not wait_until(s.task, run.deadline):
            break
    # Blocks being written when cancelled are not published, so whatever the store still
    # does with the caches after the grace never becomes a block.
    run.stop([s for s in steps if not s.task.done()])
    written = 0
    for s in steps:
        results = s.task.partial()
        good = verified_prefix(results)
        written += good
        if good < s.count:
            bad = results[good]
            if bad is not None and bad.status is not Status.CANCELLED:  # a timeout: above
                log.warning("ucm %s: block %d not stored: %s", run.label, s.offset + good,
                            first_problem(results))  # fmt: skip
            break
    _drop_after(run, steps, written)
    return written


def _drop_after(run: _Run, steps: deque[_Step], written: int) -> None:
    """Remove blocks stored past ``written`` (now, or when their step finishes): without the
    gap they are unreachable, would only take space, and a plain ``lookup`` would count
    them."""
    for s in steps:
        first = max(written - s.offset, 0)
        if first >= s.count:
            continue
        step_keys = run.batch.keys[s.offset : s.offset + s.count]

        def drop(task: Task, first: int = first, step_keys: Sequence[bytes] = step_keys) -> None:
            results = task.wait(0)
            stored = [step_keys[i] for i in range(first, len(step_keys)) if results[i].ok]
            if not stored:
                return
            try:
                run.batch.store.remove(stored)
            except Exception as exc:  # noqa: BLE001 - a failing store never fails the engine
                log.warning("ucm %s: cannot remove %d blocks past the stored prefix: %s",
                            run.label, len(stored), exc)  # fmt: skip

        s.task.add_done_callback(drop)


# -- reads -----------------------------------------------------------------------------------


def read_run(mover: Mover, batch: Batch, deadline: float, label: str) -> int:
    """Load the run's blocks; how many leading blocks were filled."""
    run = _Run(mover, batch, deadline, label)
    n = len(batch)
    step = run.step
    from_store = False
    pending: deque[_Step] = deque()
    late: list[_Step] = []  # steps left behind still loading
    copying: _LentCopy | None = None  # the last lent step, its copy possibly running
    submitted = 0
    filled = 0
    problem = ""

    def finish_copy() -> str:
        """End the lent step's copy and count it; where it stopped short, and why."""
        nonlocal copying, filled
        assert copying is not None
        done, copying = copying, None
        copied, short = done.finish()
        filled += copied
        return short

    try:
        route, segments = mover.route(batch, cache_lent=True)
        depth = mover.settings.depth
        if segments is not None:  # in place: no rows to bound
            depth, step = n, max(step, -(-n // IN_PLACE_STEPS))
        else:
            from_store = route is Route.STORE_MEMORY
        while True:
            while submitted < n and len(pending) < depth:
                count = min(step, n - submitted)
                pending.append(_load(run, segments, submitted, count, from_store))
                submitted += count
            if not pending:
                break
            s = pending.popleft()
            finished = wait_until(s.task, deadline)  # the last lent step's copy runs meanwhile
            results = s.task.partial()
            good = verified_prefix(results)
            part = batch.part(s.offset, s.offset + s.count)
            if s.lent is not None:  # copied out, then given back
                lent, s.lent = s.lent, None
                this = _LentCopy(s.offset, s.count, good, lent, None)
                try:  # queued behind the copy before it: the device never waits for us
                    this.copy = mover.start_copy_out(part, lent, good)
                except BaseException:
                    lent.release()
                    raise
                if good and this.copy is None:
                    this.why = "cannot copy out of the store's memory"
                if copying is not None:  # in order: the step before counts first
                    problem = finish_copy()
                    if problem:  # this one's blocks do not count: given back
                        this.finish()
                        break
                copying = this
                if good < s.count:  # the read stops here: no next copy to overlap
                    copying.why = copying.why or first_problem(results)
                    problem = finish_copy()
                    break
                continue
            if copying is not None:  # in order: the lent step before this one first
                problem = finish_copy()
                if problem:
                    pending.appendleft(s)  # not used: stopped below
                    break
            if not finished:
                late.append(s)  # its leading loaded blocks still count
            if good and s.rows is not None:
                mover.scatter_rows(part.part(0, good), s.rows[:good])
            if finished and s.rows is not None:
                mover.pool.give(s.rows)
            filled += good
            if good < s.count:
                problem = f"block {s.offset + good}: {first_problem(results)}"
                break
        if copying is not None:
            problem = finish_copy()
    except Exception as exc:  # noqa: BLE001 - a failing store is a shorter hit
        problem = f"failed: {exc}"
    finally:
        if copying is not None:  # something failed meanwhile: not counted
            copying.finish()
        late += pending
        for s in late:
            if s.lent is not None:  # not copied: given back (checks in progress end)
                s.lent.release()
        late = [s for s in late if s.lent is None]
        if not run.stop(late):
            _warn_late(late, label)
        for s in late:  # the store may still fill their rows
            if s.rows is not None:
                s.task.add_done_callback(lambda _t, r=s.rows: mover.pool.give(r))
    if filled < n:
        log.warning("ucm %s: read %d of %d blocks, stopped at %s", label, filled, n,
                    problem or "an unknown problem")  # fmt: skip
    return filled


def _load(
    run: _Run, segments: BlockSegments | None, offset: int, count: int, from_store: bool
) -> _Step:
    """Submit the loads of blocks ``[offset, offset + count)``: in place, lent by the store
    (``from_store``, where it lends them), or into rows."""
    part = run.batch.part(offset, offset + count)
    keys = list(part.keys)
    if from_store:
        lent = run.mover.lent(part)
        if lent is not None:
            return _Step(offset, count, lent.task, None, lent)
    if segments is not None:
        payloads = deferred_payloads(segments, range(offset, offset + count))
        return _Step(offset, count, part.store.load(keys, payloads, part.tag), None)
    rows = run.mover.take_rows(part)
    try:
        task = part.store.load(keys, row_buffers(rows), part.tag)
    except Exception:
        run.mover.pool.give(rows)
        raise
    return _Step(offset, count, task, rows)


def _warn_late(late: Sequence[_Step], label: str) -> None:
    blocks = [s.offset + i for s in late for i, r in enumerate(s.task.partial()) if r is None]
    in_place = any(s.rows is None for s in late)
    log.error(
        "ucm %s: the store is still reading blocks %s after the grace; %s",
        label,
        blocks[:8],
        "their cache blocks may still be written: they are not reported as read"
        if in_place
        else "their rows are left to them",
    )
