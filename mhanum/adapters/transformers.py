"""Hugging Face ``transformers``: a BERT layer's self-attention, eager and SDPA, with mhanum's model.

``BertAttention`` is ``BertSelfAttention`` (the Q, K, V projections, the heads, the attention)
then ``BertSelfOutput`` (``dense``, dropout, ``LayerNorm(dense + input)``). mhanum's
:class:`~mhanum.MHAParams` holds ``query``, ``key``, ``value`` and ``output.dense``, so
:func:`run` stops after ``output.dense``, before the residual and the LayerNorm (dropout is the
identity in eval mode): its output is what :func:`mhanum.reference.multi_head_attention` computes
exactly, and what ``mhanum.models.forward`` calls the attention output.

Two code paths (transformers 5.x, ``models/bert/modeling_bert.py`` ``BertSelfAttention.forward``,
chosen by ``config._attn_implementation``, set by ``attn_implementation=``):

* ``"eager"``: ``eager_attention_forward``: ``torch.matmul(q, kᵀ) * scaling`` (the scale on the
  scores, ``scaling = head_size**-0.5`` rounded to float32), the mask **added**, then
  ``nn.functional.softmax`` in the input dtype (float32: max shift, one reciprocal of the sum then
  a product), then ``matmul`` with v. The mask is ``masking_utils.eager_mask``: the boolean mask
  of ``sdpa_mask`` turned into ``0`` / ``finfo(float32).min`` (about ``-3.4e38``). Adding it to a
  float32 score ``s`` (``|s| < 2^103``) gives ``finfo.min`` exactly, so the addition is the same
  as replacing the masked logits by ``finfo.min``; after the max shift their ``exp`` is 0: a
  padded key gets exactly zero weight. A fully-masked row (a sentence whose 2-D mask is all 0) has
  every logit ``finfo.min``: the softmax is exactly uniform, the mean of the values.
* ``"sdpa"``: ``integrations/sdpa_attention.py`` ``sdpa_attention_forward``:
  ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=<bool, True = attend>,
  scale=scaling, is_causal=False)``; for float32 on the CPU torch takes its fused flash kernel
  (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``, modelled by
  :func:`mhanum.adapters.torch.numerics` ``("sdpa")``): the scale on ``q kᵀ``, the boolean mask
  as ``0/-inf``, an online softmax over key blocks of 512 with ``exp_u20``. A fully-masked row is
  0, so the layer returns ``output.dense``'s bias. Without padding, ``create_bidirectional_mask``
  passes no mask at all.

Masks: the model's 2-D ``attention_mask`` ``(B, Lk)`` is **1 = keep** (attend), 0 = padding;
``masking_utils.create_bidirectional_mask`` turns it into the path's 4-D mask
``(B, 1, Lq, Lk)``. :func:`run` takes an mhanum mask (True = attend) of per-batch key padding and
builds the 4-D mask with that same function, as ``BertModel.forward`` does.

Weights: ``query``, ``key``, ``value``, ``output.dense`` are ``nn.Linear`` (``y = x Wᵀ + b``):
``wq = query.weightᵀ`` and so on; the heads are consecutive blocks of ``head_size`` columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertAttention

from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.adapters import torch as torch_adapter
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "PATHS",
    "attention_mask",
    "effective_mask",
    "extract",
    "load",
    "load_layer",
    "load_model",
    "model",
    "numerics",
    "path_of",
    "run",
    "version",
]

PATHS = ("eager", "sdpa")

_SOURCE = {
    "eager": "transformers/models/bert/modeling_bert.py: eager_attention_forward; "
    "transformers/masking_utils.py: eager_mask (0 / finfo.min); "
    "aten/src/ATen/native/cpu/SoftMaxKernel.cpp: _vec_softmax_lastdim",
    "sdpa": "transformers/integrations/sdpa_attention.py: sdpa_attention_forward; "
    "transformers/masking_utils.py: sdpa_mask (bool, True = attend); "
    "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: cpu_flash_attention",
}


def version() -> str:
    """The installed transformers version."""
    return str(transformers.__version__)


def numerics(path: str = "eager") -> Numerics:
    """The mhanum :class:`~mhanum.Numerics` of a float32 path on the CPU (module docstring).

    Args:
        path: ``"eager"`` or ``"sdpa"``.
    """
    if C.check_path(path, PATHS) == "sdpa":
        return torch_adapter.numerics("sdpa")
    return Numerics(
        input="float32",
        accum="float32",
        scale="scores",
        # eager_mask adds finfo.min, which every float32 score rounds to (module docstring):
        # the same as replacing, the form Theorem A.2 bounds (for an added finfo.min it cannot
        # exclude the sum's overflow, and is inf).
        mask_mode="fill",
        mask_value="finfo.min",
        div_ulps=2.0,  # one reciprocal of the sum, then a product
    )


def model(path: str = "eager") -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of a path, with the files it was read from."""
    notes = {
        "eager": "2-D attention_mask 1 = keep; finfo(float32).min added (absorbs every score: "
        "padded keys get weight 0, a fully-masked row is uniform)",
        "sdpa": "bool mask True = attend passed to F.scaled_dot_product_attention (CPU flash "
        "kernel: online softmax over blocks of 512 keys, exp_u20)",
    }[C.check_path(path, PATHS)]
    fully = "uniform" if path == "eager" else "zero"
    return C.PathModel(
        "transformers", path, numerics(path), fully, f"{_SOURCE[path]} ({version()})", notes
    )


