"""The native backend: the C++/CUDA extension ``ppo_fast._C``.

The extension registers the operators ``torch.ops.ppo_fast.*`` (``csrc/<op>.cpp``: schema and
C++ CPU kernel; ``csrc/cuda/<op>.cu``: the CUDA kernels of the losses, when the build had
CUDA; ``csrc/autograd/<op>.cpp``: its autograd kernel, which calls the op's backward operator).
Each module here adds what torch needs around its op: a fake kernel (for ``torch.compile`` and
meta tensors) that checks the shape relations as the C++ kernels do, and the function with the
reference's signature (the fused heads, ``linear_*``, keep their autograd here in Python: their
kernels dwarf its cost).  Every op is differentiable as the reference is, to first order; a backward
operator computes only the gradients autograd asks for (its ``output_mask``).  The
``kl_estimator`` and ``agg`` names pass straight through to the C++ ops, which parse them.
"""

from .. import collect, op_modules
from ._common import REGISTERED, availability, built_with_cuda, cuda_archs

MODULES = op_modules(__name__, __path__)
SUPPORTED, FUNCTIONS = collect(MODULES)
# The torch.ops.ppo_fast operators each module registers (forward and backward), for the tests.
OPERATORS = tuple(REGISTERED)

__all__ = ["SUPPORTED", "FUNCTIONS", "OPERATORS", "availability", "built_with_cuda", "cuda_archs"]
