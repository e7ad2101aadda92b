"""mecefo-patch: put MeCeFO into an existing Megatron checkout, check it, and take it out again.

    mecefo-patch apply  CHECKOUT    exit 0: patched (or it already was); 2: refused, nothing changed
    mecefo-patch check  CHECKOUT    exit 0: patched; 1: not patched; 2: unknown or locally changed
    mecefo-patch revert CHECKOUT    exit 0: restored byte for byte (or was not patched); 2: refused

(also `python -m megatron_mecefo.patch ...`). The checkout is recognised from its files, not from
git (a tarball export has no .git): every supported version has a manifest (patches/<name>/
manifest.json) with the SHA-256 of the upstream files our hooks rely on and of each patched file
before and after. An unknown version, or a target file with local changes, is refused with the
file that differs. All files of a patch are written or none is; `revert` checks that the result is
byte-identical to upstream.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.version import __version__

__all__ = ["PatchError", "Target", "targets", "status", "apply", "revert", "main"]

PATCHED, UNPATCHED = "patched", "unpatched"


class PatchError(Exception):
    """The checkout cannot be patched or reverted as asked; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One supported upstream version and its patch."""

    name: str
    repository: str
    version: str
    markers: Tuple[str, ...]
    identify: Dict[str, str]
    files: Dict[str, dict]
    folder: Path

    def describe(self) -> str:
        return f"{self.name} {self.version} ({self.repository})"

    def diff(self, path: str) -> str:
        return (self.folder / self.files[path]["patch"]).read_text(encoding="utf-8")


def patch_folders() -> List[Path]:
    """Where the patches are: the source tree's patches/ (a checkout or an editable install), or
    the copy a wheel installs under <prefix>/share/megatron-mecefo/patches."""
    here = Path(__file__).resolve().parents[1] / "patches"
    shared = Path(sys.prefix) / "share" / "megatron-mecefo" / "patches"
    return [p for p in (here, shared) if p.is_dir()]


def targets() -> List[Target]:
    for folder in patch_folders():
        found = []
        for manifest in sorted(folder.glob("*/manifest.json")):
            m = json.loads(manifest.read_text(encoding="utf-8"))
            found.append(Target(m["name"], m["repository"], m["version"], tuple(m["markers"]), m["identify"],
                                m["files"], manifest.parent))
        if found:
            return found
    raise PatchError("no patches found (the package's patches/ folder is missing from this install)")


def _sha256(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def status(checkout: str) -> Tuple[Target, str]:
    """(the target the checkout is, PATCHED or UNPATCHED).

    Raises:
        PatchError: not a checkout of a supported version, or a target file with local changes.
    """
    root = Path(checkout)
    if not root.is_dir():
        raise PatchError(f"{checkout}: not a directory")
    supported = targets()
    for target in supported:
        if not all((root / m).exists() for m in target.markers):
            continue
        for path, digest in target.identify.items():
            if _sha256(root / path) != digest:
                raise PatchError(f"{checkout}: a {target.name} checkout of an unknown version ({path} differs from "
                                 f"{target.version}); mecefo-patch supports {target.describe()} only")
        states = {}
        for path, spec in target.files.items():
            digest = _sha256(root / path)
            if digest == spec["original"]:
                states[path] = UNPATCHED
            elif digest == spec["patched"]:
                states[path] = PATCHED
            else:
                raise PatchError(f"{checkout}: {path} has local changes (it is neither {target.describe()}'s file nor "
                                 "its patched form): refusing to touch it; nothing was changed")
        if len(set(states.values())) > 1:
            raise PatchError(f"{checkout}: partly patched ({', '.join(f'{p}: {s}' for p, s in states.items())}); "
                             "restore the files from upstream")
        return target, next(iter(states.values()))
    raise PatchError(f"{checkout}: not a checkout mecefo-patch knows; supported: "
                     f"{', '.join(t.describe() for t in supported)}")


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _hunks(diff: str) -> List[Tuple[int, int, List[str]]]:
    """(old start, new start, lines with their ' ', '-', '+' prefix) of a unified diff."""
    hunks, current = [], None
    for line in diff.splitlines(keepends=True):
        m = _HUNK.match(line)
        if m:
            current = (int(m.group(1)), int(m.group(3)), [])
            hunks.append(current)
        elif current is not None and line[:1] in (" ", "-", "+"):
            current[2].append(line)
        elif current is not None and line.strip() == "":  # an empty context line some tools write
            current[2].append(" " + line)
    return hunks


def apply_diff(text: str, diff: str, reverse: bool = False) -> str:
    """`text` with the unified `diff` applied (or taken out), at the exact lines it names."""
    lines = text.splitlines(keepends=True)
    offset = 0
    for old_start, new_start, body in _hunks(diff):
        old = [l[1:] for l in body if l[0] in " -"]
        new = [l[1:] for l in body if l[0] in " +"]
        start = old_start
        if reverse:
            old, new, start = new, old, new_start
        at = start - 1 + offset if old else start + offset
        if lines[at:at + len(old)] != old:
            raise PatchError(f"the patch does not match the file at line {start}")
        lines[at:at + len(old)] = new
        offset += len(new) - len(old)
    return "".join(lines)


def _rewrite(root: Path, target: Target, reverse: bool) -> List[str]:
    """Write every file of the target's patch, or none."""
    want = "original" if reverse else "patched"
    new = {}
    for path, spec in target.files.items():
        text = apply_diff((root / path).read_text(encoding="utf-8"), target.diff(path), reverse=reverse)
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != spec[want]:
            raise PatchError(f"{path}: the result is not {target.describe()}'s {want} file; nothing was changed")
        new[path] = text
    written: List[Tuple[Path, bytes]] = []
    tmp = None
    try:
        for path, text in new.items():
            file = root / path
            before = file.read_bytes()
            tmp = file.with_name(f".{file.name}.mecefo-tmp")
            tmp.write_text(text, encoding="utf-8")
            os.chmod(tmp, file.stat().st_mode)
            os.replace(tmp, file)
            written.append((file, before))
    except OSError as e:
        if tmp is not None and tmp.exists():
            tmp.unlink()
        for file, before in written:  # all or none
            file.write_bytes(before)
        raise PatchError(f"could not write {e.filename}: {e.strerror}; nothing was changed") from None
    return list(new)