def _check_params(params: MHAParams, num_heads: int) -> MHAParams:
    p = C.float32_params(params, num_heads)
    if p.d_q != p.d_kv or p.d_q != p.qk_width or p.d_out != p.qk_width:
        msg = (
            "params: expected d_q = d_kv = H*d_k = d_out for BertAttention, got "
            f"{p.d_q}, {p.d_kv}, {p.qk_width}, {p.d_out}"
        )
        raise InvalidArgument(msg)
    return p


def load(params: MHAParams, num_heads: int, *, path: str = "eager") -> BertAttention:
    """A float32 ``BertAttention`` in eval mode holding exactly ``params``.

    Args:
        params: the weights (rounded to float32): ``wq, bq`` become ``self.query`` and so on,
            ``wo, bo`` ``output.dense``; all four biases, ``d_q = d_kv = H·d_k = d_out``.
        num_heads: number of heads.
        path: the attention implementation, ``"eager"`` or ``"sdpa"``.

    Raises:
        InvalidArgument: for parameters the layer cannot hold, or an unknown path.
    """
    C.check_path(path, PATHS)
    p = _check_params(params, num_heads)
    config = transformers.BertConfig(
        hidden_size=p.d_q,
        num_attention_heads=num_heads,
        intermediate_size=4 * p.d_q,
        num_hidden_layers=1,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        attn_implementation=path,
    )
    layer = BertAttention(config).to(torch.float32)
    linears = (
        (layer.self.query, p.wq, p.bq),
        (layer.self.key, p.wk, p.bk),
        (layer.self.value, p.wv, p.bv),
        (layer.output.dense, p.wo, p.bo),
    )
    with torch.no_grad():
        for linear, w, b in linears:
            linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            linear.bias.copy_(torch.from_numpy(b))
    return layer.eval()


def load_model(
    model_dir: str | Path | None = None, *, path: str = "eager"
) -> transformers.BertModel:
    """A float32 ``transformers.BertModel`` in eval mode, read offline from a local directory.

    Args:
        model_dir: a checkpoint directory (``config.json``, ``model.safetensors``); default the
            one :func:`mhanum.models.default_model_dir` finds (all-MiniLM-L6-v2).
        path: the attention implementation, ``"eager"`` or ``"sdpa"``.

    Raises:
        InvalidArgument: for an unknown path, a directory that does not exist, or no model
            package.
    """
    from mhanum.model_packages import default_model_dir

    C.check_path(path, PATHS)
    directory = default_model_dir() if model_dir is None else Path(model_dir)
    if not directory.is_dir():
        msg = f"model_dir: expected a checkpoint directory, got {str(directory)!r}"
        raise InvalidArgument(msg)
    bert = transformers.BertModel.from_pretrained(
        str(directory), attn_implementation=path, dtype=torch.float32, local_files_only=True
    )
    return bert.eval()


def load_layer(
    model_dir: str | Path | None = None, layer: int = 0, *, path: str = "eager"
) -> BertAttention:
    """Encoder layer ``layer``'s ``BertAttention`` of the model :func:`load_model` reads.

    Raises:
        InvalidArgument: as :func:`load_model`, or a layer index outside the model.
    """
    bert = load_model(model_dir, path=path)
    layers = bert.encoder.layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
        msg = f"layer: expected an integer in [0, {len(layers)}), got {layer!r}"
        raise InvalidArgument(msg)
    return layers[layer].attention


def _check_layer(layer: object) -> BertAttention:
    if not isinstance(layer, BertAttention) or layer.is_cross_attention:
        msg = f"layer: expected a self-attention BertAttention, got {type(layer).__name__}"
        raise InvalidArgument(msg)
    return layer


def path_of(layer: BertAttention) -> str:
    """The path a ``BertAttention`` runs (its config's attention implementation).

    Raises:
        InvalidArgument: for another module, or an implementation other than eager and sdpa.
    """
    impl = _check_layer(layer).self.config._attn_implementation or "eager"
    if impl not in PATHS:
        msg = f"layer: expected attention implementation one of {PATHS}, got {impl!r}"
        raise InvalidArgument(msg)
    return str(impl)


