"""The commands the harness adapters run inside a sandbox on their own behalf, and how their
answers are read. Pure: argv lists and parsers, no I/O, so each is tested alone.

Every helper here starts `/bin/sh` by absolute path and resolves the utilities it names through
a fixed system PATH, never the image's: an image (or an agent) that puts a writable directory
ahead of /usr/bin in PATH must not decide what runs as root on the harness's behalf. The
caller's own command keeps the PATH it was given (Inspect's `exec` contract says the same).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Union

SHELL = "/bin/sh"
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

# The first lines of every script: PATH pinned for the script itself, the caller's kept in
# `caller_path` for the command it finally runs.
_PIN = 'caller_path=${PATH-}\nPATH=%s\nexport PATH\nunset CDPATH\n' % SYSTEM_PATH

# What our scripts print on stderr, alone on a line, when they refuse: the errno name the
# adapters turn into the exception Python would raise for it.
MARKER = "runner-harness-error:"
_MARKER_LINE = re.compile(r"^%s ([A-Z]+)(?: (.*))?$" % re.escape(MARKER), re.MULTILINE)


def script(body: str, *args: str) -> List[str]:
    """The argv that runs POSIX `body` under /bin/sh with PATH pinned; `args` are $1, $2..."""
    return [SHELL, "-c", _PIN + body, "runner-harness", *args]


def failure(stderr: str) -> Optional["ScriptFailure"]:
    """The refusal one of our scripts printed, if any (the last one wins)."""
    found = _MARKER_LINE.findall(stderr)
    if not found:
        return None
    name, detail = found[-1]
    return ScriptFailure(name, detail)


@dataclass(frozen=True)
class ScriptFailure:
    errno_name: str
    """ENOENT, EISDIR, ENOTDIR, EACCES, EINVAL, EUSERS (no way to switch users)."""
    detail: str


# --- running as another user ----------------------------------------------------------------

# How the sandbox can switch users, found once per sandbox by PROBE_SWITCH: util-linux's
# setpriv (Debian, Ubuntu, Fedora: numeric ids, any uid) or su (busybox, Alpine: users of the
# passwd file only). runner's exec API has no user field, so this is done in the sandbox; it
# needs root with CAP_SETUID/CAP_SETGID, which runner's root has (in its user namespace).
PROBE_SWITCH = script(
    r"""
for p in /usr/bin/setpriv /bin/setpriv /usr/sbin/setpriv /sbin/setpriv; do
  if [ -x "$p" ] && "$p" --reuid=0 --regid=0 --clear-groups -- /bin/sh -c 'exit 0' 2>/dev/null; then
    echo "setpriv $p"; exit 0
  fi
done
# su switches without a password only for root.
me=
while read -r k a _; do case $k in Uid:) me=$a;; esac; done < /proc/self/status
if [ "$me" = 0 ]; then
  for p in /bin/su /usr/bin/su; do
    if [ -x "$p" ]; then echo "su $p"; exit 0; fi
  done
fi
echo "none -"
"""
)


@dataclass(frozen=True)
class Switch:
    """The sandbox's way to run a command as another user."""

    method: str
    """`setpriv`, `su` or `none`."""
    tool: str

    @classmethod
    def parse(cls, stdout: str) -> "Switch":
        words = stdout.split()
        if len(words) != 2 or words[0] not in ("setpriv", "su", "none"):
            raise ValueError("unexpected answer to the user-switch probe: %r" % stdout[:200])
        return cls(words[0], words[1])


