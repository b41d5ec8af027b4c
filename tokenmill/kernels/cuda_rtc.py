"""CUDA C kernels compiled at run time with NVRTC and launched through the driver API (ctypes), for the
few kernels Triton cannot express well (kernels/w4a16_gemv_cuda.py: a tensor-core GEMV whose operand
fragments come straight from the loaded words). NVRTC ships with PyTorch's CUDA builds (the
nvidia-cuda-nvrtc wheel), so nothing is built at install time: a kernel is compiled for the device's own
architecture the first time a variant is asked for (~0.1-0.5 s), then kept per process. The sources use
no headers, so NVRTC needs no CUDA toolkit.

Launches go on torch's current stream, so they order with torch's work and are captured into CUDA graphs
like any other; with `pdl` a launch may start while the kernel before it still runs (kernels/pdl.py's
rules: the kernel waits in `griddepcontrol.wait` before it reads what that kernel wrote).

`compile_cubin` works without a GPU (tests/kernels build every variant for sm_80 and sm_90 on the CPU
where libnvrtc is installed); `kernel` and launches need the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

ENV_NVRTC = "TOKENMILL_NVRTC"  # a path to libnvrtc.so, where it is not found by name


class CudaRtcError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library: TOKENMILL_NVRTC, else by name, else from the nvidia-* wheels beside torch."""
    names = [os.environ.get(ENV_NVRTC, "")]
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]")))
    for name in filter(None, names):
        if ".alt." in name or "builtins" in name:
            continue
        # libnvrtc opens its builtins by name: one beside it in a wheel's folder is loaded first.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*"))):
            if ".alt." not in builtins:
                with contextlib.suppress(OSError):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CudaRtcError(f"libnvrtc was not found (install nvidia-cuda-nvrtc, or set {ENV_NVRTC})")


def available() -> bool:
    """Whether NVRTC can be loaded here."""
    try:
        nvrtc()
    except CudaRtcError:
        return False
    return True


def runs_on(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether kernels built here run on `device`: NVRTC loadable and the device of `capability` or later."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _runs_on(index, capability)


@functools.lru_cache(maxsize=16)
def _runs_on(index: int, capability: tuple[int, int]) -> bool:
    return torch.cuda.get_device_capability(index) >= capability and available()


def _check_nvrtc(result: int, what: str) -> None:
    if result:
        lib = nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CudaRtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


def compile_cubin(
    source: str, name: str, arch: int, defines: dict[str, int] | None = None, verbose: bool = False
) -> tuple[bytes, str]:
    """`source` compiled for sm_`arch` (e.g. 90) with each define as -DNAME=VALUE: the cubin's bytes and
    NVRTC's log (with `verbose`, ptxas's report of registers and spills in it). Raises CudaRtcError with
    the log when it does not compile."""
    lib = nvrtc()
    program = ctypes.c_void_p()
    _check_nvrtc(
        lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"-arch=sm_{arch}", "-std=c++17", "-default-device", "--use_fast_math"]
        options += [f"-D{key}={int(value)}" for key, value in sorted((defines or {}).items())]
        options += ["--ptxas-options=-v"] if verbose else []
        encoded = [option.encode() for option in options]
        array = (ctypes.c_char_p * len(encoded))(*encoded)
        result = lib.nvrtcCompileProgram(program, len(encoded), array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if result:
            raise CudaRtcError(f"{name} ({' '.join(options)}) does not compile:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise CudaRtcError("the CUDA driver (libcuda.so.1) is not loadable here") from error


def _check(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise CudaRtcError(f"{what}: {(name.value or b'?').decode()} ({result})")


class _LaunchAttribute(ctypes.Structure):
    # The value is CUlaunchAttributeValue, a 64-byte union: as ints, so that the field is a view of the
    # struct's memory (a c_char array field reads back as a bytes copy).
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Kernel:
    """A loaded kernel: call it with the grid, the block and its arguments (tensors by pointer, ints as
    32-bit, floats as fp32, in the kernel's parameter order)."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, name: str) -> None:
        self.function, self.module, self.name = function, module, name
        self._shared_limit = 48 << 10  # more dynamic shared memory than this needs the function's opt-in
        self._pdl = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._pdl.value[0] = 1  # programmaticStreamSerializationAllowed

    def __call__(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[torch.Tensor | int | float],
        stream: torch.cuda.Stream | None = None,
        pdl: bool = False,
        shared: int = 0,
    ) -> None:
        values: list[ctypes._SimpleCData] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            elif isinstance(arg, bool) or not isinstance(arg, int | float):
                raise TypeError(f"{self.name}: an argument of type {type(arg).__name__}")
            elif isinstance(arg, int):
                values.append(ctypes.c_int(arg))
            else:
                values.append(ctypes.c_float(arg))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        if shared > self._shared_limit:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(_driver().cuFuncSetAttribute(self.function, 8, shared), f"{self.name}: {shared} B shared")
            self._shared_limit = shared
        stream = stream or torch.cuda.current_stream()
        config = _LaunchConfig(
            grid=(ctypes.c_uint * 3)(*_dims(grid)),
            block=(ctypes.c_uint * 3)(*_dims(block)),
            shared=shared,
            stream=stream.cuda_stream,
            attrs=ctypes.pointer(self._pdl) if pdl else None,
            num_attrs=1 if pdl else 0,
        )
        _check(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None), self.name)


def _dims(dims: Sequence[int]) -> list[int]:
    return [*dims, *([1] * (3 - len(dims)))]


def _load(cubin: bytes, name: str, index: int) -> Kernel:
    """The cubin loaded into device `index`'s primary context (torch's, which the runtime makes current
    on this thread while the device is torch's current one), and its kernel `name`."""
    with torch.cuda.device(index):
        torch.empty(1, device=torch.device("cuda", index))  # the runtime's context is current from here
        context = ctypes.c_void_p()
        _check(_driver().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise CudaRtcError(f"no CUDA context is current for cuda:{index}")
        module = ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), cubin), f"cuModuleLoadData ({name})")
        function = ctypes.c_void_p()
        _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), name)
    return Kernel(function, module, name)


_kernels: dict[tuple, Kernel] = {}


def kernel(path: Path, name: str, device: torch.device, defines: dict[str, int]) -> Kernel:
    """The kernel `name` of the CUDA source at `path`, compiled with `defines` for `device` and loaded,
    once a process (kept per device and defines)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (str(path), name, index, tuple(sorted(defines.items())))
    found = _kernels.get(key)
    if found is not None:
        return found
    major, minor = torch.cuda.get_device_capability(index)
    cubin, _ = compile_cubin(path.read_text(), name, major * 10 + minor, defines)
    found = _kernels[key] = _load(cubin, name, index)
    return found