def extract(layer: BertAttention) -> MHAParams:
    """The weights of a ``BertAttention`` as ``MHAParams`` (float64 holding the float32 values):
    ``self.query``/``key``/``value`` and ``output.dense``, weights transposed."""

    def linear(m: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
        w = m.weight.detach().cpu().double().numpy().T.copy()
        return w, m.bias.detach().cpu().double().numpy()

    s = _check_layer(layer).self
    (wq, bq), (wk, bk), (wv, bv) = (linear(m) for m in (s.query, s.key, s.value))
    wo, bo = linear(layer.output.dense)
    return MHAParams(wq, wk, wv, wo, bq, bk, bv, bo)


def attention_mask(mask: ArrayLike | None, batch: int, length: int) -> np.ndarray | None:
    """An mhanum key-padding mask as the 2-D ``attention_mask`` a BERT model takes.

    Args:
        mask: None, or booleans (True = attend) ``(B, Lk)``, or broadcastable to
            ``(B, Lq, Lk)`` without depending on the query (per-batch key padding; mhanum's
            ``(B, 1, 1, Lk)`` head mask also works).
        batch, length: ``B`` and ``Lq = Lk``.

    Returns:
        ``(B, Lk)`` int64, 1 = keep, 0 = padding; None for no mask.

    Raises:
        InvalidArgument: for a non-boolean mask, a shape that does not fit, or a mask that
            depends on the query (BERT's mask cannot express it).
    """
    if mask is None:
        return None
    arr = np.asarray(mask)
    if arr.dtype == np.bool_ and arr.ndim == 4 and arr.shape[1] == 1:
        arr = arr[:, 0]
    elif arr.dtype == np.bool_ and arr.ndim == 2 and arr.shape == (batch, length):
        arr = arr[:, None, :]
    m = C.mask3(arr, batch, length, length)
    assert m is not None
    if not np.all(m == m[:, :1, :]):
        msg = (
            "mask: expected per-batch key padding (the same keys for every query), "
            "got a mask that depends on the query"
        )
        raise InvalidArgument(msg)
    return m[:, 0, :].astype(np.int64)


def effective_mask(raw_mask: torch.Tensor | ArrayLike, path: str = "eager") -> np.ndarray:
    """The keys a 2-D ``attention_mask`` ``(B, Lk)`` attends, ``(B, 1, Lk)``, True = attend:
    nonzero entries (``sdpa_mask`` takes ``attention_mask.bool()``), on both paths."""
    C.check_path(path, PATHS)
    arr = raw_mask.detach().cpu().numpy() if isinstance(raw_mask, torch.Tensor) else raw_mask
    arr = np.asarray(arr)
    if arr.ndim != 2:
        msg = f"raw_mask: expected a 2-D attention_mask (B, Lk), got shape {arr.shape}"
        raise InvalidArgument(msg)
    return (arr != 0)[:, None, :]


def run(
    layer: BertAttention,
    x: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str | None = None,
    raw_mask: torch.Tensor | ArrayLike | None = None,
) -> np.ndarray:
    """A ``BertAttention``'s self-attention and ``output.dense`` on float32 inputs, as numpy.

    The mask goes through ``masking_utils.create_bidirectional_mask`` with the layer's config,
    as ``BertModel.forward`` builds it, then ``layer.self``; the result is ``layer.output.dense``
    of the merged heads (before dropout, the residual and the LayerNorm).

    Args:
        layer: a ``BertAttention`` (from :func:`load`, :func:`load_layer`, or a model's
            ``encoder.layer[i].attention``), in eval mode.
        x: ``(B, L, E)`` or ``(L, E)``: the layer's input, query, key and value at once.
        mask: mhanum mask (True = attend) of per-batch key padding (see
            :func:`attention_mask`).
        path: the path expected to run (``"eager"`` or ``"sdpa"``); None: the layer's own.
        raw_mask: a 2-D ``attention_mask`` (1 = keep) passed to transformers untranslated
            (instead of ``mask``).

    Returns:
        ``(B, L, E)`` (or ``(L, E)``) float32.

    Raises:
        InvalidArgument: for another module, a layer in training mode, a path other than the
            layer's, shapes that do not fit, a mask BERT cannot express, or both masks.
    """
    actual = path_of(layer)
    if path is not None and C.check_path(path, PATHS) != actual:
        msg = f"path: expected the layer's attention implementation {actual!r}, got {path!r}"
        raise InvalidArgument(msg)
    if layer.training:
        msg = "layer: expected eval mode (dropout off), got a layer in training mode"
        raise InvalidArgument(msg)
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    h = C.batched(x, "x", layer.self.all_head_size)
    hidden = torch.from_numpy(h)
    two_d = attention_mask(mask, h.shape[0], h.shape[1])
    if raw_mask is not None:
        two_d = np.asarray(
            raw_mask.detach().cpu().numpy() if isinstance(raw_mask, torch.Tensor) else raw_mask
        )
    with torch.no_grad():
        m4 = None
        if two_d is not None:
            m4 = create_bidirectional_mask(
                config=layer.self.config,
                inputs_embeds=hidden,
                attention_mask=torch.from_numpy(np.ascontiguousarray(two_d)),
            )
        context = layer.self(hidden, attention_mask=m4)[0]
        out = layer.output.dense(context)
    return C.unbatch(out.numpy(), x)
