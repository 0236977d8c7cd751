"""A store's folder, taken only if nobody but its user can change what is in it.

Whoever can write a store's folder decides what its engines load, so a folder that is not
the user's own is refused at start-up, before a block is read:

* the folder itself must be a directory, not a link, owned by the user (or root) and not
  writable by group or others;
* every folder above it, and every link on the way, must belong to the user or root, and a
  folder above it may be writable by others only with the sticky bit (``/tmp``, ``/dev/shm``:
  others can add entries there but not rename or remove the user's);

unless the store is configured ``shared`` (a folder meant for several users or hosts, such
as a team's mount), where only links are still refused and the blocks must be signed
(:mod:`ucm.core.signing`) instead.  The error names the path, its owner and mode, and the
fix.
"""

from __future__ import annotations

import os
import stat

from ucm.core.settings import ConfigError

_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):  # fmt: skip
        if test(mode):
            return name
    return "non-folder"


def make_store_folder(path: str, key: str = "store.path") -> None:
    """Create the store's folder (mode 0700) where nothing lies at ``path``; something
    else there is left for :func:`check_store_folder` to name."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file, a FIFO or a link: check_store_folder says which, and the fix
    except OSError as exc:
        raise ConfigError(key, f"cannot make the store folder {path}: {exc.strerror}") from None


def _describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner {_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o})"


def check_store_folder(path: str, *, shared: bool, key: str = "store.path") -> str:
    """Refuse ``path`` (an existing folder) unless only its user can change it (see the
    module docstring); returns the folder's real path."""
    real = _walk(os.path.abspath(path), key, shared)
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            key,
            f"{path} is not a folder (it is a {_kind(st.st_mode)}): remove it, or set {key} "
            "to another folder",
        )
    if shared:
        return real
    if not _trusted(st.st_uid) or st.st_mode & 0o022:
        raise ConfigError(
            key,
            f"the store folder {_describe(path, st)} can be written by another user, who "
            "could then put blocks there that your engine loads. Use a folder of your own "
            f"(remove this one, or chown it to yourself and chmod 700 {path}), or, for a "
            "folder meant to be shared across users or hosts, set shared: true with a "
            "secret (see docs/security.md)",
        )
    return real


def nearest_existing(path: str) -> str:
    """``path``, or its nearest parent that exists (absolute; links not resolved)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def check_before_creating(path: str, *, shared: bool, key: str = "store.path") -> None:
    """Refuse to create ``path`` below a folder that another user can change: the part of
    it that exists already is checked like a store's parents, so that nothing is made
    through another user's link or in another user's folder."""
    existing = nearest_existing(path)
    if existing == os.path.abspath(path):
        return  # the folder exists: check_store_folder judges it
    real = _walk(existing, key, shared, store=False)
    _check_parent(real, key, shared)


def resolve_trusted(path: str, key: str, what: str) -> str:
    """The real path of ``path`` (a file such as a secret), resolved component by component:
    every link on the way must belong to this user or root, every folder passed to this user
    or root and be writable by nobody else (but with the sticky bit); ``ConfigError``
    naming ``what`` (e.g. "the secret file"), the path at fault and the fix otherwise."""
    return _walk(os.path.abspath(path), key, False, store=False, what=what)


def _walk(
    path: str, key: str, shared: bool, *, store: bool = True, what: str = "the store folder"
) -> str:
    """Resolve ``path`` component by component, checking each folder passed and each link
    met; returns the real path.  ``store``: ``path`` is the store's folder, which may not
    be a link itself."""
    pending = [p for p in path.split("/") if p]
    current = "/"
    links = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        _check_parent(current, key, shared, what)
        candidate = os.path.join(current, name)
        st = os.lstat(candidate)
        if stat.S_ISLNK(st.st_mode):
            if store and not pending:
                raise ConfigError(
                    key,
                    f"{candidate} is a symbolic link: a store folder must be the folder "
                    f"itself: remove it, or give the real path "
                    f"({os.path.realpath(candidate)}) if the link is yours",
                )
            if not _trusted(st.st_uid):
                raise ConfigError(
                    key,
                    f"the path of {what} passes the link {_describe(candidate, st)}, "
                    "which another user owns and could point elsewhere: remove it",
                )
            links += 1
            if links > _MAX_LINKS:
                raise ConfigError(key, f"too many links in {path}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            pending = [p for p in target.split("/") if p] + pending
            continue
        current = candidate
    return current


def _check_parent(folder: str, key: str, shared: bool, what: str = "the store folder") -> None:
    if shared:
        return
    st = os.stat(folder)
    writable_by_others = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    if not _trusted(st.st_uid) or writable_by_others:
        fix = (
            "Put the store in a folder only you and root can write, or set shared: true "
            "with a secret (see docs/security.md)"
            if what == "the store folder"
            else "Move it to a folder only you and root can write"
        )
        raise ConfigError(
            key,
            f"{what} lies in {_describe(folder, st)}, which another user can change "
            f"(rename or replace what is in it). {fix}",
        )
