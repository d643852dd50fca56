"""A float64 numpy forward of a BERT encoder, giving every layer's attention input.

It follows ``transformers``' ``modeling_bert.py`` (``BertEmbeddings``, ``BertLayer``) in
inference mode (no dropout): the embeddings are word + absolute position + token type 0, then
LayerNorm; each layer is post-LayerNorm,

    a = LayerNorm(SelfAttention(x) Woᵀ + bo + x),
    y = LayerNorm(GELU(a W1ᵀ + b1) W2ᵀ + b2 + a),

with GELU the erf form ``x Φ(x)`` and every LayerNorm ``(x - mean) / sqrt(var + ε)·γ + β``
(biased variance, ``ε = layer_norm_eps``). Padding keys are excluded exactly (probability 0):
``transformers`` adds ``(1 - mask)·finfo(dtype).min`` instead (``get_extended_attention_mask``),
which :func:`mhanum.models.audit` analyses separately.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.models._checkpoint import Checkpoint
from mhanum.models._tokenizer import WordPiece

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    """``x Φ(x) = x (1 + erf(x/√2)) / 2``, BERT's ``"gelu"``, in float64."""
    erf = np.asarray(_erf(x / math.sqrt(2.0)), np.float64)
    return 0.5 * x * (1.0 + erf)


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis with the biased variance, as ``torch.nn.LayerNorm``."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


@dataclasses.dataclass(frozen=True)
class Batch:
    """Sentences as a padded batch of token ids.

    Attributes:
        sentences: the sentences.
        tokens: each sentence's WordPiece tokens, ``[CLS]`` and ``[SEP]`` included.
        ids: token ids ``(B, L)``, padded with ``[PAD]``'s id to the longest sentence.
        lengths: each sentence's number of tokens (its ``[SEP]`` is at ``lengths[b] - 1``).
    """

    sentences: tuple[str, ...]
    tokens: tuple[tuple[str, ...], ...]
    ids: np.ndarray
    lengths: tuple[int, ...]

    @property
    def valid(self) -> np.ndarray:
        """``(B, L)`` booleans, True at a sentence's tokens (False at padding)."""
        return np.arange(self.ids.shape[1]) < np.asarray(self.lengths)[:, None]

    @property
    def key_mask(self) -> np.ndarray:
        """The attention mask ``(B, 1, 1, L)`` (True = attend): every query attends to its
        sentence's tokens, in every head."""
        return self.valid[:, None, None, :]


def tokenize_batch(checkpoint: Checkpoint, sentences: Sequence[str]) -> Batch:
    """Tokenise and pad ``sentences`` with the checkpoint's vocabulary.

    Raises:
        InvalidArgument: for no sentences, a non-string, or a sentence longer than the model's
            ``max_position_embeddings`` tokens.
    """
    if isinstance(sentences, str) or not isinstance(sentences, Sequence) or not sentences:
        msg = f"sentences: expected a non-empty sequence of strings, got {sentences!r}"
        raise InvalidArgument(msg)
    tokenizer = WordPiece(checkpoint.vocab)
    tokens = []
    for s in sentences:
        words = tokenizer.tokenize(s)
        tokens.append((tokenizer.cls, *words, tokenizer.sep))
    longest = max(len(t) for t in tokens)
    limit = checkpoint.config.max_position_embeddings
    if longest > limit:
        msg = f"sentences: expected at most {limit} tokens each, got {longest}"
        raise InvalidArgument(msg)
    ids = np.full((len(tokens), longest), checkpoint.config.pad_token_id, dtype=np.int64)
    for b, t in enumerate(tokens):
        ids[b, : len(t)] = [checkpoint.vocab[w] for w in t]
    return Batch(tuple(sentences), tuple(tokens), ids, tuple(len(t) for t in tokens))


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, heads: int) -> np.ndarray:
    """``x @ w + b`` split into heads: ``(..., L, H·d) → (..., H, L, d)``."""
    y = x @ w + (0.0 if b is None else b)
    return np.swapaxes(y.reshape(*y.shape[:-1], heads, -1), -2, -3)


