"""ONNX Runtime's C/C++ API headers, which the pip wheel lacks, for compiling the kernels' ONNX Runtime ops.

Where from, in order: $SPECEXPORT_ORT_INCLUDE; a system copy (/usr/include/onnxruntime: Debian's or Ubuntu's
libonnxruntime-dev installed); the copy this module unpacked into the cache earlier; else Debian's
libonnxruntime-dev fetched once through apt as the machine configures it (`apt-get download`), and where the
machine's suites lack the package (Debian 12), through the machine's own Debian mirror with the suite that
has it, in a private list (nothing installed, the system's lists untouched). No host is named here: apt's
configuration names it. Every header must have the sha256 pinned below (1.21.0's: the C API is versioned,
so a library built on these runs on later runtimes), or nothing is kept.
"""
from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from specexport.errors import KernelsUnavailable

VERSION = "1.21.0"
API_VERSION = 21                        # ORT_API_VERSION in these headers: the runtime must be >= 1.21
PACKAGE, SUITE = "libonnxruntime-dev", "trixie"
SHA256 = {
    "onnxruntime_c_api.h": "7783e9664bdb0b1b36145b5c8587dd1bc9a399aa000edf2e3dd03003cafc6882",
    "onnxruntime_cxx_api.h": "b3b27d6a6fced0725e3f188379cca008b1d7a456997684756374d4b388f2cf05",
    "onnxruntime_cxx_inline.h": "7f448e994c732eacd9e49900365fefa8f1ac998a6d6eb78e5f4aab1b8d9d8900",
    "onnxruntime_float16.h": "6c4db3d1954b266c4febe413351af86cac922e3448538e7e452e51d646e56a4a",
    "onnxruntime_lite_custom_op.h": "967e36eb375e975a3b88e599129394317f790a987f266d522fbe3d02c5211fd3",
}
NAMES = tuple(SHA256)
# No PyPI package carries these headers (checked December 2026: onnxruntime, onnxruntime-genai,
# onnxruntime-extensions, ortpy and sherpa-onnx wheels; none has an sdist); ONNX Runtime's own release archives
# (onnxruntime-linux-x64-<v>.tgz, onnxruntime-osx-<arch>-<v>.tgz) hold them under include/, for any machine apt
# does not serve. An engine built with the kernels carries its library (carry.py): loading it needs none of this.
HOW = (f"install Debian's or Ubuntu's {PACKAGE} ({VERSION}, Debian suite {SUITE}), or unpack ONNX Runtime {VERSION}'s "
       f"release archive for this platform (onnxruntime-<os>-<arch>-{VERSION}.tgz) and point SPECEXPORT_ORT_INCLUDE "
       f"at its include/ folder ({', '.join(NAMES)}); or run an engine that carries its kernels (built where they "
       f"compile), which needs no headers")


def include(fetch: bool = True, env: str | None = None, cache: Path | None = None) -> Path:
    """A folder with the headers (see the module's docstring for the order); `cache`: the kernels' cache,
    where a fetched copy is kept (ort-<VERSION>/)."""
    candidates = [Path(env)] if env else [Path("/usr/include/onnxruntime"), Path(cache) / f"ort-{VERSION}"]
    for c in candidates:
        if all((c / h).is_file() for h in NAMES):
            return c
    if env:
        raise KernelsUnavailable(f"SPECEXPORT_ORT_INCLUDE={env} lacks {', '.join(NAMES)}")
    if not fetch:
        raise KernelsUnavailable(f"ONNX Runtime's C headers are not here and fetching them was not allowed: {HOW}")
    return _fetch(candidates[-1])


def digest(folder: Path) -> str:
    """One digest of the headers in `folder` (part of the library's cache key)."""
    h = hashlib.sha256()
    for name in NAMES:
        h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()


def _fetch(dest: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="specexport-ort-") as tmp:
        deb = _apt_download(Path(tmp))
        headers = _headers_of(deb.read_bytes())
    bad = [n for n in NAMES if hashlib.sha256(headers.get(n, b"")).hexdigest() != SHA256[n]]
    if bad:
        raise KernelsUnavailable(f"ONNX Runtime's C headers: {deb.name} does not hold {VERSION}'s {', '.join(bad)} "
                                 f"(sha256 pinned): {HOW}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ort-", dir=dest.parent))
    try:                                 # written beside dest, renamed whole: never a half-filled dest
        for name, data in headers.items():
            (tmp / name).write_bytes(data)
        tmp.rename(dest)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not all((dest / h).is_file() for h in NAMES):     # else another process got there first
            raise KernelsUnavailable(f"ONNX Runtime's C headers: writing {dest} failed ({err})") from err
    return dest


