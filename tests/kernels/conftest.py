"""Kernel tests run the Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any @triton.jit decorator runs (triton.language's own too): tests'
root conftest sets it, before any test module imports anything; it is set here as well, for a run of
tests/kernels alone from another root. Four interpreter faults of triton 3.6
that the GPU does not share are mended here, so that the tests hold the kernels to GPU behaviour; and
one slowness of it that costs the suite half a minute.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter
    except ImportError:
        interpreter = None

    if interpreter is not None:
        import triton.language as tl

        _patch_lang_tensor = interpreter._patch_lang_tensor
        _convert_float = interpreter._convert_float

        def _patch_lang_tensor_numpy24(tensor, scope) -> None:
            # Scalars are ndarrays of shape (1,), and numpy >= 2.4 refuses int() of those
            # (triton-lang/triton#9171): a loop over run-time bounds would fail.
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        def _convert_float_rtne(data, input_dtype, output_dtype, rounding_mode):
            # The interpreter rounds fp32 -> bf16 toward zero; the GPU rounds to nearest even, as torch.
            if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
                as_bf16 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
                return as_bf16.view(torch.int16).numpy().view(np.uint16)
            if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
                # The interpreter's fp32 -> e4m3 rounding is off by a binade for some values (31.3 gave
                # 16, not 32); the GPU rounds to nearest even, as torch.
                as_fp8 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(
                    torch.float8_e4m3fn
                )
                return as_fp8.view(torch.uint8).numpy()
            return _convert_float(data, input_dtype, output_dtype, rounding_mode)

        _create_dot = interpreter.InterpreterBuilder.create_dot

        def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            # bf16 operands are stored as uint16 bit patterns, which the interpreter multiplies as integers.
            def widen(x):
                if x.dtype.scalar != tl.bfloat16:
                    return x
                data = _convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data.reshape(x.data.shape), tl.float32)

            return _create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        # The interpreter patches triton.language's builtins at every call of a @jit helper inside a kernel,
        # finding them with inspect.getmembers over tl, tl.core, tl.tensor and tl.math each time: about a
        # third of an interpreted kernel's time. Which names are builtins does not change (only whether they
        # are patched at the moment), so they are listed once, here, before any kernel has patched them.
        _patch_builtin = interpreter._patch_builtin
        _builtin_names = {
            pkg: [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
            for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
        }

        def _patch_builtin_listed(pkg, builder, scope) -> None:
            names = _builtin_names.get(pkg)
            if names is None:
                _patch_builtin(pkg, builder, scope)
                return
            # A package's builtins are patched all together and restored all together: if the first is
            # patched (a helper called inside a kernel), they all are, and there is nothing to do.
            if not names or not tl.core.is_builtin(getattr(pkg, names[0])):
                return
            for name in names:
                interpreter._patch_attr(pkg, name, getattr(pkg, name), builder, scope)

        interpreter._patch_builtin = _patch_builtin_listed
        interpreter._patch_lang_tensor = _patch_lang_tensor_numpy24
        interpreter._convert_float = _convert_float_rtne
        interpreter.InterpreterBuilder.create_dot = _create_dot_bf16
