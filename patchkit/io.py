"""Patch files: an ordered list of patches in one safetensors file (never pickle).

Layout (format version 1):

- tensors ``"{i:06d}.values"`` for every patch ``i`` and ``"{i:06d}.indices"`` for every
  sparse one, stored with their own dtypes (values may have another dtype than the
  patch's checkpoint dtype; both are kept);
- in the safetensors ``__metadata__``, under the reserved key ``"patchkit"``, a JSON
  object ``{"format": "patchkit.patches", "version": 1, "patches": [...]}`` listing,
  in order, each patch's ``name``, ``shape``, checkpoint ``dtype`` (torch name, e.g.
  ``"bfloat16"``), ``kind`` (``"dense"``/``"sparse"``), ``nnz`` (values carried),
  ``values_dtype`` and ``indices_dtype`` (``null`` for dense);
- user metadata (``dict[str, str]``) under its own keys beside it.

Reading a file checks the header against the tensors before anything is loaded; a
missing, truncated, foreign or inconsistent file raises
:class:`~patchkit.errors.PatchValueError` (a ``ValueError``) naming the file and the
problem, never a raw safetensors or JSON exception. ``safetensors`` is imported inside
the functions that need it; where it cannot be imported they raise
:class:`ModuleNotFoundError` (an ``ImportError``) saying so.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

import torch

from .chunking import DEFAULT_MAX_CHUNK_BYTES, plan_chunks
from .errors import PatchError, PatchTypeError, PatchValueError, add_note, brief, where
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _checked_device,
    _is_integral,
    _may_not_fit,
    _numel_below,
    _shape_text,
    check_flag,
    check_max_chunk_bytes,
    patch_list,
    validate_patches,
)
from .units import _count, _percent_digits, distinct_name, format_bytes, shown_name

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "PatchFileEntry",
    "check_patch_file",
    "load_patches",
    "print_patch_file_summary",
    "read_patch_index",
    "read_patch_metadata",
    "save_patches",
    "storable_dtypes",
]

FORMAT_KEY = "patchkit"
"""The reserved ``__metadata__`` key holding patchkit's JSON header."""

FORMAT_NAME = "patchkit.patches"
FORMAT_VERSION = 1
"""The version this module writes; it reads this version only."""

# safetensors dtype code -> torch dtype name (only those this torch has are used).
_CODE_TO_NAME = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}
_CODE_TO_DTYPE: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in _CODE_TO_NAME.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_TO_CODE = {dtype: code for code, dtype in _CODE_TO_DTYPE.items()}


def storable_dtypes() -> frozenset[torch.dtype]:
    """The tensor dtypes a patch file can hold for ``values`` (and indices: int32/int64).

    The dtypes this torch, the safetensors format and the installed ``safetensors``
    package all know: float64/32/16, bfloat16, the float8 types, signed and unsigned
    integers, bool and complex64. Older ``safetensors`` releases read fewer (0.7.0 lacks
    float8_e4m3fnuz and float8_e5m2fnuz, 0.6.2 complex64 too, 0.5.3 float8_e8m0fnu too;
    0.8.0 reads them all): those this one cannot read are left out, as this machine
    could not read such a file back. Without the package, the dtypes this torch and the
    format share. A patch's checkpoint
    ``dtype`` may be any torch dtype its values can be staged as: it is stored by name
    (``complex128``, ``uint16`` with values of a storable dtype). Not the packed
    ``float4_e2m1fn_x2``: a patch of it stages only from values of that dtype, which no
    patch file holds, so :func:`save_patches` refuses every such patch.
    """
    return frozenset(d for d, code in _DTYPE_TO_CODE.items() if code in _readable_codes())


@functools.lru_cache(maxsize=1)
def _readable_codes() -> frozenset[str]:
    """The dtype codes the installed ``safetensors`` reads (each tried on a header of one
    empty tensor: a few microseconds, once), or all that patchkit maps when it is not
    installed."""
    try:
        import safetensors
    except ImportError:
        return frozenset(_DTYPE_TO_CODE.values())
    found = set()
    for code in _DTYPE_TO_CODE.values():
        text = json.dumps({"t": {"dtype": code, "shape": [0], "data_offsets": [0, 0]}})
        text += " " * (-len(text) % 8)
        try:
            safetensors.deserialize(len(text).to_bytes(8, "little") + text.encode())
        except Exception:
            continue
        found.add(code)
    return frozenset(found)


def _safetensors_version() -> str:
    try:
        import safetensors
    except ImportError:
        return "(none)"
    return getattr(safetensors, "__version__", "(unknown version)")


def _check_storable(t: torch.Tensor, i: int, name: str, what: str,
                    readable: frozenset[str]) -> None:
    """Refuse ``t`` (patch ``i``'s ``what``) when a patch file cannot hold its dtype, or the
    installed ``safetensors`` could not read it back."""
    code = _DTYPE_TO_CODE.get(t.dtype)
    if code is None:
        raise PatchTypeError(
            f"{where(i, name)}: {what} of dtype {t.dtype} cannot be stored in a patch file "
            f"(storable: {sorted(_dtype_name(d) for d in storable_dtypes())})",
            position=i, name=name, reason="unstorable dtype", value=t.dtype,
        )
    if code not in readable:
        raise PatchTypeError(
            f"{where(i, name)}: {what} of dtype {t.dtype} cannot be stored here: the "
            f"installed safetensors {_safetensors_version()} cannot read dtype code {code!r} "
            f"back (upgrade it: pip install 'safetensors>=0.8')",
            position=i, name=name, reason="unstorable dtype", value=t.dtype,
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: object) -> torch.dtype | None:
    if not isinstance(name, str) or not name or name.startswith("_"):
        return None
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _key(i: int, part: str) -> str:
    return f"{i:06d}.{part}"


_NEED_SAFETENSORS = "patch files need the safetensors package: pip install safetensors"


