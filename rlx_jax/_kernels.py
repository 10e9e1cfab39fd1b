"""Loading and registration of the compiled FFI kernels.

At import, each compiled module (``_ffi_cpu``, ``_ffi_cuda``) is loaded if present, its
XLA FFI API version is checked against the running jaxlib, and its handlers are registered
with XLA for their platform. ``kernel_info()`` reports what happened; ``has_kernel`` is
what the lowering rules ask before emitting an ``ffi_call``.

FFI target names are versioned: kernel ``rlx_rms_norm_fwd`` is registered as
``rlx_rms_norm_fwd_v1``, and ``target(kernel)`` gives the name a lowering emits. A
version pins the handler's ABI (operands, results, attributes), so a function
serialized with ``jax.export`` keeps finding a handler it can call; a new ABI for one
kernel is a new version registered beside the old ones. The registered names are
declared stable to ``jax.export`` (see ``declare_export_stable``), so exporting a
function that uses rlx_jax ops needs no extra arguments.
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

#: the ABI version each kernel's lowering emits, when it is not 1. Bump an entry only
#: together with the call site that needs the new ABI, and keep the older version's
#: handler registered while exported functions that call it are supported.
ABI_VERSIONS: dict[str, int] = {
    # v2 takes eps as an f64 attribute (v1: f32), so that f64 inputs normalise with their exact eps
    "rlx_rms_norm_fwd": 2,
    "rlx_layer_norm_fwd": 2,
    "rlx_group_norm_fwd": 2,
    "rlx_batch_norm_inference_bwd": 2,
}

_VERSIONED = re.compile(r"^(?P<kernel>.+)_v(?P<version>[0-9]+)$")


def target(kernel: str) -> str:
    """The versioned FFI target name that lowerings emit for ``kernel``
    (``"rlx_rms_norm_fwd"`` -> ``"rlx_rms_norm_fwd_v1"``). A name that already
    carries a version is returned unchanged."""
    if _VERSIONED.match(kernel):
        return kernel
    return f"{kernel}_v{ABI_VERSIONS.get(kernel, 1)}"


def registered_targets() -> list[str]:
    """Every versioned FFI target name registered on any platform, sorted."""
    _ensure_loaded()
    return sorted({t for info in _INFO.values() for t in info["targets"]})


def export_safety_checks() -> list:
    """``jax.export.DisabledSafetyCheck.custom_call`` for every registered rlx_jax FFI
    target: the public-API way to let ``jax.export`` serialize calls to them,
    ``jax.export.export(f, disabled_checks=rlx_jax.export_safety_checks())``. Only
    needed when ``declare_export_stable`` could not declare the targets (a jax whose
    export module no longer has the registry it updates)."""
    from jax.export import DisabledSafetyCheck

    return [DisabledSafetyCheck.custom_call(t) for t in registered_targets()]


def declare_export_stable(targets) -> bool:
    """Adds ``targets`` to jax.export's set of custom-call targets whose compatibility
    is guaranteed, so that ``jax.export.export`` serializes calls to them without
    ``disabled_checks``. jax (0.10) has no public API for this: the set is
    ``jax._src.export._export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE``. The guarantee
    is ours to keep: a registered ``<kernel>_v<N>`` never changes its ABI. Returns
    False (and changes nothing) when that set is not found; ``export_safety_checks()``
    then gives the public-API alternative."""
    try:
        from jax._src.export import _export
    except ImportError:
        return False
    stable = getattr(_export, "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE", None)
    if not isinstance(stable, set):
        return False
    stable.update(targets)
    return True
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
    info = {"loaded": False, "module": module_name, "targets": [], "error": None, "ffi_api": None,
            "export_stable": False}
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
            if not _VERSIONED.match(name):
                raise ValueError(f"FFI target {name!r} has no ABI version suffix")
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
            info["targets"].append(name)
    except Exception as exc:  # registration failures must not break import
        info["error"] = f"registering {module_name} targets failed: {exc}"
        info["targets"] = []
        return info
    info["loaded"] = True
    info["export_stable"] = declare_export_stable(info["targets"])
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
    the versioned FFI targets it registered, the FFI API version it was built against,
    whether its targets were declared stable to ``jax.export``, and the error that
    stopped it, if any."""
    _ensure_loaded()
    return {p: {k: (list(v) if isinstance(v, list) else v) for k, v in i.items()} for p, i in _INFO.items()}


def has_kernel(platform: str, kernel: str) -> bool:
    """True when a compiled handler for ``kernel`` (a bare kernel name, at the ABI
    version ``target(kernel)`` emits, or a versioned name) is registered on ``platform``.

    When it is not, the caller lowers the op's pure-JAX reference; the first such
    fallback on a platform warns once (with the reason)."""
    _ensure_loaded()
    info = _INFO.get(platform)
    name = target(kernel)
    if info is not None and name in info["targets"]:
        return True
    if platform not in _WARNED:
        _WARNED.add(platform)
        reason = info["error"] if info is not None else f"no compiled module for platform {platform!r}"
        warnings.warn(
            f"rlx_jax: no compiled kernel {name!r} on {platform}; using the pure-JAX reference "
            f"({reason})",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


_ensure_loaded()
