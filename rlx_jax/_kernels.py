"""Loading and registration of the compiled FFI kernels.

At import, each compiled module (``_ffi_cpu``, ``_ffi_cuda``) is loaded if present, its
XLA FFI API version is checked against the running jaxlib, and its handlers are registered
with XLA for their platform. ``kernel_info()`` reports what happened; ``has_kernel`` is
what the lowering rules ask before emitting an ``ffi_call``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import warnings

import jax

# our platform key -> (compiled module, XLA platform name for registration)
_MODULES = {"cpu": ("rlx_jax._ffi_cpu", "cpu"), "cuda": ("rlx_jax._ffi_cuda", "CUDA")}

_INFO: dict[str, dict] = {}
_WARNED: set[str] = set()


def _runtime_ffi_version() -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib, read from the headers it ships."""
    try:
        import jaxlib

        path = os.path.join(os.path.dirname(jaxlib.__file__), "include", "xla", "ffi", "api", "c_api.h")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1))
        minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
        return major, minor
    except (OSError, AttributeError, ValueError):
        return None


def _import_module(module_name: str):
    """Imports a compiled module from the package, or, when the environment variable
    RLX_JAX_KERNEL_DIR names a folder (a development build made with
    tools/build_kernels.sh), from that folder."""
    kernel_dir = os.environ.get("RLX_JAX_KERNEL_DIR")
    if not kernel_dir:
        return importlib.import_module(module_name)
    short = module_name.rsplit(".", 1)[1]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(kernel_dir, short + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"no {short} extension in RLX_JAX_KERNEL_DIR={kernel_dir}")


def _load(platform: str) -> dict:
    module_name, xla_platform = _MODULES[platform]
    info = {"loaded": False, "module": module_name, "targets": [], "error": None, "ffi_api": None}
    try:
        module = _import_module(module_name)
    except ImportError as exc:
        info["error"] = f"{module_name} is not built or cannot be imported ({exc})"
        return info
    built = (int(module.XLA_FFI_API_MAJOR), int(module.XLA_FFI_API_MINOR))
    info["ffi_api"] = built
    runtime = _runtime_ffi_version()
    if runtime is not None and (built[0] != runtime[0] or built[1] > runtime[1]):
        info["error"] = (
            f"{module_name} was built against XLA FFI API {built[0]}.{built[1]} but the running "
            f"jaxlib {jax.__version__} provides {runtime[0]}.{runtime[1]}: rebuild rlx_jax against "
            "this jaxlib (pip install --no-build-isolation .) or install a newer jaxlib"
        )
        return info
    try:
        for name, capsule in sorted(module.registrations().items()):
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
            info["targets"].append(name)
    except Exception as exc:  # registration failures must not break import
        info["error"] = f"registering {module_name} targets failed: {exc}"
        info["targets"] = []
        return info
    info["loaded"] = True
    return info


def _ensure_loaded() -> None:
    if _INFO:
        return
    for platform in _MODULES:
        _INFO[platform] = _load(platform)
    cpu = _INFO["cpu"]
    if not cpu["loaded"]:
        warnings.warn(
            f"rlx_jax: compiled CPU kernels unavailable, ops fall back to their pure-JAX "
            f"references: {cpu['error']}",
            RuntimeWarning,
            stacklevel=3,
        )
        _WARNED.add("cpu")


def kernel_info() -> dict[str, dict]:
    """Per platform ("cpu", "cuda"): whether the compiled library loaded, its module,
    the FFI targets it registered, the FFI API version it was built against, and the
    error that stopped it, if any."""
    _ensure_loaded()
    return {p: {k: (list(v) if isinstance(v, list) else v) for k, v in i.items()} for p, i in _INFO.items()}


def has_kernel(platform: str, target: str) -> bool:
    """True when a compiled handler for ``target`` is registered on ``platform``.

    When it is not, the caller lowers the op's pure-JAX reference; the first such
    fallback on a platform warns once (with the reason)."""
    _ensure_loaded()
    info = _INFO.get(platform)
    if info is not None and target in info["targets"]:
        return True
    if platform not in _WARNED:
        _WARNED.add(platform)
        reason = info["error"] if info is not None else f"no compiled module for platform {platform!r}"
        warnings.warn(
            f"rlx_jax: no compiled kernel {target!r} on {platform}; using the pure-JAX reference "
            f"({reason})",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


_ensure_loaded()