def _check_path(path: object, fn: str) -> None:
    """``TypeError`` naming ``fn``'s ``path`` argument unless it is a path (``str``,
    ``bytes`` or ``os.PathLike``), before anything is read or written."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{fn}: path must be a file's path (str, bytes or os.PathLike), got "
                        f"{type(path).__name__}: {brief(path, 60)}")


def _safetensors() -> Any:
    """``(safe_open, save_file, SafetensorError)``; a ModuleNotFoundError saying what to
    install if missing."""
    try:
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import save_file
    except ImportError as e:
        raise ModuleNotFoundError(_NEED_SAFETENSORS, name="safetensors") from e
    return safe_open, save_file, SafetensorError


_MAX_HEADER_BYTES = 100_000_000
"""The largest JSON header safetensors writes (and reads back): 100 MB."""


def _json_bytes(text: str) -> int:
    """Bytes of ``text`` as a JSON string in UTF-8 (escaped as safetensors' serde_json
    and Python's json escape it: quotes, backslashes, control characters)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """An upper bound of the bytes of the JSON header safetensors writes for ``tensors``
    and ``metadata`` (before its padding): exact but for the data offsets, each counted
    with as many digits as the total data size has."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    width = len(str(total))
    n = 2  # the braces
    members = len(tensors)
    if metadata:
        members += 1
        n += len('"__metadata__":{}') + max(len(metadata) - 1, 0)
        n += sum(_json_bytes(k) + 1 + _json_bytes(v) for k, v in metadata.items())
    n += max(members - 1, 0)  # the commas between members
    for key, t in tensors.items():
        # "key":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}
        n += _json_bytes(key) + len(':{"dtype":"","shape":[],"data_offsets":[,]}')
        n += len(_DTYPE_TO_CODE[t.dtype]) + 2 * width
        n += len(",".join(str(d) for d in t.shape))
    return n


# --------------------------------------------------------------------------- saving


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise PatchTypeError(
            f"metadata must be a dict[str, str], got {type(metadata).__name__}",
            reason="metadata type", value=type(metadata).__name__,
        )
    out: dict[str, str] = {}
    for k, v in metadata.items():
        if not isinstance(k, str):
            raise PatchTypeError(
                "metadata keys must be str (a safetensors header holds strings only), got "
                f"the key {brief(k, 80)}, of type {type(k).__name__}",
                reason="metadata type", value=k,
            )
        if not isinstance(v, str):
            raise PatchTypeError(
                "metadata values must be str (a safetensors header holds strings only): "
                f"{brief(k, 80)} maps to {brief(v, 80)}, of type {type(v).__name__}; pass "
                "str(value), or json.dumps(value) for a structure",
                reason="metadata type", value=v,
            )
        if k == FORMAT_KEY:
            raise PatchValueError(
                f"metadata key {FORMAT_KEY!r} is reserved for patchkit's own header",
                reason="reserved metadata key", value=k,
            )
        for text in (k, v):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # (a lone surrogate: the header is UTF-8)
                raise PatchValueError(
                    f"metadata {'key' if text is k else 'value'} {brief(text, 80)} "
                    f"holds {text[e.start]!r} at index {e.start}, a lone surrogate, which "
                    "the file's UTF-8 header cannot hold", reason="metadata not UTF-8",
                    value=text,
                ) from None
        out[k] = v
    return out


def save_patches(
    path: str | os.PathLike[str],
    patches: Iterable[PatchLike],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``patches`` (an ordered list, dense and sparse mixed, names may repeat) to
    one safetensors file at ``path``.

    Each patch is validated first (:func:`~patchkit.patch.validate_patches`, one patch
    at a time: dense and sparse may share a file, but a sparse patch with a NaN value,
    an out-of-range or a duplicate index is refused). ``metadata`` is a ``dict[str, str]``
    (other key or value types: :class:`~patchkit.errors.PatchTypeError`; the key
    ``"patchkit"`` is reserved, and a lone surrogate cannot be written in UTF-8:
    :class:`~patchkit.errors.PatchValueError`). Values whose
    dtype is not in :func:`storable_dtypes` raise :class:`~patchkit.errors.PatchTypeError`;
    values or indices on the ``meta`` device (no data) a
    :class:`~patchkit.errors.PatchValueError` (``reason`` ``"meta device"``), each naming
    the patch, before anything is written.

    Tensors are copied to the CPU (and made contiguous, unshared where two patches
    share memory, and with torch's lazy conjugate and negative views resolved, so the
    file holds the values the caller sees) as needed; the caller's tensors are never
    modified. The file is written to a temporary name beside ``path``, flushed to the
    disk (``os.fsync``) and renamed into place, then the folder is flushed where the
    system allows (POSIX): a failed save leaves no partial file (an existing file at
    ``path`` stays as it was, and the temporary is removed), and a crash or power loss
    during or after the save leaves at ``path`` either the old file or the whole new
    one, never an empty or partial file.
    :func:`load_patches` returns equal patches, bit for bit, in the same order.

    Permissions are those ``open(path, "w")`` gives: a new file gets ``0o666`` less the
    umask (``0o644`` under umask ``022``; a umask that leaves the owner no write bit,
    ``0o222``, gives a read-only file, as ``open`` does); overwriting an existing file
    keeps its permission bits. Unlike ``open(path, "w")``, which writes into the old
    file, a save puts a new file in its place: it belongs to the saving user and group
    (not the old file's), hard links to the old file keep the old contents, and a
    read-only file is replaced where its folder can be written. A save that is killed
    outright (``SIGKILL``; ``SIGTERM`` where no handler turns it into an exception)
    leaves its temporary, ``.patchkit-<12 hex digits>.tmp`` beside ``path``, behind
    (``path`` itself is the old file, or the new one): safe to delete.

    A symbolic link at ``path`` is followed, as ``open(path, "w")`` follows it: the file
    it points to (through any chain of links) is replaced, or created where it does not
    exist yet, and the link stays as it was; a loop of links raises an ``OSError``
    (``errno.ELOOP``).

    A destination that cannot be written raises an ``OSError`` naming ``path`` (its
    ``filename``) and the problem, never the temporary file, before any tensor is
    copied: :class:`FileNotFoundError` when its folder does not exist,
    :class:`NotADirectoryError` when a part of that folder's path is a file,
    :class:`IsADirectoryError` when ``path`` is a folder, :class:`FileExistsError` when
    it is something else that is not a regular file (a FIFO, a socket, a device, which
    is neither opened nor replaced by a file), and e.g. :class:`PermissionError` when
    the folder cannot be written; a path holding a NUL character (which no file's path
    can), or one this system cannot encode as a file name (a lone surrogate), raises a
    :class:`~patchkit.errors.PatchValueError` naming it (``reason`` ``"bad path"``), a
    ``ValueError`` as ``open`` raises. A failure while writing
    (a full disk, an I/O error) raises an ``OSError`` naming ``path``, with the
    system's ``errno`` where safetensors reports one (``errno.ENOSPC`` for a full disk),
    else ``errno.EIO``.

    safetensors limits a file's JSON header to 100,000,000 bytes (it holds each
    tensor's name, dtype, shape and offsets, patchkit's list of the patches and the user
    metadata: about 200 bytes plus the name's length per dense patch, 290 plus the name
    per sparse one, so some 80,000 patches with 1000-character names; a name's
    characters cost a byte each in ASCII, about 7 otherwise, as the header escapes them
    twice). A list whose
    header would pass that is refused before anything is written, with a
    :class:`~patchkit.errors.PatchValueError` (``reason`` ``"header too large"``,
    ``value`` the header's size in bytes) saying how many patches, how long their names
    and how much metadata it holds. The size is counted exactly but for the data
    offsets, each counted as wide as the largest, so a list within a few bytes per
    tensor of the limit may be refused too.

    Without the ``safetensors`` package: :class:`ModuleNotFoundError`.
    """
    _check_path(path, "save_patches")
    _, save_file, safetensor_error = _safetensors()

    user = _check_metadata(metadata)
    path = os.fsdecode(path)  # (bytes too, as the readers take them)
    dest = _destination(path)  # a symbolic link's target: the link stays
    _check_destination(dest, path)
    patches = [
        CheckpointWeightPatch(*p)
        if isinstance(p, tuple) and not isinstance(p, CheckpointWeightPatch) and len(p) == 5
        else p
        for p in patch_list(patches)
    ]
    readable = _readable_codes()
    tensors: dict[str, torch.Tensor] = {}  # the caller's, until copied below
    entries: list[dict[str, Any]] = []
    for i, p in enumerate(patches):
        _refuse_meta(p, i)  # first: validate_patches cannot read meta indices either
        validate_patches([p], positions=[i])
        sparse = p.indices is not None
        for part, t in (("values", p.values), ("indices", p.indices)):
            if t is not None:
                _check_storable(t, i, p.name, part, readable)
                tensors[_key(i, part)] = t
        entries.append(
            {
                "name": p.name,
                "shape": [int(d) for d in p.shape],
                "dtype": _dtype_name(p.dtype),
                "kind": "sparse" if sparse else "dense",
                "nnz": int(p.values.numel()),
                "values_dtype": _dtype_name(p.values.dtype),
                "indices_dtype": _dtype_name(p.indices.dtype) if sparse else None,
            }
        )
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "patches": entries}
    meta = {FORMAT_KEY: json.dumps(header, separators=(",", ":")), **user}
    size = _header_bytes(tensors, meta)  # (dtypes and shapes only: no copy needed)
    if size > _MAX_HEADER_BYTES:
        raise _header_too_large(path, patches, len(tensors), user, f"would take {size} bytes "
                                f"({format_bytes(size)})", size)

    # The temporary before any copy: a folder that cannot be written is said before any
    # tensor is copied (patches on a GPU would otherwise all come to host memory first).
    tmp, new_mode = _create_temporary(dest, path)
    try:
        seen_storage: set[tuple[torch.device, int]] = set()

        def prepare(t: torch.Tensor) -> torch.Tensor:
            # resolve torch's lazy conjugate / negative bits: safetensors copies the raw
            # memory, which holds the values before conjugation or negation
            t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            if t.numel():
                key = (t.device, t.untyped_storage().data_ptr())
                if key in seen_storage:
                    t = t.clone()
                else:
                    seen_storage.add(key)
            return t

        tensors = {k: prepare(t) for k, t in tensors.items()}
        try:  # overwriting: keep the file's permission bits
            mode = stat.S_IMODE(os.stat(dest).st_mode) & 0o777
        except OSError:  # a new file: those open() gives (0o666 less the umask), read off
            mode = new_mode  # the fresh temporary, with no race
        if sys.byteorder == "little":
            try:
                _write_safetensors(tmp, tensors, meta)
            except OSError as e:
                raise _save_error(e, path, "writing the file failed") from None
        else:  # (safetensors' own writer, which swaps the bytes into its little-endian form)
            try:
                save_file(tensors, tmp, metadata=meta)
            except safetensor_error as e:
                raise _write_error(e, path, patches, len(tensors), user) from None
        _synced(tmp, path, mode)
        try:
            os.replace(tmp, dest)
        except OSError as e:
            raise _save_error(e, path, "cannot put the written file in place") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(os.path.dirname(os.path.abspath(dest)))  # the rename itself


def _write_safetensors(filename: str, tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (contiguous, on the CPU, each its own memory) and ``metadata`` to
    ``filename`` in the safetensors format, as ``safetensors.torch.save_file`` does, on a
    little-endian machine: 8 bytes of header length, the JSON header (each tensor's dtype
    code, shape and byte range in the data; ``__metadata__``), padded with spaces to a
    multiple of 8 bytes, then the tensors' bytes, each written from its own memory and
    starting at a multiple of its element size (8-byte elements first, as ``save_file``
    orders them).

    Not through ``save_file``: that hands each tensor to C through a numpy array made by
    ``np.ctypeslib.as_array``, which creates (and ctypes keeps for good) two ctypes types
    for every byte size it meets. Sparse patches change size every step, so a trainer
    that saved one file a step leaked about 11 KiB per tensor per step."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    # The data in order of falling element size (stable: patch order within a size), so
    # that each tensor starts at a multiple of its element size (the data begins at a
    # multiple of 8 and the format allows no gaps): a reader that maps the file hands out
    # aligned tensors. The header lists them in patch order with their offsets.
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    spans: dict[str, list[int]] = {}
    start = 0
    for key in order:
        n = tensors[key].numel() * tensors[key].element_size()
        spans[key] = [start, start + n]
        start += n
    for key, t in tensors.items():
        header[key] = {"dtype": _DTYPE_TO_CODE[t.dtype], "shape": list(t.shape),
                       "data_offsets": spans[key]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(filename, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for key in order:
            t = tensors[key]
            if t.numel():
                fh.write(t.reshape(-1).view(torch.uint8).numpy())  # (a view: no copy)


def _synced(tmp: str, path: str, mode: int) -> None:
    """Give the temporary ``tmp`` its final ``mode`` and flush it to the disk before it
    replaces ``path`` (a crash then leaves one file or the other, never an empty one).
    Both through one descriptor opened before the mode changes, so a mode without read
    or write bits (``0o000``, ``0o200``, ``0o444``) is no obstacle. Errors name
    ``path``."""
    fd = None
    problem = "cannot flush the written file to disk"
    try:
        fd = os.open(tmp, os.O_RDWR | getattr(os, "O_BINARY", 0))
        if hasattr(os, "fchmod"):
            problem = f"cannot give the written file the mode {mode:#o}"
            os.fchmod(fd, mode)
            problem = "cannot flush the written file to disk"
        os.fsync(fd)  # the data, and the mode with them
        os.close(fd)
        fd = None
        if not hasattr(os, "fchmod"):  # (Windows: after the flush, it may turn read-only)
            problem = f"cannot give the written file the mode {mode:#o}"
            os.chmod(tmp, mode)
    except OSError as e:
        raise _save_error(e, path, problem) from None
    finally:
        if fd is not None:
            os.close(fd)


def _fsync_folder(folder: str) -> None:
    """Flush ``folder``'s entries (a rename in it) to the disk, where the system allows:
    nothing where folders cannot be opened (Windows) or synced (some file systems)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refuse_meta(p: object, i: int) -> None:
    """Refuse a patch whose values or indices are on the meta device (no data)."""
    for what in ("values", "indices"):
        t = getattr(p, what, None)
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            name = getattr(p, "name", None)
            raise PatchValueError(
                f"{where(i, name)}: {what} are on the meta device, which holds no data to "
                "save",
                position=i, name=name, reason="meta device", value=t.device,
            )


def _header_too_large(
    path: str,
    patches: list[CheckpointWeightPatch],
    n_tensors: int,
    user: Mapping[str, str],
    problem: str,
    size: int | None,
) -> PatchValueError:
    """The error for a file whose safetensors header would pass the format's limit."""
    n = len(patches)
    longest = max((len(p.name) for p in patches), default=0)
    user_bytes = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode(
        "utf-8", "surrogatepass")) for k, v in user.items())
    return PatchValueError(
        f"cannot save patches to {_path_text(path)}: the file's header {problem}, more than the "
        f"{_MAX_HEADER_BYTES} bytes safetensors allows; it describes {n} "
        f"patch{'' if n == 1 else 'es'} ({n_tensors} tensor{'' if n_tensors == 1 else 's'}) "
        f"with names of up to {longest} characters, and {user_bytes} bytes of user "
        "metadata: save fewer patches per file (or shorter names, less metadata)",
        reason="header too large", value=size,
    )


def _write_error(
    e: Exception,
    path: str,
    patches: list[CheckpointWeightPatch],
    n_tensors: int,
    user: Mapping[str, str],
) -> Exception:
    """A safetensors write failure as patchkit's error: an ``OSError`` naming ``path``
    (with safetensors' errno where it gives one), or for a header too large the
    PatchValueError saying so. Never names safetensors' temporary file."""
    text = str(e)
    if "header too large" in text.lower():
        return _header_too_large(path, patches, n_tensors, user,
                                 "is too large (safetensors refused it)", None)
    found = re.search(r"\(os error (\d+)\)", text)
    if found:
        code = int(found.group(1))
        return OSError(code, f"cannot save patches: writing the file failed "
                             f"({os.strerror(code)})", path)
    text = re.sub(r' at path ".*"', "", text)  # safetensors' temporary, not the path
    return OSError(errno.EIO, f"cannot save patches: writing the file failed ({text})", path)


def _save_error(e: OSError, path: str, problem: str) -> OSError:
    """``e`` again (same type and errno), its message naming ``path``, not a temporary."""
    return type(e)(e.errno, f"cannot save patches: {problem} ({e.strerror})", path)


def _destination(path: str) -> str:
    """The file a save at ``path`` writes: ``path``, or the file a symbolic link at
    ``path`` points to (through any chain of links; it may not exist yet)."""
    if not os.path.islink(path):
        return path
    dest = os.path.realpath(path)
    if os.path.islink(dest):  # realpath stops on a loop
        raise OSError(
            errno.ELOOP, "cannot save patches: the symbolic link does not lead to a file "
            "(a loop of links)", path,
        )
    return dest


_NOT_REGULAR = [
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
]


_NUL_IN_PATH = "the path holds a NUL character, which no file's path can hold"
# (a lone surrogate, which os.fsencode refuses)
_NOT_A_FILE_NAME = "the path cannot be written as a file name"


def _bad_path(what: str, path: str, problem: str) -> PatchValueError:
    """The error for a path no file can have (``reason`` ``"bad path"``), as saving and
    reading say it: ``what`` (``"cannot save patches to"``, ``"patch file"``), the path cut
    at 200 characters of repr as an offending value is (it names no file, and may be any
    text; ``.value`` keeps it whole), and the problem."""
    return PatchValueError(f"{what} {brief(path, 200)}: {problem}", reason="bad path",
                           value=path)


def _check_destination(dest: str, path: str) -> None:
    """Refuse a ``dest`` no file can be saved at, naming ``path`` (what the caller
    passed; ``dest`` is its link's target, or ``path`` itself) and the problem."""
    if not dest:
        raise FileNotFoundError(errno.ENOENT, "cannot save patches: the path is empty", path)
    if "\0" in dest:
        raise _bad_path("cannot save patches to", path, _NUL_IN_PATH)
    try:
        os.fsencode(dest)
    except UnicodeEncodeError as e:  # (a lone surrogate: os.stat would raise it bare)
        raise _bad_path("cannot save patches to", path, f"{_NOT_A_FILE_NAME} ({e})") from None
    if dest.endswith(("/", os.sep)) and not os.path.isdir(dest):
        raise NotADirectoryError(
            errno.ENOTDIR, "cannot save patches: the path ends with a folder separator, "
            "so it names a folder, not a file", path,
        )
    if os.path.isdir(dest):
        raise IsADirectoryError(
            errno.EISDIR, "cannot save patches: the path is a folder, not a file", path
        )
    try:
        mode = os.stat(dest).st_mode
    except OSError:
        mode = None  # nothing there yet
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((k for test, k in _NOT_REGULAR if test(mode)), "something")
        raise FileExistsError(
            errno.EEXIST, f"cannot save patches: the path is {kind}, not a regular file "
            "(refusing to replace it with one)", path,
        )
    folder = os.path.dirname(os.path.abspath(dest))
    if os.path.isdir(folder):
        _check_name_length(dest, folder, path)
        return
    first = folder  # the deepest part of the folder's path that exists
    while not os.path.lexists(first) and os.path.dirname(first) != first:
        first = os.path.dirname(first)
    if os.path.isdir(first):
        raise FileNotFoundError(
            errno.ENOENT, f"cannot save patches: the folder {folder!r} does not exist", path
        )
    raise NotADirectoryError(
        errno.ENOTDIR, f"cannot save patches: {first!r} is not a folder", path
    )


def _check_name_length(dest: str, folder: str, path: str) -> None:
    """Refuse a file name longer than ``folder``'s file system takes (found otherwise
    only when the written file is renamed into place, after all of it was written)."""
    try:
        most = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # (no pathconf: Windows; no such limit)
        return
    length = len(os.fsencode(os.path.basename(dest)))
    if most > 0 and length > most:
        raise OSError(
            errno.ENAMETOOLONG, f"cannot save patches: the file name is {length} bytes "
            f"long, and the folder's file system takes at most {most}", path,
        )


def _create_temporary(dest: str, path: str) -> tuple[str, int]:
    """Create an empty file with a fresh name beside ``dest``; return its name and the
    mode a new file of ``open(path, "w")`` gets. Errors name ``path``.

    Created by ``os.open(..., 0o666)``, so the system applies the umask (reading the
    mode so has no race, unlike ``os.umask``). Where that mode leaves the owner unable
    to read or write it (umask ``0o222``, ``0o277``), the temporary is made readable and
    writable by its owner until :func:`_synced` gives it that mode: the save writes it
    by name.
    """
    folder = os.path.dirname(os.path.abspath(dest))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f".patchkit-{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise _save_error(
                e, path, f"cannot create a temporary file in {folder!r}"
            ) from None
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o600 != 0o600 and hasattr(os, "fchmod"):
                os.fchmod(fd, mode | 0o600)
        except OSError as e:
            os.close(fd)
            os.unlink(tmp)
            raise _save_error(e, path, f"cannot set up a temporary file in {folder!r}") from None
        os.close(fd)
        return tmp, mode
    raise FileExistsError(
        errno.EEXIST, f"cannot save patches: no free temporary name in {folder!r}", path
    )


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class PatchFileEntry:
    """One patch of a patch file, as its header describes it (no tensor data read).

    ``nnz`` is the number of values carried (``numel`` for a dense patch);
    ``wire_bytes`` the bytes of its values plus indices.
    """

    position: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sparse: bool
    nnz: int
    values_dtype: torch.dtype
    indices_dtype: torch.dtype | None

    @property
    def kind(self) -> str:
        """``"sparse"`` or ``"dense"``."""
        return "sparse" if self.sparse else "dense"

    @property
    def numel(self) -> int:
        """Elements of the full checkpoint tensor."""
        return math.prod(self.shape)

    @property
    def density(self) -> float | None:
        """``nnz / numel``; ``None`` for a tensor with no elements."""
        n = self.numel
        return self.nnz / n if n else None

    @property
    def wire_bytes(self) -> int:
        """Bytes of values plus indices, as :func:`patchkit.build.wire_bytes` counts them."""
        b = self.nnz * self.values_dtype.itemsize
        if self.indices_dtype is not None:
            b += self.nnz * self.indices_dtype.itemsize
        return b