# Resolves USER[:GROUP] as `docker exec --user` does (a name or a uid; a uid without a passwd
# entry gets gid 0 and home /; supplementary groups from /etc/group), at exec time, with shell
# builtins only, then runs the command as that user through the probed tool. A user or group
# that does not exist fails as docker's does (exit 126, the same words).
_AS_USER = r"""
spec=$1 method=$2 tool=$3 keep_home=$4; shift 4
u=${spec%%:*}; g=
case $spec in *:*) g=${spec#*:};; esac
name= uid= gid= home=/
if [ -r /etc/passwd ]; then
  while IFS=: read -r n _ i gi _ h _; do
    if [ "$n" = "$u" ] || { [ "$i" = "$u" ] && [ -z "$uid" ]; }; then
      name=$n uid=$i gid=$gi home=${h:-/}
      [ "$n" = "$u" ] && break
    fi
  done < /etc/passwd
fi
if [ -z "$uid" ]; then
  case $u in
    ''|*[!0-9]*) echo "unable to find user $u: no matching entries in passwd file" >&2; exit 126;;
  esac
  uid=$u gid=0
fi
if [ -n "$g" ]; then
  found=
  if [ -r /etc/group ]; then
    while IFS=: read -r gn _ gi _; do
      if [ "$gn" = "$g" ] || [ "$gi" = "$g" ]; then found=$gi; break; fi
    done < /etc/group
  fi
  if [ -z "$found" ]; then
    case $g in
      ''|*[!0-9]*) echo "unable to find group $g: no matching entries in group file" >&2; exit 126;;
    esac
    found=$g
  fi
  gid=$found
fi
groups=$gid
if [ -n "$name" ] && [ -r /etc/group ]; then
  while IFS=: read -r gn _ gi members; do
    case ",$members," in *",$name,"*) case ",$groups," in *",$gi,"*) ;; *) groups=$groups,$gi;; esac;; esac
  done < /etc/group
fi
[ "$keep_home" = 1 ] || export HOME="$home"
PATH=$caller_path
me= mygid=
while read -r k a _; do
  case $k in Uid:) me=$a;; Gid:) mygid=$a;; esac
done < /proc/self/status
if [ "$me" = "$uid" ] && [ "$mygid" = "$gid" ]; then exec "$@"; fi
case $method in
  setpriv) exec "$tool" --reuid="$uid" --regid="$gid" --groups="$groups" -- "$@";;
  su)
    if [ -z "$name" ] || [ -n "$g" ]; then
      echo "%(marker)s EUSERS this sandbox switches users with su, which needs a user of /etc/passwd and no group: $spec" >&2
      exit 126
    fi
    exec "$tool" -p -s /bin/sh "$name" -c 'HOME=$0; export HOME; exec "$@"' "$HOME" "$@";;
  *)
    echo "%(marker)s EUSERS this sandbox cannot switch to $spec: no setpriv or su in the image, or no CAP_SETUID" >&2
    exit 126;;
esac
""" % {"marker": MARKER}


def as_user(argv: Sequence[str], user: Union[str, int], switch: Switch, keep_home: bool) -> List[str]:
    """`argv` run as `user` (`name`, `uid`, `name:group`, `uid:gid`). `keep_home`: the caller
    set HOME itself, so the user's home from /etc/passwd does not replace it."""
    spec = str(user).strip()
    if not spec or "\n" in spec:
        raise ValueError("a user is a name or uid, optionally :group")
    return script(_AS_USER, spec, switch.method, switch.tool, "1" if keep_home else "0", *argv)


# --- stdin that is not text -----------------------------------------------------------------

_B64_STDIN = r"""
b=$(command -v base64) || { echo "%(marker)s EINVAL binary stdin needs base64 in the sandbox" >&2; exit 126; }
PATH=$caller_path
"$b" -d | "$@"
""" % {"marker": MARKER}


def decoding_stdin(argv: Sequence[str]) -> List[str]:
    """`argv` reading stdin that was sent base64-encoded: runner's exec API carries stdin as
    text (JSON), so bytes that are not UTF-8 travel encoded and are decoded in the sandbox."""
    return script(_B64_STDIN, *argv)


_STDIN_FILE = r"""
f=$1; shift
exec 0<"$f" || exit 126
rm -f -- "$f"
PATH=$caller_path
exec "$@"
"""


def stdin_from_file(path: str, argv: Sequence[str]) -> List[str]:
    """`argv` reading stdin from `path` (removed once open): stdin too large for one request
    (runner caps a JSON body at 4 MiB) is written to the sandbox first."""
    return script(_STDIN_FILE, path, *argv)


def stdin_text(data: Union[str, bytes]) -> "tuple[str, bool]":
    """What to send as the exec's stdin, and whether it had to be base64-encoded."""
    import base64

    if isinstance(data, str):
        return data, False
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True


# --- paths ----------------------------------------------------------------------------------


def sandbox_path(path: str, workdir: str) -> str:
    """An absolute, normalised path in the sandbox: relative ones resolve against `workdir`
    (the per-sample working directory). runner's API refuses `..` segments; normalising here
    gives them the meaning a shell's `cd` would."""
    if not isinstance(path, str) or not path:
        raise ValueError("a path in the sandbox must be a non-empty string")
    if "\0" in path:
        raise ValueError("a path in the sandbox cannot contain NUL")
    joined = path if path.startswith("/") else posixpath.join(workdir, path)
    normal = posixpath.normpath(joined)
    # normpath keeps a leading // (POSIX allows it to mean something else): one slash.
    return "/" + normal.lstrip("/")


