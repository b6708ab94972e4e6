"""What a sandbox sees of the machine, and what a snapshot may hold.

Every sandbox sees the image's system folders read-only (SYSTEM_DIRS), so none of this
server's own state may lie in one. A snapshot is forked by sessions and written below by
root, so it may hold only what stays in its own tree: nothing that forks it, or writes
into it, may be led out of it."""

import os
import stat
from pathlib import Path

# The image's folders a sandbox sees, read-only, in its own root: its commands, libraries
# and settings. Nothing of this server's state may lie in one (`Server` checks).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


def in_system_dir(path: Path) -> Path | None:
    """The system folder sandboxes see `path` in, if one: a folder is bound alone, so a
    mount below it (a Secret's volume) does not show."""
    path = path.resolve()
    for name in SYSTEM_DIRS:
        shown = Path(name).resolve()
        if path.is_relative_to(shown) and shown.exists():
            nearest = next(p for p in (path, *path.parents) if p.exists())
            if nearest.stat().st_dev == shown.stat().st_dev:
                return shown
    return None


def confine(tree: Path) -> list[str]:
    """Leaves in `tree` folders, regular files and links that stay in it, and removes the
    rest (returned, relative): absolute links and those that lead out (to a fixed point,
    as removing one link can turn where another leads), pipes, sockets, devices, and
    files with a name outside the tree. So nothing that forks it, or writes below it, is
    led out of it."""
    tree = tree.resolve()
    removed: list[str] = []
    links: list[Path] = []
    files: dict[int, list[Path]] = {}  # inode -> its names in the tree
    pending = [tree]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                path = Path(entry.path)
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    pending.append(path)
                elif stat.S_ISLNK(info.st_mode):
                    links.append(path)
                elif stat.S_ISREG(info.st_mode):
                    files.setdefault(info.st_ino, []).append(path)
                else:
                    path.unlink()
                    removed.append(str(path.relative_to(tree)))
    for names in files.values():
        if names[0].lstat().st_nlink > len(names):
            for path in names:
                path.unlink()
                removed.append(str(path.relative_to(tree)))
    while escaped := [link for link in links if _leads_out(tree, link)]:
        for link in escaped:
            link.unlink()
            links.remove(link)
            removed.append(str(link.relative_to(tree)))
    return removed


def _leads_out(tree: Path, link: Path) -> bool:
    target = link.readlink()
    if target.is_absolute():
        return True
    written = Path(os.path.normpath(link.parent / target))  # as its text says
    followed = Path(os.path.realpath(link))  # as the tree resolves it now
    return not (written.is_relative_to(tree) and followed.is_relative_to(tree))