class _Bad(Exception):
    """Internal: a problem with the file, turned into a PatchValueError naming it."""


_THE_PATH = object()  # _fail's default value: the file's path


# The longest path Linux opens (PATH_MAX): a message shows a path up to this whole, and
# cuts only one no system could open (a megabyte of text passed as a path, say).
_PATH_SHOWN = 4096


def _path_text(path: str) -> str:
    """``path`` as a message shows it: its ``repr``, whole for any path a system can
    open, cut past :data:`_PATH_SHOWN` characters (``.value`` on the error keeps it)."""
    return brief(path, _PATH_SHOWN + 2)  # (+ the repr's quotes)


def _fail(
    path: str,
    problem: str,
    reason: str = "bad patch file",
    *,
    position: int | None = None,
    name: str | None = None,
    value: object = _THE_PATH,
) -> PatchValueError:
    """The error for a bad file: its message names the file; ``position`` and ``name``
    the patch the problem is in (``None`` for the whole file); ``value`` the offending
    value (by default the path, for a problem of the file as a whole)."""
    return PatchValueError(
        f"patch file {_path_text(path)}: {problem}", position=position, name=name, reason=reason,
        value=path if value is _THE_PATH else value,
    )


_PINNED: dict[str, Any] = {}  # a path -> the binary file _pinned opened at it


