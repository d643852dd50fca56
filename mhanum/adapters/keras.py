"""Keras 3 ``keras.layers.MultiHeadAttention`` (TensorFlow backend) with mhanum's weights.

Code paths (keras 3.15, ``keras/src/layers/attention/multi_head_attention.py``
``MultiHeadAttention._compute_attention``; TensorFlow backend ``keras/src/backend/tensorflow/nn.py``):

* ``"fused"`` (the default call: no dropout, no ``return_attention_scores``):
  ``ops.dot_product_attention``, whose TensorFlow version (``_dot_product_attention_xla``) scales
  the *logits*, **replaces** masked logits by ``-0.7 * 3.38953e38`` (``_get_large_negative``:
  0.7 times bfloat16's largest value, not float32's; ``-0.7 * 65500`` in float16) and runs
  ``tf.nn.softmax`` in float32; a fully-masked row is uniform.
* ``"explicit"`` (``return_attention_scores=True`` or dropout): q times ``1/sqrt(key_dim)``
  *before* the einsum, then the ``Softmax`` layer (``keras/src/layers/activations/softmax.py``),
  which **replaces** masked logits by ``-1e9`` (``-3e4`` in float16) with ``where`` and zeroes the
  masked probabilities afterwards, so a fully-masked row is 0 (the layer returns the output bias).
  Earlier Keras 3 releases *added* ``(1 - mask) * -1e9`` instead; the model follows the installed
  ``Softmax.call``.
* ``"additive"``: not a Keras path but the attention of the TensorFlow Transformer tutorial
  (``scaled_dot_product_attention``: ``logits / sqrt(d_k)``, then ``logits += mask * -1e9`` with
  **1 = masked out**), run on the projections of the Keras layer. This is the "TensorFlow layer"
  of the classic report: given ``mask = ones`` it adds ``-1e9`` to every logit.

``attention_mask`` True (or nonzero) means attend. Weights: query/key/value ``EinsumDense``
kernels ``(E, H, key_dim)`` = ``W.reshape(E, H, D)`` with biases ``(H, D)``; the output kernel
``(H, D, E)`` = ``Wo.reshape(H, D, E)``, bias ``(E,)``; ``key_dim`` is per head. TensorFlow enables
TF32 matmuls by default on Ampere and newer GPUs (:func:`numerics` ``tf32=True``).

Grouped-query attention (``load(..., num_kv_heads=)``) is ``keras.layers.GroupQueryAttention``
(``keras/src/layers/attention/grouped_query_attention.py``): key and value kernels of
``num_kv_heads`` heads, repeated with ``ops.repeat(..., axis=2)`` (query head ``h`` reads key/value
head ``h // (H / H_kv)``, as :meth:`mhanum.MHAParams.expand_kv_heads`), then the same two paths:
``"fused"`` through ``ops.dot_product_attention`` with the scale on the logits, ``"explicit"``
with q times ``1/sqrt(head_dim)`` before the einsum and the ``Softmax`` layer. The
``"additive"`` path is the MultiHeadAttention tutorial's and does not apply.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    import tensorflow as tf

    from mhanum._types import ArrayLike

__all__ = [
    "FUSED_MASK_VALUE",
    "PATHS",
    "effective_mask",
    "extract",
    "load",
    "model",
    "numerics",
    "run",
    "version",
]

PATHS = ("fused", "explicit", "additive")
FUSED_MASK_VALUE = -0.7 * 3.38953e38
"""The constant the TensorFlow backend's ``dot_product_attention`` puts on masked float32 logits."""

_SOURCE = {
    "fused": "keras/src/backend/tensorflow/nn.py: _dot_product_attention_xla, _get_large_negative",
    "explicit": "keras/src/layers/attention/multi_head_attention.py: _compute_attention; "
    "keras/src/layers/activations/softmax.py: Softmax.call, _large_negative_number",
    "additive": "tensorflow.org/text/tutorials/transformer: scaled_dot_product_attention "
    "(mask * -1e9 added), on the layer's EinsumDense projections",
}


def version() -> str:
    """``keras <version> (<backend> backend)``."""
    return f"keras {keras.__version__} ({keras.backend.backend()} backend)"