def softmax_masked(s: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with the masked-out entries (mask False) exactly 0."""
    s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Forward:
    """The float64 forward of a batch.

    Attributes:
        batch: the tokenised sentences.
        layer_inputs: ``layer_inputs[i]`` is layer ``i``'s input ``(B, L, d_model)`` (the
            attention's ``x_q = x_kv``); ``layer_inputs[num_layers]`` is the encoder's output.
        attention_outputs: ``attention_outputs[i]``, layer ``i``'s multi-head attention output
            (after the output projection ``attention.output.dense``, before the residual).
    """

    batch: Batch
    layer_inputs: tuple[np.ndarray, ...]
    attention_outputs: tuple[np.ndarray, ...]

    def sentence_embeddings(self) -> np.ndarray:
        """all-MiniLM-L6-v2's sentence embedding: the mean of the encoder's output over each
        sentence's tokens, L2-normalised, ``(B, d_model)``."""
        valid = self.batch.valid[..., None]
        mean = (self.layer_inputs[-1] * valid).sum(axis=1) / valid.sum(axis=1)
        return mean / np.linalg.norm(mean, axis=-1, keepdims=True)


def self_attention(
    checkpoint: Checkpoint, layer: int, x: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Layer ``layer``'s multi-head attention in float64: heads, scale ``1/sqrt(d_k)``, softmax
    over the keys the mask keeps, concatenation and ``attention.output.dense``."""
    params = checkpoint.attention_params(layer)
    heads = checkpoint.config.num_attention_heads
    q, k, v = (project(x, w, b, heads) for w, b in ((params.wq, params.bq),
               (params.wk, params.bk), (params.wv, params.bv)))  # fmt: skip
    s = q @ np.swapaxes(k, -1, -2) * (1.0 / math.sqrt(checkpoint.config.head_size))
    o = softmax_masked(s, mask) @ v
    merged = np.swapaxes(o, -2, -3).reshape(*x.shape[:-1], -1)
    return merged @ params.wo + params.bo


def forward(
    checkpoint: Checkpoint, sentences: Sequence[str], *, layers: int | None = None
) -> Forward:
    """Run the encoder in float64 on ``sentences``, keeping every layer's input.

    Args:
        checkpoint: a loaded BERT checkpoint.
        sentences: the input sentences (tokenised with the checkpoint's vocabulary, padded).
        layers: run only the first ``layers`` layers (default all).

    Raises:
        InvalidArgument: as :func:`tokenize_batch`, or ``layers`` outside ``[0, num_layers]``.
    """
    c = checkpoint.config
    n = c.num_hidden_layers if layers is None else layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= c.num_hidden_layers:
        msg = f"layers: expected an integer in [0, {c.num_hidden_layers}], got {layers!r}"
        raise InvalidArgument(msg)
    batch = tokenize_batch(checkpoint, sentences)
    t = checkpoint.tensor
    eps = c.layer_norm_eps
    length = batch.ids.shape[1]
    x = (
        t("embeddings.word_embeddings.weight")[batch.ids]
        + t("embeddings.position_embeddings.weight")[:length]
        + t("embeddings.token_type_embeddings.weight")[0]
    )
    x = layer_norm(x, t("embeddings.LayerNorm.weight"), t("embeddings.LayerNorm.bias"), eps)
    inputs, outputs = [x], []
    for i in range(n):
        p = f"encoder.layer.{i}"
        attn = self_attention(checkpoint, i, x, batch.key_mask)
        outputs.append(attn)
        a = layer_norm(attn + x, t(f"{p}.attention.output.LayerNorm.weight"),
                       t(f"{p}.attention.output.LayerNorm.bias"), eps)  # fmt: skip
        w1, b1 = checkpoint.linear(f"{p}.intermediate.dense")
        w2, b2 = checkpoint.linear(f"{p}.output.dense")
        x = layer_norm(gelu(a @ w1 + b1) @ w2 + b2 + a, t(f"{p}.output.LayerNorm.weight"),
                       t(f"{p}.output.LayerNorm.bias"), eps)  # fmt: skip
        inputs.append(x)
    return Forward(batch, tuple(inputs), tuple(outputs))