@contextlib.contextmanager
def _pinned(path: str) -> Iterator[None]:
    """Within the block, this module's reads of ``path`` (``read_patch_index``,
    ``print_patch_file_summary``, ``load_patches``: each opens it anew) all read the one
    file that was at ``path`` when the block began, whatever replaces or renames it
    meanwhile (a trainer writing the next step over it): ``python -m patchkit inspect
    FILE --out`` reads it several times. Linux only (``/proc/self/fd``); elsewhere, and
    where the file cannot be opened (the first read then says why), nothing changes."""
    path = os.fsdecode(path)
    fh = None
    if os.path.isdir("/proc/self/fd") and path not in _PINNED:
        with contextlib.suppress(OSError):
            if os.path.isfile(path):
                fh = open(path, "rb")  # noqa: SIM115 (closed below)
    if fh is not None:
        _PINNED[path] = fh
    try:
        yield
    finally:
        if fh is not None:
            del _PINNED[path]
            fh.close()


def _open(path: str, device: str = "cpu", *, keep: bool = False) -> Any:
    """``safe_open`` with every failure turned into a PatchValueError naming the file;
    with ``keep``, ``(that, a binary file object of the same open file)``, to read
    tensor data from with plain reads (see :func:`_read_tensor`).

    ``device`` must have been checked (:func:`_checked_device`): a failure here is the
    file's.
    """
    safe_open, _, _ = _safetensors()
    path = os.fsdecode(path)  # (a bytes path: its bytes that are not UTF-8 as surrogates)
    held = _PINNED.get(path)
    if held is not None:  # (the file that was at path when _pinned began: see there)
        fh = open(f"/proc/self/fd/{held.fileno()}", "rb")  # noqa: SIM115 (as below)
    else:
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            # Only a path that names nothing is a missing file: one in a folder this
            # process may not enter, or too long a name, says what the system said.
            if e.errno == errno.ENOENT:
                raise _fail(path, "no such file", "missing") from None
            raise _fail(path, f"cannot be opened: {e.strerror or e}", "unreadable") from None
        except ValueError as e:
            if "\0" in path:  # (as save_patches says it)
                raise _bad_path("patch file", path, _NUL_IN_PATH) from None
            # (a lone surrogate no file name can encode, UnicodeEncodeError)
            raise _bad_path("patch file", path, f"{_NOT_A_FILE_NAME} ({e})") from None
        if not stat.S_ISREG(mode):
            raise _fail(path, "not a regular file", "not a file")
        try:
            fh = open(path, "rb")  # noqa: SIM115 (closed below, or by the caller)
        except OSError as e:  # (permission denied, say: not a missing or corrupt file)
            raise _fail(path, f"cannot be opened: {e.strerror or e}", "unreadable") from None
    try:
        if os.path.isdir("/proc/self/fd"):
            # The open file's /proc link: the header safetensors reads and the data read
            # here are one file's, whatever renames the path meanwhile (and safetensors
            # opens files by UTF-8 paths only: a Latin-1 name is fine this way).
            f = _safe_open(safe_open, f"/proc/self/fd/{fh.fileno()}", device, path)
        else:
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:
                raise _fail(path, "its path is not valid UTF-8, and safetensors opens files "
                            "by UTF-8 paths only: rename the file", "path not UTF-8") from None
            f = _safe_open(safe_open, path, device, path)
    except BaseException:
        fh.close()
        raise
    if keep:
        return f, fh
    fh.close()
    return f


