// The Python module ppo_fast._C.  Importing it runs the static registrations of the
// ppo_fast operator library: each op's schema, CPU kernel and CPU registration live in
// csrc/<op>.cpp, its CUDA kernels in csrc/cuda/<op>.cu with their torch glue in
// csrc/cuda/<op>.cpp, its autograd in csrc/autograd/<op>.cpp; the fake kernels are in
// ppo_fast/backends/native/<op>.py.
//
// Every op checks its arguments (ranks, shapes, dtypes, devices; csrc/common/checks.h) and
// raises RuntimeError on a mismatch.  `agg` is a name in ppo_fast.contract.AGG_MODES and
// `kl_estimator` one in KL_ESTIMATORS (parsed in csrc/common/contract.h).  A backward op
// returns the gradient of each input whose `output_mask` entry is true (in that input's
// dtype) and an empty tensor for the others.
#include <Python.h>

#include "common/build_info.h"

namespace {

PyObject* built_with_cuda(PyObject*, PyObject*) {
#ifdef PPO_FAST_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* cuda_archs(PyObject*, PyObject*) { return PyUnicode_FromString(PPO_FAST_CUDA_ARCHS_STRING); }

PyMethodDef methods[] = {
    {"built_with_cuda", built_with_cuda, METH_NOARGS, "Whether the CUDA kernels were compiled into this build."},
    {"cuda_archs", cuda_archs, METH_NOARGS, "The CUDA architectures of this build (setup.py's arch_token), or ''."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ppo_fast native kernels (registered as torch.ops.ppo_fast.*)",
                          -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
