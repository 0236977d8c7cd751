"""Moving runs of blocks between the paged caches and the store.

Three ways, chosen per call:

* **in place** (CPU caches whose blocks are contiguous, FastDeploy's layout): each block's
  payload is a list of views of the cache memory (``ucm.kernels.block_segments``); the store
  writes the file from, and reads it into, the caches directly, with no copy at all;
* **into the store's memory** (GPU caches, and CPU caches of other layouts, where the store
  keeps its blocks in this host's memory: the dram store of scope ``host``): a write gathers
  a step of blocks straight into the slots the store reserves (``Store.open_writes``), and
  the store only seals them; a read copies out of the blocks the store lends where they lie
  (``Store.open_reads``), once its threads checked them.  On a GPU the store's memory is
  registered with the CUDA driver first (``ucm.kernels.PinnedRegions``), so that its DMA
  engine copies straight into and out of it: one copy, no staging row;
* **staged** (everything else): a write gathers a step of blocks into a staging buffer and
  hands it to the store, gathering the next step while the store's threads write the
  previous one; a read keeps a few steps of loads in flight and scatters each verified step
  while the next ones load.  The copies go through ``ucm.kernels``.

Both keep the stored prefix whole:

* a write reports how many leading blocks are stored.  Past a failed block or the deadline it
  cancels the rest (a block being written when cancelled is not published), waits a short
  grace for the store to let go of the buffers, and removes any block that landed past the
  first gap, so a later lookup finds exactly the reported prefix;
* a read uses only the leading blocks that loaded and verified, and stops at the first one
  that did not.  Before it returns, the store has stopped writing the caches: loads not
  started are cancelled and loads in progress are waited for (the grace).

Staging rows come from a pool (``ucm.kernels.transfer.RowPool``) and go back to it only once
the store is done with them (a timed-out task may still be using them after the call
returns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import attrs
import torch
from ucm.core.store import Status, Store, Task
from ucm.core.store.reads import SlotReads
from ucm.core.store.writes import SlotWrites
from ucm.fastdeploy.tensors import CacheSet
from ucm.kernels import (
    IN_PLACE_MIN_BYTES,
    BlockSegments,
    HostStager,
    PinnedRegions,
    TransferHandle,
    block_segments,
    dump_into,
)
from ucm.kernels.transfer import (
    RowPool,
    deferred_payloads,
    first_problem,
    row_buffers,
    verified_prefix,
)

log = logging.getLogger(__name__)


@attrs.define
class _Step:
    offset: int  # first block of the step, counted from the call's first block
    count: int
    task: Task
    buf: list[torch.Tensor] | None  # the staging rows; None in place
    lent: SlotReads | None = None  # a read's blocks the store lends where they lie


@attrs.define
class _TierWrite:
    """A write step gathered into the store's room, its copy possibly still running: it is
    committed once the copy is done, while the next step's copy is prepared."""

    offset: int
    count: int
    writes: SlotWrites
    handle: TransferHandle | None  # None: nothing to copy

    def commit(self) -> _Step:
        # A copy that fails to finish leaves the room reserved, not given back: the copy
        # may still write it, so no other writer gets it while this process lives.
        if self.handle is not None:
            self.handle.wait()
        return _Step(self.offset, self.count, self.writes.commit(), None)

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        self.writes.abort()


@attrs.define
class _LentCopy:
    """A read step's checked blocks being copied out of the store's memory, its copy
    possibly still running: the blocks are given back once it is done, while the next
    step's checks are waited for."""

    offset: int
    count: int  # blocks of the step
    good: int  # leading blocks checked: those copied, unless the copy was refused
    lent: SlotReads
    handle: TransferHandle | None
    why: str = ""  # why not every block of the step is copied

    def finish(self) -> tuple[int, str]:
        """Wait for the copy and give every block back.  How many leading blocks were
        copied while still lent (the cache blocks past them may hold anything), and where
        and why the step stopped short ("" where it did not)."""
        try:
            if self.handle is not None:
                self.handle.wait()
        finally:  # every loan ends, whatever happened
            held = self.lent.release()
        copied = self.good if self.handle is not None else 0
        kept = next((i for i in range(copied) if not held[i]), copied)
        why = "the store took it back before it was copied" if kept < copied else self.why
        return kept, "" if kept == self.count else f"block {self.offset + kept}: {why}"