def apply(checkout: str) -> str:
    """Patch the checkout. Returns what was done (a line to print)."""
    target, state = status(checkout)
    if state == PATCHED:
        return f"{checkout}: already patched for MeCeFO ({target.describe()}); nothing to do"
    files = _rewrite(Path(checkout), target, reverse=False)
    return f"{checkout}: patched {', '.join(files)} ({target.describe()}); run it with --mecefo"


def revert(checkout: str) -> str:
    """Restore the checkout's patched files byte for byte."""
    target, state = status(checkout)
    if state == UNPATCHED:
        return f"{checkout}: not patched ({target.describe()}); nothing to do"
    files = _rewrite(Path(checkout), target, reverse=True)
    return f"{checkout}: restored {', '.join(files)} to {target.describe()}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="mecefo-patch", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("command", choices=("apply", "check", "revert", "diff"),
                   help="apply / check / revert the patch, or print it")
    p.add_argument("checkout", help="the root of a Megatron-DeepSpeed checkout (or export)")
    args = p.parse_args(argv)
    try:
        if args.command == "apply":
            print(apply(args.checkout))
        elif args.command == "revert":
            print(revert(args.checkout))
        else:
            target, state = status(args.checkout)
            if args.command == "diff":
                print("".join(target.diff(path) for path in target.files), end="")
                return 0
            print(f"{args.checkout}: {target.describe()}, {state}")
            return 0 if state == PATCHED else 1
    except PatchError as e:
        print(f"mecefo-patch: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