@functools.cache
def _softmax_adds() -> bool:
    """Whether the installed ``Softmax`` layer *adds* ``(1 - mask) * -1e9`` (Keras 3 before the
    ``where`` version read for 3.15) rather than replacing masked logits and zeroing them."""
    from keras.src.layers.activations import softmax

    return "inputs += adder" in inspect.getsource(softmax.Softmax.call)


def _check_backend() -> None:
    if keras.backend.backend() != "tensorflow":
        msg = (
            "KERAS_BACKEND: expected 'tensorflow' (the backend mhanum models), got "
            f"{keras.backend.backend()!r}"
        )
        raise InvalidArgument(msg)


def load(
    params: MHAParams, num_heads: int, num_kv_heads: int | None = None
) -> keras.layers.MultiHeadAttention | keras.layers.GroupQueryAttention:
    """A float32 ``keras.layers.MultiHeadAttention``, built, holding exactly ``params``; with
    ``num_kv_heads`` (a divisor of ``num_heads``, ``params`` grouped as for
    :func:`mhanum.multi_head_attention`) a ``keras.layers.GroupQueryAttention``.

    Raises:
        InvalidArgument: for parameters the layer cannot hold, or a backend other than TensorFlow.
    """
    _check_backend()
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    p = C.float32_params(params, num_heads, num_kv_heads)
    e_q, e_kv, d = p.d_q, p.d_kv, p.qk_width // num_heads
    if num_kv_heads is None:
        layer = keras.layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=d, output_shape=p.d_out, dtype="float32"
        )
    else:
        layer = keras.layers.GroupQueryAttention(
            head_dim=d, num_query_heads=num_heads, num_key_value_heads=kv_heads, dtype="float32"
        )
    layer.build((1, 1, e_q), (1, 1, e_kv))
    layer.set_weights(
        [
            p.wq.reshape(e_q, num_heads, d),
            np.asarray(p.bq).reshape(num_heads, d),
            p.wk.reshape(e_kv, kv_heads, d),
            np.asarray(p.bk).reshape(kv_heads, d),
            p.wv.reshape(e_kv, kv_heads, d),
            np.asarray(p.bv).reshape(kv_heads, d),
            p.wo.reshape(num_heads, d, p.d_out),
            p.bo,
        ]
    )
    return layer


def extract(layer: keras.layers.MultiHeadAttention | keras.layers.GroupQueryAttention) -> MHAParams:
    """The weights of a built Keras ``MultiHeadAttention`` (or ``GroupQueryAttention``: grouped,
    for ``num_kv_heads=``) as ``MHAParams`` (float64)."""
    qk, qb, kk, kb, vk, vb, ok, ob = (np.asarray(w, np.float64) for w in layer.get_weights())

    def flat(kernel: np.ndarray) -> np.ndarray:
        return kernel.reshape(kernel.shape[0], -1)

    return MHAParams(
        flat(qk),
        flat(kk),
        flat(vk),
        ok.reshape(-1, ok.shape[-1]),
        qb.reshape(-1),
        kb.reshape(-1),
        vb.reshape(-1),
        ob,
    )


def numerics(path: str = "fused", *, tf32: bool = False) -> Numerics:
    """The mhanum :class:`~mhanum.Numerics` of a float32 path (see the module docstring).

    Args:
        path: ``"fused"``, ``"explicit"`` or ``"additive"``.
        tf32: TF32 matmul operands (TensorFlow's default on Ampere+ GPUs; not on CPUs).
    """
    C.check_path(path, PATHS)
    common: dict[str, Any] = {
        "input": "float32",
        "accum": "float32",
        "div_ulps": 2.0,  # Eigen's softmax multiplies by the reciprocal of the sum
        "operand_format": "tf32" if tf32 else None,
    }
    if path == "fused":
        return Numerics(scale="scores", mask_mode="fill", mask_value=FUSED_MASK_VALUE, **common)
    if path == "explicit":
        mode = "add" if _softmax_adds() else "fill"
        return Numerics(scale="q", mask_mode=mode, mask_value=-1e9, **common)
    return Numerics(scale="scores", mask_mode="add", mask_value=-1e9, **common)