@attrs.define
class Ahead:
    """Steps of the next slice, gathered while the writes of this one finish (staged writes).

    A slice ends by waiting for its last writes; gathering the next slice's first steps
    meanwhile keeps the copy and the store busy at once across slice boundaries.  The
    gather only reads the caches, so a next slice that never comes costs nothing but the
    copy; :meth:`release` returns its buffers."""

    pool: RowPool
    ready: dict[tuple[int, ...], list[torch.Tensor]] = attrs.Factory(dict)

    def take(self, block_ids: Sequence[int]) -> list[torch.Tensor] | None:
        return self.ready.pop(tuple(block_ids), None)

    def release(self) -> None:
        for buf in self.ready.values():
            self.pool.give(buf)
        self.ready.clear()


#: the process's staging rows (a FastDeploy cache transfer process has one AttentionStore,
#: tests and benchmarks make many: they all reuse these), as much kept as 16 steps of the
#: default 32 MiB
SHARED_POOL = RowPool(512 << 20)


class Mover:
    """Moves whole blocks between the caches and the store: in place where the caches allow
    it, straight into and out of the store's memory where it has some, and through
    ``ucm.kernels`` (``HostStager``) otherwise."""

    def __init__(
        self,
        store: Store,
        pool: RowPool,
        chunk_bytes: int,
        depth: int,
        zero_copy: bool = True,
    ) -> None:
        self.store = store
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.zero_copy = zero_copy
        self._stagers = threading.local()  # a side stream per thread on a GPU
        # the store's host memory, registered with the GPU's driver (_registered)
        self.pinned = PinnedRegions()
        self._pinning = threading.Lock()
        self._refused = False  # the driver or a copy refused the store's memory: stage

    def close(self) -> None:
        """Unregister the store's memory from the GPU's driver (before the store unmaps
        it)."""
        with self._pinning:
            self.pinned.close()

    def _tier(self, cs: CacheSet) -> bool:
        """Whether to try moving this call's blocks straight between the caches and the
        store's own memory (:meth:`Store.open_writes` and :meth:`Store.open_reads` say
        whether it has some): on a GPU once that memory is registered with its driver, on
        the CPU where a block is large enough to copy as fast as into staging rows."""
        if not self.zero_copy or self._refused:
            return False
        if cs.device.type == "cpu":
            return cs.nbytes >= IN_PLACE_MIN_BYTES
        return cs.device.type == "cuda" and self._registered()

    def _registered(self) -> bool:
        """Whether the store's host memory is registered with the GPU's driver: all of it,
        the first time the store has some (it maps its memory with its first block)."""
        with self._pinning:
            if self.pinned or self._refused:
                return bool(self.pinned)
            regions = self.store.host_memory()
            if not regions:
                return False
            self._refused = not self.pinned.register_all(regions)
            return not self._refused

    def _refuse(self, what: str, exc: Exception) -> None:
        log.warning("ucm fastdeploy: cannot copy %s the store's memory (%s): staging instead",
                    what, exc)  # fmt: skip
        self._refused = True

    def _in_place(self, cs: CacheSet, block_ids: Sequence[int]) -> BlockSegments | None:
        """Each block's payload as views of the caches, or None: stage it."""
        if not self.zero_copy:
            return None
        scales = None if cs.scales is None else list(cs.scales)
        return block_segments(list(cs.caches), block_ids, scales=scales)

    def _gather(self, cs: CacheSet, block_ids: Sequence[int], buf: list[torch.Tensor]) -> None:
        self._stager(cs.device).dump(cs.caches, block_ids, buf, scales=cs.scales).wait()

    def _scatter(self, cs: CacheSet, block_ids: Sequence[int], buf: list[torch.Tensor]) -> None:
        self._stager(cs.device).load(cs.caches, block_ids, buf, scales=cs.scales).wait()

    def _stager(self, device: torch.device) -> HostStager:
        stagers = self._stagers.__dict__.setdefault("by_device", {})
        if device not in stagers:
            stagers[device] = HostStager(device)
        return stagers[device]

    def _step_blocks(self, cs: CacheSet) -> int:
        return max(1, self.chunk_bytes // cs.nbytes)

    def _stop(self, steps: Sequence[_Step], grace_s: float) -> bool:
        """Cancel ``steps`` and wait up to ``grace_s`` until the store has let go of their
        buffers (the caches, in place); whether it has."""
        end = time.monotonic() + grace_s
        quiet = True
        for s in steps:
            quiet = s.task.cancel(wait=max(0.0, end - time.monotonic())) and quiet
        return quiet

    # -- write ----------------------------------------------------------------------------

    def write(
        self,
        cs: CacheSet,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        deadline: float,
        grace_s: float,
        label: str,
        ahead: Ahead | None = None,
        next_ids: Sequence[int] = (),
    ) -> int:
        """Store ``block_ids`` under ``keys``; return how many leading blocks are stored.

        Staged, with ``ahead``: steps gathered by the previous call are used, and the first
        steps of ``next_ids`` (the next slice) are gathered while this call's writes finish."""
        n = len(keys)
        step = self._step_blocks(cs)
        tag = cs.tag()
        steps: deque[_Step] = deque()
        try:
            segments = self._in_place(cs, block_ids)
            if segments is not None:  # nothing to copy, no staging memory to bound
                step = _in_place_step(step, n)
                for off in range(0, n, step):
                    count = min(step, n - off)
                    task = self.store.dump(
                        keys[off : off + count],
                        deferred_payloads(segments, range(off, off + count)),
                        tag,
                    )
                    steps.append(_Step(off, count, task, None))
            else:
                tier = self._tier(cs)
                self._write_steps(cs, block_ids, keys, deadline, tag, steps, ahead, tier)
                if ahead is not None and not tier:
                    self._gather_ahead(cs, steps, next_ids, ahead, deadline)
        except Exception as exc:  # noqa: BLE001 - a failing store never fails the engine
            log.warning("ucm fastdeploy %s: write of blocks %d.. failed: %s", label,
                        sum(s.count for s in steps), exc)  # fmt: skip
        return self._settle(steps, keys, deadline, grace_s, label)

    def _write_steps(
        self,
        cs: CacheSet,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        deadline: float,
        tag: bytes,
        steps: deque[_Step],
        ahead: Ahead | None,
        tier: bool,
    ) -> None:
        """Write in steps, each into the store's memory (``tier``) where it has room, else
        through staging rows.  A step copied into the store's memory is committed once the
        next step's copy is under way: the copies run back to back."""
        n = len(keys)
        step = self._step_blocks(cs)
        pin = cs.device.type == "cuda"
        copying: _TierWrite | None = None
        try:
            for off in range(0, n, step):
                # Bound the staging memory: wait for the oldest step before gathering another.
                while sum(not s.task.done() for s in steps) >= self.depth:
                    oldest = next(s for s in steps if not s.task.done())
                    if not _wait(oldest.task, deadline):
                        break
                if time.monotonic() >= deadline or any(
                    s.task.done() and verified_prefix(s.task.partial()) < s.count for s in steps
                ):
                    break
                count = min(step, n - off)
                ids, ks = block_ids[off : off + count], keys[off : off + count]
                started = self._start_tier_write(cs, off, ids, ks, tag) if tier else None
                if copying is not None:  # in order: before this step, staged or not
                    done, copying = copying, None
                    steps.append(done.commit())
                if started is not None:
                    copying = started
                    continue
                self._write_step(cs, off, ids, ks, tag, steps, ahead, pin)
            if copying is not None:
                done, copying = copying, None
                steps.append(done.commit())
        finally:
            if copying is not None:  # something failed meanwhile: its room goes back
                copying.abort()

    def _write_step(
        self,
        cs: CacheSet,
        off: int,
        ids: Sequence[int],
        ks: Sequence[bytes],
        tag: bytes,
        steps: deque[_Step],
        ahead: Ahead | None,
        pin: bool,
    ) -> None:
        """One step through staging rows."""
        count = len(ids)
        buf = ahead.take(ids) if ahead is not None else None
        try:
            if buf is None:
                buf = self.pool.take(cs.nbytes, count, pin=pin)
                self._gather(cs, ids, buf)
            task = self.store.dump(ks, row_buffers(buf), tag)
        except Exception:
            if buf is not None:
                self.pool.give(buf)
            raise
        task.add_done_callback(lambda _t, b=buf: self.pool.give(b))
        steps.append(_Step(off, count, task, buf))

    def _start_tier_write(
        self,
        cs: CacheSet,
        offset: int,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        tag: bytes,
    ) -> _TierWrite | None:
        """Start gathering the blocks straight into room the store reserves in its memory
        (committed once copied: the store seals and publishes them on its threads); None
        where it has no room for them: stage them."""
        try:
            writes = self.store.open_writes(keys, cs.nbytes, tag)
        except Exception as exc:  # noqa: BLE001 - the staged dump that follows reports it
            log.debug("ucm fastdeploy: no room to write in place (%s)", exc)
            return None
        if writes is None:
            return None
        stager = self._stager(cs.device)
        try:
            handle = dump_into(stager, self.pinned, cs.caches, block_ids, writes, scales=cs.scales)
        except ValueError as exc:  # the copy refused the room (a GPU: not pinned after all)
            self._refuse("into", exc)
            return None
        return _TierWrite(offset, len(keys), writes, handle)

    def _gather_ahead(
        self,
        cs: CacheSet,
        steps: deque[_Step],
        next_ids: Sequence[int],
        ahead: Ahead,
        deadline: float,
    ) -> None:
        step = self._step_blocks(cs)
        pin = cs.device.type == "cuda"
        for off in range(0, len(next_ids), step):
            busy = any(not s.task.done() for s in steps)
            if not busy or len(ahead.ready) >= self.depth or time.monotonic() >= deadline:
                return
            ids = next_ids[off : off + step]
            buf = self.pool.take(cs.nbytes, len(ids), pin=pin)
            try:
                self._gather(cs, ids, buf)
            except Exception:  # noqa: BLE001 - the next slice gathers it again and reports
                self.pool.give(buf)
                return
            ahead.ready[tuple(ids)] = buf

    def _settle(
        self,
        steps: deque[_Step],
        keys: Sequence[bytes],
        deadline: float,
        grace_s: float,
        label: str,
    ) -> int:
        """The leading stored blocks; nothing past the first gap stays in the store."""
        for s in steps:
            if not _wait(s.task, deadline):
                break
        # Blocks being written when cancelled are not published, so whatever the store
        # still does with the caches after the grace never becomes a block.
        self._stop([s for s in steps if not s.task.done()], grace_s)
        written = 0
        for s in steps:
            results = s.task.partial()
            good = verified_prefix(results)
            written += good
            if good < s.count:
                bad = results[good]
                if (
                    bad is not None and bad.status is not Status.CANCELLED
                ):  # a timeout is told above
                    log.warning("ucm fastdeploy %s: block %d not stored: %s", label,
                                s.offset + good, first_problem(results))  # fmt: skip
                break
        self._drop_after(steps, keys, written, label)
        return written

    def _drop_after(
        self, steps: deque[_Step], keys: Sequence[bytes], written: int, label: str
    ) -> None:
        """Remove blocks stored past ``written`` (now, or when their step finishes): without
        the gap they are unreachable, would only take space, and a plain ``lookup`` would
        count them."""
        for s in steps:
            first = max(written - s.offset, 0)
            if first >= s.count:
                continue
            step_keys = keys[s.offset : s.offset + s.count]

            def drop(task: Task, first: int = first, step_keys: Sequence[bytes] = step_keys):
                results = task.wait(0)
                stored = [step_keys[i] for i in range(first, len(step_keys)) if results[i].ok]
                if not stored:
                    return
                try:
                    self.store.remove(stored)
                except Exception as exc:  # noqa: BLE001 - a failing store never fails the engine
                    log.warning("ucm fastdeploy %s: cannot remove %d blocks past the stored "
                                "prefix: %s", label, len(stored), exc)  # fmt: skip

            s.task.add_done_callback(drop)

    # -- read -----------------------------------------------------------------------------

    def read(
        self,
        cs: CacheSet,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        deadline: float,
        grace_s: float,
        label: str,
    ) -> int:
        """Load ``keys`` into ``block_ids``; return how many leading blocks were filled."""
        n = len(keys)
        step = self._step_blocks(cs)
        pin = cs.device.type == "cuda"
        tag = cs.tag()
        tier = False
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
            segments = self._in_place(cs, block_ids)
            depth = self.depth
            if segments is not None:  # in place: no staging memory to bound
                depth, step = n, _in_place_step(step, n)
            else:
                tier = self._tier(cs)
            while True:
                while submitted < n and len(pending) < depth:
                    count = min(step, n - submitted)
                    pending.append(self._load(cs, keys, segments, submitted, count, pin, tag, tier))
                    submitted += count
                if not pending:
                    break
                s = pending.popleft()
                finished = _wait(s.task, deadline)  # the last lent step's copy runs meanwhile
                if copying is not None:  # in order: before this step, lent or not
                    problem = finish_copy()
                    if problem:
                        pending.appendleft(s)  # not used: stopped below
                        break
                results = s.task.partial()
                good = verified_prefix(results)
                if s.lent is not None:  # copied out, then given back
                    lent, s.lent = s.lent, None
                    copying = self._start_copy_lent(cs, block_ids, s, good, lent)
                    if good < s.count:  # the read stops here: no next copy to overlap
                        copying.why = copying.why or first_problem(results)
                        problem = finish_copy()
                        break
                    continue
                if not finished:
                    late.append(s)  # its leading loaded blocks still count
                if good and s.buf is not None:
                    self._scatter(cs, block_ids[s.offset : s.offset + good], s.buf[:good])
                if finished and s.buf is not None:
                    self.pool.give(s.buf)
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
            if not self._stop(late, grace_s):
                _warn_late(late, label)
            for s in late:  # the store may still fill their staging rows
                if s.buf is not None:
                    s.task.add_done_callback(lambda _t, b=s.buf: self.pool.give(b))
        if filled < n:
            log.warning(
                "ucm fastdeploy %s: read %d of %d blocks, stopped at %s", label, filled, n,
                problem or "an unknown problem",
            )  # fmt: skip
        return filled

    def _load(
        self,
        cs: CacheSet,
        keys: Sequence[bytes],
        segments: BlockSegments | None,
        offset: int,
        count: int,
        pin: bool,
        tag: bytes,
        tier: bool,
    ) -> _Step:
        """Submit the loads of blocks ``[offset, offset + count)``: in place, lent by the
        store (``tier``, where it lends them), or into staging rows."""
        ks = keys[offset : offset + count]
        if tier:
            try:
                lent = self.store.open_reads(ks, cs.nbytes, tag)
            except Exception as exc:  # noqa: BLE001 - the load that follows reports the store
                log.debug("ucm fastdeploy: no blocks lent in place (%s)", exc)
                lent = None
            if lent is not None:
                return _Step(offset, count, lent.task, None, lent)
        if segments is not None:
            return _Step(
                offset,
                count,
                self.store.load(
                    ks, deferred_payloads(segments, range(offset, offset + count)), tag
                ),
                None,
            )
        buf = self.pool.take(cs.nbytes, count, pin=pin)
        try:
            task = self.store.load(ks, row_buffers(buf), tag)
        except Exception:
            self.pool.give(buf)
            raise
        return _Step(offset, count, task, buf)

    def _start_copy_lent(
        self, cs: CacheSet, block_ids: Sequence[int], s: _Step, good: int, lent: SlotReads
    ) -> _LentCopy:
        """Start scattering step ``s``'s ``good`` leading lent blocks, checked, into their
        cache blocks (given back once copied: :meth:`_LentCopy.finish`)."""
        copy = _LentCopy(s.offset, s.count, good, lent, None)
        try:
            if good:
                ids = block_ids[s.offset : s.offset + good]
                rows = self.pinned.rows(lent.views[:good])  # type: ignore[arg-type]
                copy.handle = self._stager(cs.device).load(cs.caches, ids, rows, scales=cs.scales)
        except ValueError as exc:  # the copy refused the store's memory (a GPU: not pinned)
            self._refuse("out of", exc)
            copy.why = f"cannot copy out of the store's memory: {exc}"
        except BaseException:
            lent.release()
            raise
        return copy


def _warn_late(late: Sequence[_Step], label: str) -> None:
    blocks = [s.offset + i for s in late for i, r in enumerate(s.task.partial()) if r is None]
    in_place = any(s.buf is None for s in late)
    log.error(
        "ucm fastdeploy %s: the store is still reading blocks %s after the grace; %s",
        label,
        blocks[:8],
        "their cache blocks may still be written: they are not reported as read"
        if in_place
        else "their staging buffers are left to them",
    )


def _wait(task: Task, deadline: float) -> bool:
    """Wait for ``task`` until ``deadline`` (monotonic); whether it is done."""
    if task.done():
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        task.wait(left)
    except TimeoutError:
        return False
    return True


#: In place, a read or write goes in this many steps at most.  A step costs a store task and
#: a wake-up of the caller (1 GiB read in place in steps of 8 blocks: 9.2-10 GB/s, against
#: 10.5-11.5 in 8 steps, here), and buys only an earlier stop after a failed block.
_IN_PLACE_STEPS = 8


def _in_place_step(step: int, n: int) -> int:
    return max(step, -(-n // _IN_PLACE_STEPS))