def _apt_download(tmp: Path) -> Path:
    """The package's .deb in tmp, through apt as the machine configures it, else through the machine's Debian
    mirror with the suite that has the package (a private list under tmp)."""
    if not shutil.which("apt-get"):
        raise KernelsUnavailable(f"ONNX Runtime's C headers are not here and there is no apt-get to fetch them: {HOW}")
    quick = ["-o", "Acquire::Retries=0", "-o", "Acquire::http::Timeout=15", "-o", "Acquire::https::Timeout=15"]
    if _run(["apt-get", *quick, "download", PACKAGE], tmp) is None:      # the machine's suites have it
        return _deb_in(tmp)
    mirror = _debian_mirror()
    if mirror is None:
        raise KernelsUnavailable(f"ONNX Runtime's C headers: apt has no {PACKAGE} here and no Debian mirror is "
                                 f"configured: {HOW}")
    parts, lists, cache = tmp / "sources.d", tmp / "lists", tmp / "cache"
    for d in (parts, lists / "partial", cache / "archives" / "partial"):
        d.mkdir(parents=True)
    (tmp / "none.list").write_text("")
    (parts / "debian.sources").write_text(f"Types: deb\nURIs: {mirror}\nSuites: {SUITE}\nComponents: main\n"
                                          "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    private = [*quick, "-o", f"Dir::Etc::SourceList={tmp / 'none.list'}", "-o", f"Dir::Etc::SourceParts={parts}",
               "-o", f"Dir::State::Lists={lists}", "-o", f"Dir::Cache={cache}", "-o", "Debug::NoLocking=1"]
    why = _run(["apt-get", *private, "update"], tmp) or _run(["apt-get", *private, "download", PACKAGE], tmp)
    if why is not None:
        raise KernelsUnavailable(f"ONNX Runtime's C headers: apt could not fetch {PACKAGE} from suite {SUITE} of the "
                                 f"configured Debian mirror ({why}): {HOW}")
    return _deb_in(tmp)


def _run(cmd: list[str], cwd: Path) -> str | None:
    """None when the command succeeded, else its last line of output."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {r.returncode}"


def _deb_in(folder: Path) -> Path:
    debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise KernelsUnavailable(f"ONNX Runtime's C headers: apt reported success but wrote no {PACKAGE} package: {HOW}")
    return debs[0]


def _debian_mirror(files: list[Path] | None = None) -> str | None:
    """The first Debian archive the machine's apt sources name (one-line or deb822 form), security archives aside."""
    if files is None:
        files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^\s*(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+)", text, re.M):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return None


def _headers_of(deb: bytes) -> dict[str, bytes]:
    """The API headers inside a .deb (an ar archive holding data.tar.xz)."""
    data = _ar_member(deb, "data.tar.xz")
    out = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            for m in tar.getmembers():
                if m.isfile() and Path(m.name).name in NAMES and "include/onnxruntime/" in m.name:
                    out[Path(m.name).name] = tar.extractfile(m).read()
    except (OSError, tarfile.TarError) as err:
        raise KernelsUnavailable(f"ONNX Runtime's C headers: the package does not unpack ({err})") from err
    return out


def _ar_member(blob: bytes, name: str) -> bytes:
    """One member of a Unix ar archive (a .deb): 8-byte magic, then 60-byte headers, 2-byte aligned."""
    if not blob.startswith(b"!<arch>\n"):
        raise KernelsUnavailable("ONNX Runtime's C headers: the package is not an ar archive")
    at = 8
    while at + 60 <= len(blob):
        head = blob[at:at + 60]
        member, size = head[:16].decode().strip().rstrip("/"), int(head[48:58].decode().strip())
        if member == name:
            return blob[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)
    raise KernelsUnavailable(f"ONNX Runtime's C headers: the package has no {name}")
