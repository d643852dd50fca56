"""Compatibility alias (kept until 0.2): the tensor-core model, its emulation, factor and probes.

The model lives in :mod:`mhanum.units.tensorcore`, its JAX emulation in
:mod:`mhanum.emulate.tensorcore`, the error factor of Theorem T.2 in :mod:`mhanum.bounds.factors`
and the probes in :mod:`mhanum.devices.probes`.
"""

from mhanum.bounds.factors import tensor_core_eta as dot_error_eta
from mhanum.bounds.factors import tensor_core_factor as dot_error_factor
from mhanum.devices.probes import PROBES, Probe, matching_models, probe_vectors, run_probes
from mhanum.emulate.tensorcore import matmul
from mhanum.units.tensorcore import MODELS, TensorCoreModel, get_model

__all__ = [
    "MODELS",
    "PROBES",
    "Probe",
    "TensorCoreModel",
    "dot_error_eta",
    "dot_error_factor",
    "get_model",
    "matching_models",
    "matmul",
    "probe_vectors",
    "run_probes",
]
