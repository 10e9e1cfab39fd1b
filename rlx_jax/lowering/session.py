"""pyrlx-compatible sessions: ``Session(device, precision).compile(graph)``.

``CompiledGraph`` keeps the parameters set with ``set_param``/``set_param_typed`` and
runs the graph through one ``jax.jit`` of ``to_jax(graph)`` (XLA caches one executable
per input shape, so a graph with a dynamic dim recompiles once per new size).
Behaviour follows pyrlx: ``run`` takes and returns numpy arrays, ``run_flat`` returns
1-D arrays, ``run_typed`` takes and returns ``(bytes, dtype)`` pairs.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from .core import graph_inputs, graph_params, to_jax
from .registry import jnp_dtype

# pyrlx's device names and aliases -> the canonical device name.
_DEVICE_NAMES = {
    "cpu": "cpu",
    "cuda": "cuda", "nvidia": "cuda",
    "tpu": "tpu",
    "metal": "metal", "mtl": "metal",
    "mlx": "mlx",
    "ane": "ane", "neural-engine": "ane",
    "rocm": "rocm", "hip": "rocm", "amd": "rocm",
    "wgpu": "wgpu",
    "vulkan": "vulkan", "vk": "vulkan",
    "opengl": "opengl", "gl": "opengl",
    "directx": "directx", "dx12": "directx", "d3d12": "directx",
    "webgpu": "webgpu",
    # JAX's name for its GPU platform (pyrlx's "gpu" is the wgpu backend).
    "gpu": "cuda",
}
# canonical devices rlx_jax runs on -> JAX platform name
_JAX_PLATFORMS = {"cpu": "cpu", "cuda": "cuda", "tpu": "tpu"}
# canonical device -> the cargo feature pyrlx builds it with
_PYRLX_FEATURES = {
    "cpu": "cpu", "cuda": "cuda", "tpu": "tpu", "metal": "metal", "mlx": "mlx", "ane": "ane",
    "rocm": "rocm", "wgpu": "gpu", "vulkan": "gpu", "opengl": "gpu", "directx": "gpu",
    "webgpu": "gpu",
}
# how to make a JAX platform visible to rlx_jax
_JAX_INSTALL = {
    "cpu": "pip install -U jax",
    "cuda": 'pip install -U "jax[cuda12]" and build rlx_jax\'s CUDA kernels with RLX_JAX_CUDA=ON',
    "tpu": 'pip install -U "jax[tpu]"',
}
# pyrlx's precision spellings -> canonical name
_PRECISION_NAMES = {
    "f32": "f32", "float32": "f32", "float": "f32",
    "f16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
}
_PRECISIONS = {"f32": np.float32, "f16": np.float16, "bf16": jnp.bfloat16}


def _platform_present(platform: str) -> bool:
    try:
        return len(jax.devices(platform)) > 0
    except RuntimeError:
        return False


def _parse_device(name: str) -> str:
    """pyrlx's device string (any case, aliases allowed) -> canonical device name;
    ``ValueError`` for a name pyrlx does not know either."""
    if not isinstance(name, str):
        raise TypeError(f"device must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _DEVICE_NAMES:
        return _DEVICE_NAMES[key]
    raise ValueError(f"unknown device {name!r}; expected one of {sorted(_DEVICE_NAMES)}")


def _device_available(canonical: str) -> bool:
    platform = _JAX_PLATFORMS.get(canonical)
    return platform is not None and _platform_present(platform)


def _unavailable_message(name: str, canonical: str) -> str:
    feature = _PYRLX_FEATURES[canonical]
    if canonical in _JAX_PLATFORMS:
        how = (f"rlx_jax runs {canonical!r} through JAX: {_JAX_INSTALL[canonical]} "
               f"(pyrlx: rebuild with `maturin develop --features {feature}`)")
    else:
        how = (f"rlx_jax has no {canonical} backend (pyrlx builds it with "
               f"`maturin develop --features {feature}`); rlx_jax runs on JAX's cpu, cuda "
               f"and tpu platforms")
    return (f"device {name!r} not available in this build: {how}; "
            f"available here: {available_devices()}")


def available_devices() -> list[str]:
    """Devices a Session can use here, in pyrlx's labels (a subset of "cpu", "cuda",
    "tpu")."""
    return [d for d in _JAX_PLATFORMS if _device_available(d)]


def is_available(name: str) -> bool:
    """Whether ``Session(name)`` would work here. Every device name and alias pyrlx
    knows returns a bool (False for backends rlx_jax does not have, e.g. "metal",
    "mlx"); a name pyrlx does not know raises ``ValueError``."""
    return _device_available(_parse_device(name))


def _parse_precision(precision) -> str:
    key = precision.strip().lower() if isinstance(precision, str) else None
    if key not in _PRECISION_NAMES:
        raise ValueError(
            f"unknown precision {precision!r}; expected one of {sorted(_PRECISION_NAMES)}")
    return _PRECISION_NAMES[key]


def _dtype_from_str(dtype) -> np.dtype:
    from rlx_jax.ir import DType

    try:
        return np.dtype(DType.from_any(dtype).to_numpy())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc


def _dtype_label(dt) -> str:
    from rlx_jax.ir import DType

    return DType.from_any(np.dtype(dt)).short


def _conform(node, arr: np.ndarray) -> np.ndarray:
    """pyrlx reads arrays as flat buffers: an array whose element count fills the
    declared shape is reshaped to it (one dynamic dim is inferred from the count); an
    array already of the declared rank, or one whose count does not fit, is left for
    the shape check to accept or reject."""
    dims = list(node.shape.dims)
    if arr.ndim == len(dims) and all(
        not isinstance(d, int) or d == n for d, n in zip(dims, arr.shape)
    ):
        return arr
    dyn = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    static = int(np.prod([d for d in dims if isinstance(d, int)])) if dims else 1
    if not dyn and arr.size == static:
        return arr.reshape(dims)
    if len(dyn) == 1 and static and arr.size % static == 0:
        dims[dyn[0]] = arr.size // static
        return arr.reshape(dims)
    return arr


def _pyrlx_output(arr: np.ndarray) -> np.ndarray:
    """pyrlx's ``run`` result: f32 for every real dtype (bool, integers, f16, bf16, f64),
    and a rank-0 value as shape ``(1,)``. Complex outputs stay complex."""
    if arr.dtype.kind in "biuf" and arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    return arr.reshape(1) if arr.ndim == 0 else arr


class Session:
    """``Session(device="cpu", precision="f32")``: where and at what float precision
    compiled graphs run.

    ``device`` takes pyrlx's names and aliases ("cpu", "cuda"/"nvidia", "tpu", and
    "gpu" for JAX's GPU platform); names of backends rlx_jax lacks ("metal", "mlx",
    "rocm", "vulkan", ...) raise ``RuntimeError`` naming the build feature, unknown
    names ``ValueError``. ``precision`` is "f32" | "f16" | "bf16" (also "float32",
    "float", "float16", "half", "bfloat16"): "f16"/"bf16" compute f32 tensors in that
    type; inputs and outputs stay f32."""

    def __init__(self, device: str = "cpu", precision: str = "f32"):
        canonical = _parse_device(device)
        if not _device_available(canonical):
            raise RuntimeError(_unavailable_message(device, canonical))
        self._precision = _parse_precision(precision)
        self._label = canonical
        self._device = jax.devices(_JAX_PLATFORMS[canonical])[0]

    @property
    def device(self) -> str:
        return self._label

    @property
    def precision(self) -> str:
        return self._precision

    def compile(self, graph) -> "CompiledGraph":
        """Lower ``graph`` and return a :class:`CompiledGraph`. As in pyrlx, the graph
        is consumed: compiling the same graph object again raises ``RuntimeError``
        (compile ``graph.copy()`` to keep one; ``to_jax`` and the autodiff transforms
        still accept a consumed graph)."""
        from rlx_jax.ir import Graph

        if not isinstance(graph, Graph):
            raise TypeError(f"compile expects an rlx_jax.Graph, got {type(graph).__name__}")
        if getattr(graph, "_consumed_by_session", False):
            raise RuntimeError(
                f"graph {graph.name!r} already consumed: Session.compile takes ownership "
                "(compile graph.copy() to compile one graph more than once)")
        compiled = CompiledGraph(graph.copy(), self)
        graph._consumed_by_session = True
        return compiled

    def __repr__(self) -> str:
        return f"<rlx_jax.Session device={self._label} precision={self._precision}>"


class CompiledGraph:
    """A graph ready to run: ``set_param`` then ``run``."""

    def __init__(self, graph, session: Session):
        self._graph = graph
        self._session = session
        self._inputs = graph_inputs(graph)
        self._params_decl = graph_params(graph)
        self._params: dict[str, np.ndarray] = {}
        self._params_on_device = None  # the params as device arrays, uploaded once per change
        self._x64 = any(
            np.dtype(jnp_dtype(n.shape.dtype)).itemsize == 8
            and np.dtype(jnp_dtype(n.shape.dtype)).kind in "fiu"
            for n in graph.nodes
        )
        dtype_map = None
        if session.precision != "f32":
            low = np.dtype(_PRECISIONS[session.precision])

            def dtype_map(dt, low=low):
                return low if np.dtype(dt) == np.float32 else np.dtype(dt)

        self._fn = jax.jit(to_jax(graph, dtype_map=dtype_map))

    @property
    def device(self) -> str:
        return self._session.device

    # -- parameters --------------------------------------------------------------------
    def _param_node(self, name):
        node = self._params_decl.get(name)
        if node is None:
            raise ValueError(
                f"set_param({name!r}): the graph has no param {name!r}; its params are "
                f"{sorted(self._params_decl)}")
        return node

    def set_param(self, name: str, data) -> None:
        """Upload parameter ``name``: an array of the declared shape, or (as pyrlx's
        flat buffers) any array with the declared number of elements."""
        node = self._param_node(name)
        arr = np.asarray(data)
        want = np.dtype(jnp_dtype(node.shape.dtype))
        if arr.dtype != want:
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"set_param({name!r}): expected a numeric array, got {arr.dtype}")
            arr = arr.astype(want)
        arr = _conform(node, arr)
        self._check_static(f"set_param({name!r})", node, arr.shape)
        self._params[name] = arr
        self._params_on_device = None

    def set_param_typed(self, name: str, data: bytes, dtype: str) -> None:
        """Upload parameter ``name`` from raw bytes of ``dtype`` (it must be the
        declared dtype, e.g. "f64")."""
        node = self._param_node(name)
        self._params[name] = self._decode(f"set_param_typed({name!r})", node, data, dtype)
        self._params_on_device = None

    @staticmethod
    def _check_static(what, node, shape):
        dims = tuple(node.shape.dims)
        if len(dims) != len(shape) or any(
            isinstance(d, int) and d != n for d, n in zip(dims, shape)
        ):
            raise ValueError(
                f"{what}: expected shape {node.shape.py_dims() if hasattr(node.shape, 'py_dims') else dims}, "
                f"got {list(shape)}")

    def _decode(self, what, node, data, dtype) -> np.ndarray:
        dt = _dtype_from_str(dtype)
        want = np.dtype(jnp_dtype(node.shape.dtype))
        if dt != want:
            raise TypeError(f"{what}: the graph declares {_dtype_label(want)}, got {dtype!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{what}: expected bytes, got {type(data).__name__}")
        buf = bytes(data)
        if len(buf) % dt.itemsize:
            raise ValueError(f"{what}: {len(buf)} bytes is not a whole number of {dtype} elements")
        flat = np.frombuffer(buf, dtype=dt.newbyteorder("<")).astype(dt)
        dims = list(node.shape.dims)
        dyn = [i for i, d in enumerate(dims) if not isinstance(d, int)]
        static = int(np.prod([d for d in dims if isinstance(d, int)])) if dims else 1
        if not dyn:
            if flat.size != static:
                raise ValueError(
                    f"{what}: {flat.size} elements do not fill shape {dims} ({static} elements)")
            return flat.reshape(dims)
        if len(dyn) > 1:
            raise ValueError(f"{what}: cannot infer more than one dynamic dim from raw bytes")
        if static == 0 or flat.size % static:
            raise ValueError(f"{what}: {flat.size} elements do not fit shape {node.shape}")
        dims[dyn[0]] = flat.size // static
        return flat.reshape(dims)

    # -- running --------------------------------------------------------------------------
    def _prepare(self, inputs: dict) -> dict:
        if not isinstance(inputs, dict):
            raise TypeError(f"run expects a dict name -> array, got {type(inputs).__name__}")
        missing = sorted(set(self._params_decl) - set(self._params))
        if missing:
            raise ValueError(f"param(s) {missing} not set; call set_param first")
        out = {}
        for name, value in inputs.items():
            node = self._inputs.get(name)
            if node is None:
                raise ValueError(
                    f"unexpected input {name!r}; the graph's inputs are {sorted(self._inputs)}")
            arr = np.asarray(value)
            want = np.dtype(jnp_dtype(node.shape.dtype))
            if arr.dtype != want and arr.dtype.kind in "biuf" and want.kind in "biufc":
                arr = arr.astype(want)
            out[name] = _conform(node, arr)
        return out

    def _call(self, inputs: dict) -> list:
        inputs = self._prepare(inputs)
        if self._x64:  # f64 / i64 tensors stay 64-bit (scoped; the global flag is untouched)
            with jax.enable_x64(True):
                return self._execute(inputs)
        return self._execute(inputs)

    def _execute(self, inputs: dict) -> list:
        dev = self._session._device
        if self._params_on_device is None:
            self._params_on_device = jax.device_put(self._params, dev)
        outs = self._fn(self._params_on_device, jax.device_put(inputs, dev))
        result = []
        for o, oid in zip(outs, self._graph.outputs):
            arr = np.asarray(o)
            want = np.dtype(jnp_dtype(self._graph.node(oid).shape.dtype))
            if arr.dtype != want:
                arr = arr.astype(want)
            result.append(arr)
        return result

    def run(self, inputs: dict) -> list:
        """``run({name: array}) -> list[np.ndarray]``, one per graph output, as pyrlx
        returns them: float32 (bool, integer and f64 outputs are converted; use
        ``run_typed`` for the declared dtypes) and rank-0 outputs shaped ``(1,)``."""
        return [_pyrlx_output(o) for o in self._call(inputs)]

    def run_flat(self, inputs: dict) -> list:
        """Like ``run`` with each output flattened to 1-D (pyrlx's flat-vector run)."""
        return [_pyrlx_output(o).reshape(-1) for o in self._call(inputs)]

    def run_typed(self, inputs: dict) -> list:
        """``run_typed({name: (bytes, dtype)}) -> [(bytes, dtype)]``: lossless raw I/O at
        the declared dtypes (f64 stays f64)."""
        if not isinstance(inputs, dict):
            raise TypeError(f"run_typed expects a dict, got {type(inputs).__name__}")
        decoded = {}
        for name, pair in inputs.items():
            node = self._inputs.get(name)
            if node is None:
                raise ValueError(
                    f"unexpected input {name!r}; the graph's inputs are {sorted(self._inputs)}")
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"input {name!r}: expected tuple (bytes, dtype_str)")
            decoded[name] = self._decode(f"input {name!r}", node, pair[0], pair[1])
        outs = self._call(decoded)
        return [(np.ascontiguousarray(o).tobytes(), _dtype_label(o.dtype)) for o in outs]

    def __repr__(self) -> str:
        return f"<rlx_jax.CompiledGraph device={self.device} outputs={len(self._graph.outputs)}>"


def grad(graph, wrt, options=None):
    """pyrlx's ``grad(graph, wrt)``: the backward graph of ``graph`` (one output, the
    loss) with outputs ``[loss, d wrt_0, d wrt_1, ...]`` and an extra input
    ``d_output`` shaped like the loss. ``wrt`` lists Inputs / Params by node id or
    name; ``options`` is a ``GradWithLossOptions`` (default STRICT: a wrt with no
    gradient path is an error). The keyword names follow pyrlx (``graph=``,
    ``wrt=``)."""
    from rlx_jax.autodiff import GradWithLossOptions
    from rlx_jax.autodiff import grad as _graph_grad

    return _graph_grad(graph, wrt, GradWithLossOptions.STRICT if options is None else options)
