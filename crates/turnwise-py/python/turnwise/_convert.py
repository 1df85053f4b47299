"""Conversions between what callers pass (numpy arrays, torch tensors, nested lists) and the
contiguous numpy arrays the native module takes. Nothing is copied that is already a
contiguous array of the right dtype; torch tensors go through ``.detach().cpu().numpy()``."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


class Returner:
    """Remembers whether any input was a torch tensor (and its device) so that outputs come
    back as torch tensors on that device, else as numpy arrays."""

    def __init__(self, *inputs: Any) -> None:
        self.device = None
        self.torch = False
        for x in inputs:
            if is_torch(x):
                self.torch = True
                self.device = x.device
                break

    def __call__(self, a: Any) -> Any:
        if a is None or not self.torch or not isinstance(a, np.ndarray):
            return a
        import torch

        t = torch.from_numpy(a)
        if self.device is not None and self.device.type != "cpu":
            t = t.to(self.device)
        return t


def _ragged(x: Any) -> bool:
    if not isinstance(x, (list, tuple)) or not x:
        return False
    lens = set()
    for row in x:
        if is_torch(row) or isinstance(row, np.ndarray):
            if row.ndim != 1:
                return False
            lens.add(row.shape[0])
        elif isinstance(row, (list, tuple)):
            lens.add(len(row))
        else:
            return False
    return len(lens) > 1


def array(
    x: Any,
    dtype: Any,
    name: str,
    ndim: Optional[int] = None,
    pad: Any = 0,
) -> np.ndarray:
    """``x`` as a C-contiguous numpy array of ``dtype``.

    A list of 1-D rows of different lengths is padded with ``pad`` to a 2-D array. Raises
    ``ValueError`` naming ``name`` when the result does not have ``ndim`` dimensions.
    """
    if is_torch(x):
        x = x.detach().cpu().numpy()
    elif _ragged(x):
        rows = [np.asarray(r.detach().cpu().numpy() if is_torch(r) else r) for r in x]
        width = max(r.shape[0] for r in rows)
        out = np.full((len(rows), width), pad, dtype=dtype)
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r
        x = out
    try:
        a = np.ascontiguousarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`{name}` cannot be read as an array of {np.dtype(dtype)}: {e}") from None
    if ndim is not None and a.ndim != ndim:
        raise ValueError(
            f"`{name}` has shape {list(a.shape)}, expected {ndim} dimension(s)"
        )
    return a


def int_array(x: Any, name: str, ndim: Optional[int] = None, pad: int = -1) -> np.ndarray:
    """``x`` as a contiguous int64 array; float inputs must hold whole numbers."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        if not np.all(np.isfinite(x)) or np.any(x != np.round(x)):
            raise ValueError(f"`{name}` must hold integers, got non-integer values")
    return array(x, np.int64, name, ndim, pad)


def optional(x: Any, fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(x, *args, **kw)``, or ``None`` for ``None``."""
    return None if x is None else fn(x, *args, **kw)


def rows2d(x: Any, dtype: Any, name: str, pad: Any = 0) -> "tuple[np.ndarray, bool]":
    """A 1-D or 2-D input as a 2-D array plus whether it was 1-D (one row)."""
    a = array(x, dtype, name, pad=pad) if dtype is not np.int64 else int_array(x, name, pad=pad)
    if a.ndim == 1:
        return a[None, :], True
    if a.ndim != 2:
        raise ValueError(f"`{name}` has shape {list(a.shape)}, expected 1 or 2 dimensions")
    return a, False


def strings(x: Optional[Sequence[Sequence[str]]], name: str) -> Optional[list]:
    """Per-rollout lists of strings."""
    if x is None:
        return None
    try:
        return [[str(s) for s in row] for row in x]
    except TypeError:
        raise ValueError(f"`{name}` must be one list of strings per rollout") from None