def model(path: str = "fused", *, tf32: bool = False) -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of a path."""
    C.check_path(path, PATHS)
    explicit = "unmasked" if _softmax_adds() else "zero"
    fully = {"fused": "uniform", "explicit": explicit, "additive": "unmasked"}[path]
    notes = {
        "fused": "masked logits replaced by -0.7*3.38953e38 (bfloat16's max), not finfo.min",
        "explicit": "masked logits replaced by -1e9, masked probabilities set to 0 afterwards",
        "additive": "mask 1 = masked out, mask*-1e9 added; logits / sqrt(d_k) is modelled as "
        "a product by 1/sqrt(d_k) (the same value when d_k is a power of 4)",
    }[path]
    return C.PathModel("keras", path, numerics(path, tf32=tf32), fully, _SOURCE[path], notes)


def effective_mask(raw_mask: ArrayLike, path: str = "fused") -> np.ndarray:
    """The keys a raw mask attends on ``path``, in mhanum's convention (True = attend).

    ``fused``: nonzero attends; ``explicit``: True or ``> 0.5`` attends; ``additive``: 0 attends
    (1 = masked out, the tutorial's convention).
    """
    C.check_path(path, PATHS)
    arr = np.asarray(raw_mask)
    if path == "additive":
        return arr.astype(np.float64) < 0.5
    if arr.dtype == np.bool_:
        return arr
    return arr > 0.5 if path == "explicit" else arr != 0


def run(
    layer: keras.layers.MultiHeadAttention | keras.layers.GroupQueryAttention,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "fused",
    raw_mask: ArrayLike | None = None,
) -> np.ndarray:
    """Run ``layer`` on float32 inputs on the chosen path; numpy float32 out.

    Args:
        layer: a built Keras ``MultiHeadAttention`` (e.g. from :func:`load`).
        x_q: ``(B, Lq, E)`` or ``(Lq, E)``.
        x_kv: ``(B, Lk, E)`` or ``(Lk, E)``.
        mask: mhanum mask (True = attend) broadcastable to ``(B, Lq, Lk)``; passed as
            ``attention_mask`` (``fused``, ``explicit``) or as the tutorial's ``1 - mask``
            (``additive``).
        path: ``"fused"``, ``"explicit"`` or ``"additive"``.
        raw_mask: a mask passed untranslated: ``attention_mask`` as the user wrote it, or the
            tutorial's float mask (1 = masked out), broadcastable to ``(B, Lq, Lk)``.

    Raises:
        InvalidArgument: for shapes that do not fit, an unknown path, or both masks.
    """
    import tensorflow as tf

    C.check_path(path, PATHS)
    if path == "additive" and isinstance(layer, keras.layers.GroupQueryAttention):
        msg = "path: expected 'fused' or 'explicit' for a GroupQueryAttention layer, got 'additive'"
        raise InvalidArgument(msg)
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    p_width = layer._query_dense.kernel.shape[0]
    kv_width = layer._key_dense.kernel.shape[0]
    q = C.batched(x_q, "x_q", p_width)
    kv = C.batched(x_kv, "x_kv", kv_width)
    m = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])
    if path == "additive":
        given = None if m is None else (~m).astype(np.float32)
        if raw_mask is not None:
            given = np.broadcast_to(
                np.asarray(raw_mask, np.float32), (q.shape[0], *q.shape[1:2], kv.shape[1])
            )
        out = _tutorial_attention(layer, tf.constant(q), tf.constant(kv), given)
        return C.unbatch(np.asarray(out), x_q)
    given = m if raw_mask is None else np.asarray(raw_mask)
    out = layer(
        q,
        kv,
        key=kv,
        attention_mask=given,
        return_attention_scores=path == "explicit",
    )
    if path == "explicit":
        out = out[0]
    return C.unbatch(np.asarray(out), x_q)


def _tutorial_attention(
    layer: keras.layers.MultiHeadAttention | keras.layers.GroupQueryAttention,
    x_q: tf.Tensor,
    x_kv: tf.Tensor,
    mask: np.ndarray | None,
) -> tf.Tensor:
    """The Transformer tutorial's attention on the Keras layer's projections."""
    import tensorflow as tf

    q = layer._query_dense(x_q)  # (B, T, H, D)
    k = layer._key_dense(x_kv)
    v = layer._value_dense(x_kv)
    logits = tf.einsum("BTNH,BSNH->BNTS", q, k)
    logits = logits / tf.math.sqrt(tf.cast(tf.shape(k)[-1], tf.float32))
    if mask is not None:
        logits += tf.constant(mask[:, None]) * -1e9
    weights = tf.nn.softmax(logits, axis=-1)
    return layer._output_dense(tf.einsum("BNTS,BSNH->BTNH", weights, v))
