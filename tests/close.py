"""Float comparisons at the scale of the values compared.

A fixed absolute tolerance means nothing without the values' magnitude: float32 logits near 42 are spaced
3.8e-6 apart, so `atol=1e-6` there asks for more than the format holds and passes or fails by accident of the
machine (issue 33). Every comparison states its error relative to the largest magnitude of the expected
values, never finer than a few units in the last place of their type, and says why that much is expected.
"""
from __future__ import annotations

import numpy as np


def _array(x) -> np.ndarray:
    if hasattr(x, "detach"):                       # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def assert_close(actual, desired, *, rel: float, why: str) -> None:
    """|actual - desired| <= rel * max|desired|, elementwise; `why` says where the difference comes from."""
    a, d = _array(actual), _array(desired)
    assert a.shape == d.shape, f"shapes differ: {a.shape} vs {d.shape} ({why})"
    kind = np.result_type(a.dtype, d.dtype)
    eps = float(np.finfo(kind).eps) if np.issubdtype(kind, np.floating) else 0.0
    if rel < 4 * eps:
        raise ValueError(f"rel={rel:g} is below 4 units in the last place of {kind} ({4 * eps:.2g}): the format "
                         "cannot hold it")
    scale = float(np.abs(d.astype(np.float64)).max()) if d.size else 0.0
    np.testing.assert_allclose(a.astype(np.float64), d.astype(np.float64), rtol=0, atol=rel * scale,
                               err_msg=f"rel {rel:g} of max|desired| {scale:.4g}: {why}")
