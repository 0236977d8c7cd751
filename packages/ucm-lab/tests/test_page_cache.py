"""A folder's files read into the page cache for a benchmark's timed run, and what the
cache held of them before."""

from __future__ import annotations

import mmap
import os
import time

import pytest
from ucm.lab.page_cache import cached_pages, warm

BLOCK = 1 << 20


def written(path, size: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return str(path)


def cached(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def dropped(path) -> None:
    """The file's pages out of the page cache (a few tries: the kernel may keep some
    through a drop), else the test is skipped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(50):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not cached_pages(fd, os.fstat(fd).st_size):
                return
            time.sleep(0.02)
        pytest.skip("the page cache kept the test's file through every drop")
    finally:
        os.close(fd)


def test_a_folder_s_files_are_read_into_the_cache_and_what_it_held_before_is_said(tmp_path):
    (tmp_path / "blocks" / "ab").mkdir(parents=True)
    first = written(tmp_path / "blocks" / "ab" / "one", BLOCK)
    second = written(tmp_path / "blocks" / "two", BLOCK)
    written(tmp_path / "blocks" / "empty", 0)
    dropped(first)
    pages = BLOCK // mmap.PAGESIZE
    held = cached(second)
    got = warm(str(tmp_path / "blocks"))
    assert (got.files, got.bytes) == (3, 2 * BLOCK)
    assert got.cached_before == pytest.approx(held / (2 * pages))
    assert cached(first) == cached(second) == pages
    assert warm(str(tmp_path / "blocks")).cached_before == 1.0  # warm now


def test_links_are_not_followed_at_any_level(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    far = written(outside / "far", BLOCK)
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    os.symlink(far, blocks / "to-a-file")
    os.symlink(outside, blocks / "to-a-folder")
    os.mkfifo(blocks / "fifo")  # not a regular file: never opened (it would block)
    dropped(far)
    got = warm(str(blocks))
    assert (got.files, got.bytes, got.cached_before) == (0, 0, 1.0)
    assert cached(far) == 0
