"""List (and require) the CUDA architectures compiled into shared libraries.

Wheel metadata rarely says which GPUs a CUDA build runs on, so the GPU image reads it
from the binaries themselves: every CUDA library embeds "fatbin" containers
(magic ``0xBA55ED50``) whose entries are SASS for one ``sm_XY`` or PTX for one
``compute_XY``. SASS for the GPU's architecture runs natively; PTX can be JIT-compiled
for newer GPUs; with neither, kernels fail with "no kernel image is available".

Usage (the GPU Dockerfile runs it at build time and fails without sm_90)::

    python docker/check_cuda_archs.py --require sm_90 /opt/venv/lib/python3.12/site-packages/faiss

Paths may be files or directories (every ``*.so*`` below them is scanned). Exit code 1
when a required architecture is missing from every scanned file or no CUDA code was
found at all. Standard library only: it runs in a bare build stage.
"""

from __future__ import annotations

import argparse
import mmap
import struct
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
_CONTAINER_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, payload size
_ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, flags, header size, payload size
_ARCH_OFFSET = 28  # u32 compute capability * 10, inside an entry header
_KINDS = {1: "compute", 2: "sm"}  # PTX / SASS (ELF cubin)


def fatbin_archs(data: bytes | mmap.mmap) -> Counter[str]:
    """Count the fatbin entries per architecture in one binary.

    Parameters
    ----------
    data : bytes or mmap
        The whole file.

    Returns
    -------
    Counter
        ``{"sm_90": n_sass_entries, "compute_90": n_ptx_entries, ...}``.
    """
    counts: Counter[str] = Counter()
    pos = data.find(FATBIN_MAGIC)
    while pos != -1:
        next_from = pos + 4
        if pos + _CONTAINER_HEADER.size <= len(data):
            _, version, header_size, payload_size = _CONTAINER_HEADER.unpack_from(data, pos)
            if version == 1 and header_size == _CONTAINER_HEADER.size:
                end = min(pos + header_size + payload_size, len(data))
                off = pos + header_size
                while off + _ARCH_OFFSET + 4 <= end:
                    kind, _, entry_header, entry_size = _ENTRY_HEADER.unpack_from(data, off)
                    if kind not in _KINDS or entry_header < _ARCH_OFFSET + 4:
                        break
                    (arch,) = struct.unpack_from("<I", data, off + _ARCH_OFFSET)
                    counts[f"{_KINDS[kind]}_{arch}"] += 1
                    off += entry_header + entry_size
                next_from = max(next_from, end)
        pos = data.find(FATBIN_MAGIC, next_from)
    return counts


def shared_libraries(paths: Iterable[Path]) -> Iterator[Path]:
    """Yield the given files and every ``*.so*`` file below the given directories."""
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.so*") if p.is_file())
        else:
            yield path


def scan(paths: Iterable[Path]) -> dict[Path, Counter[str]]:
    """Architectures per library, for libraries that contain CUDA code."""
    found = {}
    for lib in shared_libraries(paths):
        with lib.open("rb") as fh:
            if lib.stat().st_size == 0:
                continue
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                counts = fatbin_archs(data)
        if counts:
            found[lib] = counts
    return found


def _arch_key(name: str) -> tuple[int, str]:
    return int(name.rsplit("_", 1)[1]), name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="shared libraries or folders")
    parser.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="ARCH",
        help="an architecture that must be present, e.g. sm_90 (repeatable)",
    )
    args = parser.parse_args(argv)
    missing_paths = [p for p in args.paths if not p.exists()]
    if missing_paths:
        print(f"check_cuda_archs: no such path: {missing_paths[0]}", file=sys.stderr)
        return 1
    found = scan(args.paths)
    if not found:
        print("check_cuda_archs: no CUDA fatbin in " + " ".join(map(str, args.paths)))
        return 1
    present: set[str] = set()
    for lib, counts in found.items():
        present.update(counts)
        archs = ", ".join(sorted(counts, key=_arch_key))
        print(f"{lib}: {archs}")
    missing = [arch for arch in args.require if arch not in present]
    if missing:
        print(f"check_cuda_archs: missing {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
