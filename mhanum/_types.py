"""The array types of mhanum's signatures, named once.

Annotations only: every module of mhanum has ``from __future__ import annotations``, so these
aliases are never evaluated at run time and importing them imports neither NumPy nor JAX.

* :data:`ArrayLike`: what a public function accepts as an array: a NumPy or JAX array, a
  nested sequence or a scalar (converted with ``np.asarray`` or ``jnp.asarray`` at the boundary);
* :data:`NumpyArray`: a NumPy array of any dtype; :data:`FloatArray`: of float64, the dtype
  every bound and reference evaluates in;
* :data:`JaxArray`: a JAX array (traced or concrete);
* :data:`Array`: a NumPy or JAX array, where a function takes either and keeps its kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import jax
    import numpy as np
    import numpy.typing as npt

__all__ = ["Array", "ArrayLike", "FloatArray", "JaxArray", "NumpyArray"]

ArrayLike: TypeAlias = "npt.ArrayLike | jax.Array"
NumpyArray: TypeAlias = "np.ndarray"
FloatArray: TypeAlias = "npt.NDArray[np.float64]"
JaxArray: TypeAlias = "jax.Array"
Array: TypeAlias = "np.ndarray | jax.Array"