def _data_layout(fh: Any) -> tuple[int, dict[str, tuple[str, list[int], int, int]]]:
    """Where a safetensors file's tensors lie (the header safetensors checked already):
    ``(start of the data, {key: (dtype code, shape, begin, end)})``, offsets from that
    start."""
    fh.seek(0)
    n = int.from_bytes(fh.read(8), "little")
    header = json.loads(fh.read(n))
    return 8 + n, {k: (v["dtype"], v["shape"], *v["data_offsets"])
                   for k, v in header.items() if k != "__metadata__"}


def _read_tensor(path: str, fh: Any, start: int, layout: tuple, device: str) -> torch.Tensor:
    """One tensor of the file, read with plain reads into memory of its own (a memory
    map of a file that another writer truncates meanwhile kills the process with SIGBUS;
    a read comes back short, which is said by name)."""
    code, shape, begin, end = layout
    buf = torch.empty(end - begin, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    fh.seek(start + begin)
    got = 0
    while got < len(view):
        k = fh.readinto(view[got:])
        if not k:
            raise _fail(path, f"the file ended {end - begin - got} bytes before the data its "
                        "header describes: it was cut short, or rewritten while it was read",
                        "truncated")
        got += k
    t = buf.view(_CODE_TO_DTYPE[code]).reshape(shape)
    return t if device == "cpu" else t.to(device)


def _safe_open(safe_open: Any, at: str, device: str, path: str) -> Any:
    """``safe_open`` of the file at ``at`` (``path``, or a link to it), its failure a
    PatchValueError naming ``path``."""
    try:
        return safe_open(at, framework="pt", device=device)
    except Exception as e:
        said = str(e).replace(at, path) if at != path else str(e)
        code = _system_errno(said)
        if code is not None:
            # The system refused (no memory to map the file, an I/O error): no fault of
            # the file's, so an OSError naming it, as open() would raise
            raise OSError(code, f"cannot read the patch file: {said}", path) from None
        unread = _codes_not_read_here(at)
        if unread:
            raise _fail(
                path,
                f"it holds tensors of dtype code {', '.join(map(repr, unread))}, which the "
                f"installed safetensors {_safetensors_version()} cannot read (upgrade it: pip "
                "install 'safetensors>=0.8')",
                "unreadable dtype", value=unread[0],
            ) from None
        raise _fail(
            path,
            f"not a readable safetensors file (truncated, corrupt or another format): "
            f"{said if len(said) <= 300 else said[:300] + '...'}{_zip_hint(at)}",
            "not safetensors",
        ) from None


# the system errors a safetensors message may end with: "... (os error 5)", "... (12)"
_ERRNO_AT_END = re.compile(r"\((?:os error )?(\d+)\)\s*$")
# the ones that say the system, not the file, is at fault
_SYSTEM_ERRNOS = frozenset(
    getattr(errno, n) for n in ("ENOMEM", "EIO", "EACCES", "EPERM", "ENFILE", "EMFILE",
                                "EAGAIN", "EINTR", "ENODEV", "EOVERFLOW", "ETXTBSY")
    if hasattr(errno, n))


def _system_errno(message: str) -> int | None:
    """The ``errno`` a safetensors error message ends with, where it is one that says the
    system refused (memory, I/O, permissions), else ``None``."""
    m = _ERRNO_AT_END.search(message)
    code = int(m.group(1)) if m else None
    return code if code in _SYSTEM_ERRNOS else None


def _zip_hint(at: str) -> str:
    """A word on what the file is where it is a zip archive (``torch.save`` writes one)."""
    with contextlib.suppress(OSError), open(at, "rb") as fh:
        if fh.read(4) == b"PK\x03\x04":
            return ("; it is a zip archive, as torch.save writes (patch files are "
                    "written by patchkit.save_patches)")
    return ""


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is running out of memory (host or device): no fault of a file's, so
    it propagates as torch or Python raised it."""
    if isinstance(e, MemoryError | torch.cuda.OutOfMemoryError):  # (torch.OutOfMemoryError)
        return True
    text = str(e) if isinstance(e, RuntimeError) else ""
    # (torch's CPU allocator: "can't allocate memory" on POSIX, "not enough memory" on
    # Windows; an accelerator's: "CUDA out of memory" and the like)
    return ("can't allocate memory" in text or "not enough memory" in text
            or "out of memory" in text.lower())


def _reading_failed(path: str, e: Exception) -> NoReturn:
    """Raise for ``e``, raised while reading patch file ``path``: running out of memory
    as itself, with a note naming the file; anything else as the file's fault, a
    PatchValueError naming it."""
    if _out_of_memory(e):
        add_note(e, f"(raised reading patch file {_path_text(path)})")
        raise e
    raise _fail(path, f"unreadable: {e}") from None


def _codes_not_read_here(at: str) -> list[str]:
    """The dtype codes in the safetensors header of the file at ``at`` that patchkit knows
    but the installed ``safetensors`` cannot read (empty where the header cannot be read
    or holds none: the file's problem is another)."""
    try:
        with open(at, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= _MAX_HEADER_BYTES:
                return []
            header = json.loads(fh.read(n))
        codes = {v.get("dtype") for k, v in header.items()
                 if k != "__metadata__" and isinstance(v, dict)}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return []  # (RecursionError: JSON nested deeper than Python's parser goes)
    readable = _readable_codes()
    return sorted(c for c in codes if c in _CODE_TO_DTYPE and c not in readable)


def _user_metadata(raw: Mapping[str, str] | None) -> dict[str, str]:
    """The user's keys, sorted (safetensors hands them over in an order of its hash map,
    another in each process: ``patchkit inspect`` printed them so)."""
    return {k: v for k, v in sorted((raw or {}).items()) if k != FORMAT_KEY}


def _parse_index(path: str, f: Any) -> list[PatchFileEntry]:
    """Check a patchkit header against the file's tensors; return its entries."""
    raw = f.metadata() or {}
    text = raw.get(FORMAT_KEY)
    if text is None:
        raise _fail(
            path,
            f"not a patchkit patch file (a safetensors file without the {FORMAT_KEY!r} "
            "header entry)",
            "foreign",
        )
    try:
        header = json.loads(text)
    except ValueError as e:
        raise _fail(path, f"the {FORMAT_KEY!r} header is not valid JSON ({e})", "header") from None
    except RecursionError:
        raise _fail(path, f"the {FORMAT_KEY!r} header is JSON nested too deep to read "
                    "(no patch list nests)", "header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise _fail(path, f"the {FORMAT_KEY!r} header is not a patchkit patch list", "header")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
        # (JSON's true and 1.0 equal 1 in Python: the version is the int 1, nothing else)
        raise _fail(
            path,
            f"format version {brief(version, 200)} is not supported (this patchkit reads version "
            f"{FORMAT_VERSION})",
            "version", value=version,
        )
    items = header.get("patches")
    if not isinstance(items, list):
        raise _fail(path, "the header's 'patches' is not a list", "header")

    keys = set(f.keys())
    expected: set[str] = set()
    entries: list[PatchFileEntry] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _fail(path, f"patch {i}: header entry is not an object", "header",
                        position=i, value=item)
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(path, f"patch {i}: name must be a non-empty string, got "
                        f"{brief(name, 200)}", "header", position=i, value=name)
        at = where(i, name)

        def bad(problem: str, reason: str, value: object, i: int = i, name: str = name,
                at: str = at) -> PatchValueError:
            return _fail(path, f"{at}: {problem}", reason, position=i, name=name, value=value)

        shape = item.get("shape")
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise bad(f"shape must be a list of non-negative ints, got {brief(shape, 200)}",
                      "header", shape)
        dtype = _dtype_from_name(item.get("dtype"))
        if dtype is None:
            raise bad(f"unknown dtype {brief(item.get('dtype'), 200)}", "dtype", item.get("dtype"))
        kind = item.get("kind")
        if kind not in ("dense", "sparse"):
            raise bad(f"kind must be 'dense' or 'sparse', got {brief(kind, 200)}", "header", kind)
        sparse = kind == "sparse"
        nnz = item.get("nnz")
        if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
            raise bad(f"nnz must be a non-negative int, got {brief(nnz, 200)}", "header", nnz)

        vkey = _key(i, "values")
        expected.add(vkey)
        if vkey not in keys:
            raise bad(f"tensor {vkey!r} is missing", "missing key", vkey)
        values_dtype = _tensor_dtype(path, f, vkey, i, name)
        if _dtype_name(values_dtype) != item.get("values_dtype"):
            raise bad(
                f"values are {_dtype_name(values_dtype)} but the header says "
                f"{brief(item.get('values_dtype'), 200)}",
                "dtype", values_dtype,
            )
        vshape = list(f.get_slice(vkey).get_shape())
        if len(vshape) != 1 or vshape[0] != nnz:
            raise bad(f"values have shape {vshape}, the header says [{nnz}]", "count", vshape)
        n = _numel_below(shape, 1 << 63)
        if n is None or n * dtype.itemsize >= 1 << 63:  # as validate_patches refuses it
            held = ("a dimension of 2**63 or more" if any(d >= 1 << 63 for d in shape)
                    else "at least 2**63 elements" if n is None else f"{n} elements")
            raise bad(f"shape {_shape_text(shape)} of {dtype} holds {held}, "
                      "more than a tensor can (its bytes must stay below 2**63)", "header",
                      shape)
        indices_dtype = None
        if sparse:
            if not dtype.is_floating_point:
                raise bad(f"a sparse patch with non-floating dtype {dtype}", "dtype", dtype)
            ikey = _key(i, "indices")
            expected.add(ikey)
            if ikey not in keys:
                raise bad(f"tensor {ikey!r} is missing", "missing key", ikey)
            indices_dtype = _tensor_dtype(path, f, ikey, i, name)
            if indices_dtype not in (torch.int32, torch.int64) or _dtype_name(
                indices_dtype
            ) != item.get("indices_dtype"):
                raise bad(
                    f"indices are {_dtype_name(indices_dtype)}, the header says "
                    f"{brief(item.get('indices_dtype'), 200)} (int32 or int64 expected)",
                    "dtype", indices_dtype,
                )
            ishape = list(f.get_slice(ikey).get_shape())
            if len(ishape) != 1 or ishape[0] != nnz:
                raise bad(f"{ishape} indices for {nnz} values", "count", ishape)
        elif nnz != n:
            raise bad(f"a dense patch of shape {_shape_text(shape)} needs {n} values, "
                      f"the file holds {nnz}", "count", nnz)
        elif item.get("indices_dtype") is not None:
            raise bad(f"a dense patch has no indices, but the header gives them dtype "
                      f"{brief(item.get('indices_dtype'), 200)}", "dtype",
                      item.get("indices_dtype"))
        entries.append(PatchFileEntry(i, name, tuple(shape), dtype, sparse, nnz,
                                      values_dtype, indices_dtype))
    extra = sorted(keys - expected)
    if extra:
        raise _fail(path, f"tensors not described by the header: {extra[:5]}"
                    f"{' ...' if len(extra) > 5 else ''}", "extra key", value=extra[0])
    return entries


def _tensor_dtype(path: str, f: Any, key: str, position: int, name: str) -> torch.dtype:
    code = f.get_slice(key).get_dtype()
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise _fail(path, f"{where(position, name)}: tensor {key!r} has unknown dtype {code!r}",
                    "dtype", position=position, name=name, value=code)
    return dtype


def read_patch_index(path: str | os.PathLike[str]) -> list[PatchFileEntry]:
    """Describe every patch of a patch file from its header, without reading tensor data.

    The header is checked against the tensors' own dtypes and shapes (counts, kinds,
    dtypes, missing or extra tensors); value-level checks (NaN, index range) need
    :func:`load_patches`. Raises :class:`~patchkit.errors.PatchValueError` naming the
    file and the problem; where the problem is in one patch's entry, its ``position``
    and ``name`` are that patch's (``name`` ``None`` when the name itself is bad) and
    its ``value`` the offending value (the count, shape, dtype, kind or tensor key that
    is wrong); for a problem of the file as a whole they are ``None`` and ``value`` is
    the path (the format version, or the first tensor the header does not describe,
    where one of those is the problem).
    """
    _check_path(path, "read_patch_index")
    path = os.fsdecode(path)
    f = _open(path)
    try:
        with f:
            return _parse_index(path, f)
    except PatchValueError:
        raise
    except Exception as e:  # a safetensors error while reading the header
        _reading_failed(path, e)


def read_patch_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The user metadata of the patch file at ``path`` (``patchkit``'s own header key
    left out), its keys in sorted order (the same in every process): the ``metadata``
    given to :func:`save_patches`, ``{}`` where none was. Reads no tensor data.

    The file is checked as by :func:`patchkit.io.read_patch_index`: a missing,
    unreadable or malformed file raises :class:`~patchkit.errors.PatchValueError`
    naming it; a ``path`` that is no str, bytes or ``os.PathLike``, ``TypeError``.
    """
    _check_path(path, "read_patch_metadata")
    path = os.fsdecode(path)
    f = _open(path)
    try:
        with f:
            _parse_index(path, f)
            return _user_metadata(f.metadata())
    except PatchValueError:
        raise
    except Exception as e:
        _reading_failed(path, e)


def load_patches(
    path: str | os.PathLike[str], *, device: torch.device | str = "cpu"
) -> list[CheckpointWeightPatch]:
    """Read the ordered patch list of a patch file onto ``device``.

    Returns patches equal, bit for bit, to those saved (names, shapes, checkpoint
    dtypes, values and indices with their dtypes), in the saved order. The file is
    checked before data is read (see :func:`read_patch_index`) and the patches are
    validated after (:func:`~patchkit.patch.validate_patches`, dense and sparse
    separately); every problem raises :class:`~patchkit.errors.PatchValueError` naming
    the file, never a raw safetensors or JSON exception.

    The patches own their memory: their values and indices are copies, not views of
    the file, so rewriting, truncating or deleting the file afterwards does not change
    them (nor does writing to them change the file). The data is read with plain reads
    from the file the header was read from (not a memory map): a file another writer
    cuts short while it is read raises :class:`~patchkit.errors.PatchValueError`
    (``reason`` ``"truncated"``), and a rename onto its path meanwhile is not seen.
    The cost is one copy of the file's tensor data: on the CPU the patches take
    process memory equal to those bytes (where a memory map would have shared the
    operating system's file cache, and read only what was touched), on an accelerator
    the data is copied to the device, as it would be anyway. The header readers
    (:func:`read_patch_index`, :func:`read_patch_metadata`) read no tensor data.

    ``device`` is checked before the file is opened: a string torch does not parse,
    ``"meta"`` (patches need memory that holds their values) or an accelerator this
    machine lacks (``"cuda"`` where ``torch.cuda.is_available()`` is False) raises
    :class:`~patchkit.errors.PatchValueError` naming the device (``reason`` ``"bad
    device"``, ``"meta device"`` or ``"device unavailable"``; ``value`` the argument);
    neither a ``str`` nor a ``torch.device``: :class:`~patchkit.errors.PatchTypeError`.
    Without the ``safetensors`` package: :class:`ModuleNotFoundError`.
    """
    _check_path(path, "load_patches")
    return [p for _, p in _load(os.fsdecode(path), _device_text(_checked_device(device)))]


def _device_text(device: torch.device) -> str:
    """``device`` as safetensors takes it: ``"cpu"`` for the CPU whatever its index
    (``"cpu:0"``, which torch takes, safetensors refuses), else torch's name for it."""
    return "cpu" if device.type == "cpu" else str(device)


def _load(path: str, device: str) -> list[tuple[int, CheckpointWeightPatch]]:
    """:func:`load_patches` as ``(position, patch)`` pairs."""
    patches = list(_read_each(path, device))
    for sparse in (False, True):
        group = [(i, p) for i, p in patches if (p.indices is not None) == sparse]
        _validated(path, [p for _, p in group], [i for i, _ in group])
    return patches


def _read_each(
    path: str, device: str, wanted: Callable[[PatchFileEntry], bool] | None = None
) -> Iterator[tuple[int, CheckpointWeightPatch]]:
    """``(position, patch)`` of each patch of the file (of each ``wanted`` says to read),
    read one at a time, in the file's order, unchecked; a problem with the file raises
    :class:`~patchkit.errors.PatchValueError` naming it."""
    f, fh = _open(path, device, keep=True)
    try:
        with f, fh:
            entries = _parse_index(path, f)
            start, layout = _data_layout(fh)
            for e in entries:
                if wanted is not None and not wanted(e):
                    continue
                values = _read_tensor(path, fh, start, layout[_key(e.position, "values")],
                                      device)
                indices = (_read_tensor(path, fh, start, layout[_key(e.position, "indices")],
                                        device) if e.sparse else None)
                yield e.position, CheckpointWeightPatch(e.name, e.shape, e.dtype, values,
                                                        indices)
                del values, indices  # (else held while the next patch is read)
    except PatchValueError:
        raise
    except Exception as e:
        _reading_failed(path, e)


def _validated(path: str, patches: list[CheckpointWeightPatch], positions: list[int]) -> None:
    """:func:`~patchkit.patch.validate_patches` of patches read from file ``path``: a
    problem raises :class:`~patchkit.errors.PatchValueError` naming the file too."""
    try:
        validate_patches(patches, positions=positions)
    except PatchError as e:
        raise PatchValueError(
            f"patch file {_path_text(path)}: {e}", position=e.position, name=e.name,
            reason=e.reason, value=e.value,
        ) from None


def _needs_data(e: PatchFileEntry) -> bool:
    """Whether checking ``e``, once its structure passed, needs its data: a sparse patch
    (NaN values, indices out of range or repeated), or a dense one of integers whose
    values' dtype may hold numbers it cannot (see :func:`~patchkit.patch.validate_patches`)."""
    return e.sparse or (_is_integral(e.dtype) and _may_not_fit(e.values_dtype, e.dtype))


def _shape_only(e: PatchFileEntry) -> CheckpointWeightPatch:
    """A patch with ``e``'s name, shape, dtypes and counts whose tensors are on the meta
    device: the structure checks read nothing more, and skip the checks of numbers."""
    values = torch.empty(e.nnz, dtype=e.values_dtype, device="meta")
    indices = (torch.empty(e.nnz, dtype=e.indices_dtype, device="meta")
               if e.indices_dtype is not None else None)
    return CheckpointWeightPatch(e.name, e.shape, e.dtype, values, indices)


def check_patch_file(path: str | os.PathLike[str]) -> list[PatchFileEntry]:
    """Check that :func:`load_patches` would accept the file at ``path``, holding no more
    than one patch in memory; return its header (as :func:`read_patch_index`).

    Makes the checks :func:`load_patches` makes, in its order: the dense patches, then
    the sparse ones, each group's structure first (names, shapes, dtypes, counts, read
    from the header), then the numbers of each patch whose check needs them (a sparse
    patch's values and indices: NaN values, indices out of range or repeated; a dense
    patch of integers whose values may not fit), read one patch at a time and dropped.
    Other dense patches' values are never read. So a file of a model's dense weights is
    checked in the time of reading its header, and one of sparse patches in the time of
    reading their data. Raises what :func:`load_patches` raises for the same file: a
    :class:`~patchkit.errors.PatchValueError` naming the file and the first offending
    patch (its position, name, reason and value)."""
    _check_path(path, "check_patch_file")
    path = os.fsdecode(path)
    entries = read_patch_index(path)
    for sparse in (False, True):
        group = [e for e in entries if e.sparse == sparse]
        _validated(path, [_shape_only(e) for e in group], [e.position for e in group])
        for position, patch in _read_each(
                path, "cpu", lambda e, sparse=sparse: e.sparse == sparse and _needs_data(e)):
            _validated(path, [patch], [position])
            del patch  # (before the next is read: one patch in memory, not two)
    return entries


# --------------------------------------------------------------------------- summary


def _positions_text(positions: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c])
                 for c in range(len(header))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


# ``text`` with each non-printable character (newlines, terminal escape codes, other
# control and format characters, lone surrogates) written as ``repr`` writes it
_escaped = shown_name


def _encodable(out: TextIO) -> Callable[[str], str]:
    """A function writing what ``out``'s encoding cannot hold with backslash escapes
    (``\\xfc``, ``\\u540d``), as ``errors="backslashreplace"`` does; the identity for a
    stream with no known encoding."""
    encoding = getattr(out, "encoding", None)
    if not isinstance(encoding, str):
        return lambda text: text
    try:
        "".encode(encoding)
    except LookupError:
        return lambda text: text

    def fit(text: str) -> str:
        try:
            text.encode(encoding)
        except UnicodeEncodeError:
            return text.encode(encoding, "backslashreplace").decode(encoding)
        return text

    return fit


def _percent(x: float | None) -> str:
    if x is None:
        return "-"
    return _percent_digits(x) + "%"


def _stand_in(e: PatchFileEntry) -> CheckpointWeightPatch:
    """A patch of ``e``'s name, shape and dtype holding no data (its values on the meta
    device): what a chunk plan needs, read from a file's header alone."""
    return CheckpointWeightPatch(e.name, e.shape, e.dtype, torch.empty(0, device="meta"))


def print_patch_file_summary(
    path: str | os.PathLike[str],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    file: TextIO | None = None,
    check: bool = True,
) -> int:
    """Print a plain-text summary of a patch file; return an exit code.

    With ``check`` (the default) the file is first checked as :func:`check_patch_file`
    checks it (the data of its sparse patches is read, one at a time; a dense patch's
    values only where they are integers that may not fit): a file :func:`load_patches`
    would refuse is a bad file, and nothing is printed to ``file``. With
    ``check=False`` only the header is read (no tensor data), and the summary says that
    the values were not checked. Prints, to ``file`` (default
    stdout): the patch count and user metadata; one row per patch (position, name,
    kind, shape (past 8 dims: the first 7, the last and their count), dtype,
    ``written``: the elements the patch writes, i.e. the values it
    carries (every element, ``numel``, for a dense patch, which does not know which of
    them change; the carried positions for a sparse one), density (``written / numel``),
    bytes on the wire) and a total row; then the chunk plan for ``max_chunk_bytes`` from
    :func:`~patchkit.chunking.plan_chunks` (call, patch positions, staged bytes, why the
    call closed). A load cannot mix dense and sparse patches, so a file holding both is
    planned as two loads, the dense patches first.

    What comes from the file (names, metadata keys and values) and the path are printed
    so that they cannot act on a terminal: a plain string as it is, one with a
    non-printable character (a newline, a terminal escape code, a bidirectional
    override), a backslash or an opening quote as its Python ``repr`` (quoted, escaped),
    and an ``error: ...`` line with its non-printable characters escaped likewise.
    Characters that ``file``'s encoding cannot hold (``PYTHONIOENCODING=ascii``, a
    Latin-1 terminal) are written as backslash escapes (``\\xfc``, ``\\u540d``), never
    a UnicodeEncodeError.

    Returns 0; a bad file (or a bad budget, or no ``safetensors`` package) prints
    ``error: ...`` to stderr and returns 2. A ``file`` with no ``write`` method (a path
    string, say: open it first), a ``check`` that is not a bool, or a ``path`` that is
    no path raises ``TypeError`` before anything is read.
    """
    return _print_summary(path, max_chunk_bytes, file, check, check)


def _print_summary(path: str | os.PathLike[str], max_chunk_bytes: int,
                   file: TextIO | None, check: bool, checked: bool) -> int:
    """:func:`print_patch_file_summary`; ``checked``: whether the summary says the file
    was checked (``True`` with ``check=False``: a caller checked it already)."""
    check_flag(check, "check")
    if file is not None and not callable(getattr(file, "write", None)):
        raise TypeError(f"print_patch_file_summary: file must be a text stream with a write "
                        f"method (e.g. an open file or io.StringIO), got "
                        f"{type(file).__name__}: {file!r:.60}")
    _check_path(path, "print_patch_file_summary")
    out = sys.stdout if file is None else file
    path = os.fsdecode(path)  # (bytes too, as the readers take them)
    try:
        max_chunk_bytes = check_max_chunk_bytes(max_chunk_bytes)  # also with no patches
        entries = check_patch_file(path) if check else read_patch_index(path)
        meta = read_patch_metadata(path)
        groups = [(kind, [e for e in entries if e.kind == kind]) for kind in ("dense", "sparse")]
        groups = [(k, g) for k, g in groups if g]
        plans = []
        for kind, group in groups:
            stand_ins = [_stand_in(e) for e in group]
            plans.append((kind, plan_chunks(stand_ins, max_chunk_bytes,
                                            positions=[e.position for e in group])))
    except (PatchError, ValueError, TypeError, ImportError) as e:
        err = sys.stderr
        print(_encodable(err)(f"error: {_escaped(str(e))}"), file=err)
        return 2

    fit = _encodable(out)

    def show(text: str) -> str:
        return fit(distinct_name(text))

    n_sparse = sum(e.sparse for e in entries)
    print(f"patch file: {show(path)}", file=out)
    print(f"{_count(len(entries), 'patch', 'patches')} ({n_sparse} sparse, "
          f"{len(entries) - n_sparse} dense), "
          f"format {FORMAT_NAME} v{FORMAT_VERSION}", file=out)
    if meta:
        print("metadata:", file=out)
        for k, v in meta.items():
            print(f"  {show(k)}: {show(v)}", file=out)
    if not entries:
        print("no patches: a load makes no load_weights call", file=out)
        return 0
    print("checked: load_patches accepts this file" if checked else
          "not checked: the header alone was read (values and indices were not)", file=out)

    print("", file=out)
    header = ["#", "name", "kind", "shape", "dtype", "written", "density", "wire bytes"]
    rows = []
    for e in entries:
        rows.append([str(e.position), show(e.name), e.kind, _shape_text(list(e.shape)),
                     _dtype_name(e.dtype), str(e.nnz), _percent(e.density),
                     format_bytes(e.wire_bytes)])
    total_n = sum(e.numel for e in entries)
    total_nnz = sum(e.nnz for e in entries)
    rows.append(["", "total", "", "", "", str(total_nnz),
                 _percent(total_nnz / total_n if total_n else None),
                 format_bytes(sum(e.wire_bytes for e in entries))])
    for line in _table(header, rows, right={0, 5, 6, 7}):
        print(line, file=out)
    if n_sparse < len(entries):
        print("  (written: the elements a patch writes; a dense patch writes every one, "
              "changed or not)", file=out)

    for kind, chunks in plans:
        print("", file=out)
        label = f" ({kind} patches; one load)" if len(plans) > 1 else ""
        print(f"chunk plan for max_chunk_bytes = {max_chunk_bytes} "
              f"({format_bytes(max_chunk_bytes)}){label}: {len(chunks)} load_weights "
              f"call{'s' if len(chunks) != 1 else ''}", file=out)
        crows = []
        for c in chunks:
            closed = c.closed_by + (" (over budget: travels alone)" if c.over_budget else "")
            crows.append([str(c.index), _positions_text(c.positions), format_bytes(c.bytes),
                          closed])
        for line in _table(["call", "patches #", "staged bytes", "closed by"], crows,
                           right={0, 2}):
            print(line, file=out)
    return 0