# --- files ----------------------------------------------------------------------------------

# Reading is in chunks of base64 text on stdout (exec output is text, capped per stream by the
# server): the first call answers the size and the first chunk, later ones a chunk each. Only
# regular files (after links) are read: a FIFO would block, a device never end.
READ_BLOCK = 64 * 1024

_READ = r"""
f=$1 skip=$2 count=$3
if [ ! -e "$f" ]; then
  if [ -L "$f" ]; then echo "%(m)s ENOENT dangling link" >&2; else echo "%(m)s ENOENT" >&2; fi; exit 66
fi
[ -d "$f" ] && { echo "%(m)s EISDIR" >&2; exit 66; }
[ -f "$f" ] || { echo "%(m)s EINVAL not a regular file" >&2; exit 66; }
[ -r "$f" ] || { echo "%(m)s EACCES" >&2; exit 66; }
exec 3<"$f" || { echo "%(m)s EACCES" >&2; exit 66; }
if [ "$skip" = 0 ]; then size=$(wc -c <&3) || exit 1; echo "size $size"; exec 3<"$f"; fi
dd bs=%(block)d skip="$skip" count="$count" <&3 2>/dev/null | base64 || exit 1
""" % {"m": MARKER, "block": READ_BLOCK}


def read_chunk(path: str, first_block: int, blocks: int) -> List[str]:
    return script(_READ, path, str(first_block), str(blocks))


def parse_first_chunk(stdout: str) -> "tuple[int, str]":
    """(size, base64 text) of a read's first answer."""
    head, _, rest = stdout.partition("\n")
    if not head.startswith("size "):
        raise ValueError("unexpected answer to a file read: %r" % stdout[:200])
    return int(head[5:].strip()), rest


# Writing: the data arrives base64-encoded on stdin, in chunks (the first truncates, the rest
# append); missing parents are made. A directory in the way is refused as EISDIR.
_WRITE = r"""
f=$1 mode=$2
[ -d "$f" ] && { echo "%(m)s EISDIR" >&2; exit 66; }
d=$(dirname -- "$f")
if [ ! -d "$d" ]; then
  mkdir -p -- "$d" 2>/dev/null || {
    if [ -e "$d" ] || [ -L "$d" ]; then echo "%(m)s ENOTDIR $d" >&2; else echo "%(m)s EACCES $d" >&2; fi; exit 66; }
fi
if [ "$mode" = append ]; then base64 -d >> "$f"; else base64 -d > "$f"; fi
"""
_WRITE = _WRITE % {"m": MARKER}


def write_chunk(path: str, append: bool) -> List[str]:
    return script(_WRITE, path, "append" if append else "truncate")


# --- directories (tar) ----------------------------------------------------------------------

# A directory travels as a tar: packed in the sandbox into a temporary file read back in
# chunks, or written in chunks and unpacked there. tar in the sandbox (busybox and GNU both
# read and write ustar) keeps modes and links.
_PACK = r"""
src=$1 out=$2
[ -d "$src" ] || { if [ -e "$src" ]; then echo "%(m)s ENOTDIR" >&2; else echo "%(m)s ENOENT" >&2; fi; exit 66; }
tar -C "$src" -cf "$out" . || exit 1
"""
_PACK = _PACK % {"m": MARKER}

_UNPACK = r"""
tarball=$1 dest=$2
mkdir -p -- "$dest" || exit 1
tar -C "$dest" -xf "$tarball"; status=$?
rm -f -- "$tarball"
exit $status
"""


def pack_dir(source: str, tarball: str) -> List[str]:
    return script(_PACK, source, tarball)


def unpack_dir(tarball: str, dest: str) -> List[str]:
    return script(_UNPACK, tarball, dest)


def remove(path: str) -> List[str]:
    return script('rm -f -- "$1"', path)


# --- environment variables ------------------------------------------------------------------

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env(env: Optional[Mapping[str, str]]) -> dict[str, str]:
    """Environment variables for an exec, checked as runner checks them (names
    `[A-Za-z_][A-Za-z0-9_]*`), with a clear error here rather than a 400 later."""
    out: dict[str, str] = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError("environment variable name %r: letters, digits and _, not starting with a digit" % (key,))
        out[key] = str(value)
    return out
