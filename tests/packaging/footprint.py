"""What the installed package takes on disk, measured in a Debian tree after `dpkg -i`.

Counted: every file dpkg lists for edged, and everything under the package's own directories,
whether dpkg lists it or the postinst made it (the byte-code in /usr/lib/edged, the models
seeded into /var/lib/edged); disk blocks, as du counts them, each hard link once.

`python -m tests.packaging.footprint ROOT` prints the parts of the package installed in ROOT.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

MIB = 1024 * 1024
# Where the package and its maintainer scripts put files (all of it counted, listed or not).
OWN = ("/usr/lib/edged", "/usr/share/edged", "/var/lib/edged", "/var/cache/edged")


def listed(root: Path, package: str = "edged") -> list[str]:
    """dpkg's list of the package's files (from its database in the tree, read directly)."""
    text = (root / "var/lib/dpkg/info" / f"{package}.list").read_text()
    return [line for line in text.splitlines() if line]


def parts(root: Path) -> Counter[str]:
    """Bytes on disk per part of the installed package (each inode counted once)."""
    seen: set[tuple[int, int]] = set()
    sizes: Counter[str] = Counter()

    def count(path: Path, inside: str) -> None:
        info = path.lstat()
        if (info.st_dev, info.st_ino) in seen:
            return
        seen.add((info.st_dev, info.st_ino))
        sizes[part_of(inside, path.name)] += info.st_blocks * 512

    for top in OWN:
        base = root / top.lstrip("/")
        if not base.exists():
            continue
        count(base, top)
        for directory, subdirs, files in os.walk(base):
            for name in subdirs + files:
                path = Path(directory) / name
                count(path, "/" + str(path.relative_to(root)))
    for inside in listed(root):
        path = root / inside.lstrip("/")
        if path.is_symlink() or not path.is_dir():
            count(path, inside)
    for path in (root / "var/lib/dpkg/info").glob("edged.*"):
        count(path, "/var/lib/dpkg/info/edged.*")
    return sizes


def part_of(inside: str, name: str) -> str:
    """The part a path belongs to: a distribution's top directory in site-packages, the
    byte-code, a model, or the package's other files."""
    if "/__pycache__" in inside or name.endswith(".pyc"):
        return "byte-code (compiled by the postinst)"
    if inside.startswith("/usr/lib/edged/"):
        rest = inside.split("/site-packages/", 1)
        if len(rest) == 2 and rest[1]:
            top = rest[1].split("/", 1)[0]
            return f"site-packages/{top.split('-')[0] if top.endswith('-info') else top}"
        return "/usr/lib/edged (other)"
    for models in ("/usr/share/edged/models/", "/var/lib/edged/models/"):
        if inside.startswith(models) and inside != models:
            return f"model {inside[len(models) :].split('/', 1)[0]}"
    if inside.startswith("/var/lib/edged"):
        return "/var/lib/edged (other)"
    return "other (commands, docs, man pages, units, config, dpkg's database)"


def report(sizes: Counter[str], top: int = 25) -> str:
    total = sum(sizes.values())
    lines = [f"{'MiB':>8}  part", f"{total / MIB:8.1f}  total on disk"]
    lines += [f"{size / MIB:8.1f}  {part}" for part, size in sizes.most_common(top)]
    return "\n".join(lines)


def du_tree(root: Path) -> int:
    """Bytes on disk of a whole tree (du -skx: blocks, each inode once)."""
    done = subprocess.run(["du", "-skx", str(root)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0]) * 1024


if __name__ == "__main__":
    print(report(parts(Path(sys.argv[1])), top=int(sys.argv[2]) if len(sys.argv) > 2 else 40))
