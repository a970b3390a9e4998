"""A local directory (or file) as a gzipped tar for `files/upload`."""

from __future__ import annotations

import os
import tarfile
import tempfile
from typing import IO, Optional, Tuple

# Archives up to this size stay in memory; bigger ones spill to a temporary file.
_IN_MEMORY = 16 << 20


def _keep(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
    """Regular files, directories and links only (FIFOs, sockets and devices are left out:
    the server refuses them); no owner names or ids (the server gives everything to the
    sandbox's user anyway)."""
    if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(local: "str | os.PathLike[str]") -> Tuple[IO[bytes], int]:
    """A tar.gz of `local` — a directory's contents (not the directory itself), or one file
    under its own name — rewound, and its length. Symlinks are stored as symlinks."""
    local = os.fspath(local)
    if not os.path.lexists(local):
        raise FileNotFoundError(local)
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_IN_MEMORY)
    try:
        with tarfile.open(fileobj=spool, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
            if os.path.isdir(local) and not os.path.islink(local):
                for name in sorted(os.listdir(local)):
                    tar.add(os.path.join(local, name), arcname=name, recursive=True, filter=_keep)
            else:
                tar.add(local, arcname=os.path.basename(local), recursive=False, filter=_keep)
        length = spool.tell()
        spool.seek(0)
        return spool, length
    except BaseException:
        spool.close()
        raise
