"""What the machine computes: attention, softmax, sums and matmuls in JAX with explicit numerics.

:mod:`~mhanum.emulate.attention` (``attention``, ``multi_head_attention``, ``softmax``),
:mod:`~mhanum.emulate.summation` (sums and matmuls in a given order and dot unit) and
:mod:`~mhanum.emulate.tensorcore` (the bit-exact tensor-core inner product) round exactly as the
:class:`mhanum.Numerics` they are given says; :mod:`mhanum.reference` says what they should have
computed and :mod:`mhanum.bounds` how far apart the two can be.
"""

__all__: list[str] = []  # a namespace: the public names live in the submodules
