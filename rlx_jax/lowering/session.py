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

_DEVICE_ALIASES = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "nvidia": "gpu", "tpu": "tpu"}
# devices pyrlx knows whose backends rlx_jax does not provide
_OTHER_DEVICES = ("metal", "vulkan", "opengl", "directx", "webgpu", "rocm", "wgpu")
_PRECISIONS = {"f32": np.float32, "f16": np.float16, "bf16": jnp.bfloat16}


def _platform_present(platform: str) -> bool:
    try:
        return len(jax.devices(platform)) > 0
    except RuntimeError:
        return False


def _parse_device(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"device must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _DEVICE_ALIASES:
        return _DEVICE_ALIASES[key]
    if key in _OTHER_DEVICES:
        return key
    raise ValueError(
        f"unknown device {name!r}; expected one of {sorted(set(_DEVICE_ALIASES) | set(_OTHER_DEVICES))}"
    )


def available_devices() -> list[str]:
    """Devices a Session can use here, in pyrlx's labels ("cpu", "cuda", "tpu")."""
    out = ["cpu"] if _platform_present("cpu") else []
    if _platform_present("gpu"):
        out.append("cuda")
    if _platform_present("tpu"):
        out.append("tpu")
    return out


def is_available(name: str) -> bool:
    """Whether ``Session(name)`` would work (unknown names raise ``ValueError``)."""
    platform = _parse_device(name)
    if platform in _OTHER_DEVICES:
        return False
    return _platform_present(platform)


def _dtype_from_str(dtype) -> np.dtype:
    from rlx_jax.ir import DType

    try:
        return np.dtype(DType.from_any(dtype).to_numpy())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc


def _dtype_label(dt) -> str:
    from rlx_jax.ir import DType

    return DType.from_any(np.dtype(dt)).short


def _conform(what: str, node, arr: np.ndarray) -> np.ndarray:
    """pyrlx reads arrays as flat buffers: a 1-D array whose element count fills the
    declared shape (one dynamic dim inferred from the count) is reshaped to it; anything
    else is left for the shape check to reject."""
    dims = list(node.shape.dims)
    if arr.ndim != 1 or len(dims) == 1:
        return arr
    dyn = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    static = int(np.prod([d for d in dims if isinstance(d, int)])) if dims else 1
    if not dyn and arr.size == static:
        return arr.reshape(dims)
    if len(dyn) == 1 and static and arr.size % static == 0:
        dims[dyn[0]] = arr.size // static
        return arr.reshape(dims)
    return arr


class Session:
    """``Session(device="cpu", precision="f32")``: where and at what float precision
    compiled graphs run ("f16"/"bf16" compute f32 tensors in that type; inputs and
    outputs stay f32)."""

    def __init__(self, device: str = "cpu", precision: str = "f32"):
        platform = _parse_device(device)
        if platform in _OTHER_DEVICES or not _platform_present(platform):
            raise RuntimeError(
                f"device {device!r} is not available here; available: {available_devices()}")
        if not isinstance(precision, str) or precision.lower() not in _PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {precision!r}")
        self._platform = platform
        self._device = jax.devices(platform)[0]
        self._label = "cpu" if platform == "cpu" else ("cuda" if platform == "gpu" else platform)
        self._precision = precision.lower()

    @property
    def device(self) -> str:
        return self._label

    @property
    def precision(self) -> str:
        return self._precision

    def compile(self, graph) -> "CompiledGraph":
        """Lower ``graph`` and return a :class:`CompiledGraph` (the graph is not
        consumed: rlx_jax graphs are values)."""
        return CompiledGraph(graph, self)

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
        """Upload parameter ``name`` (an array of the declared shape)."""
        node = self._param_node(name)
        arr = np.asarray(data)
        want = np.dtype(jnp_dtype(node.shape.dtype))
        if arr.dtype != want:
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"set_param({name!r}): expected a numeric array, got {arr.dtype}")
            arr = arr.astype(want)
        arr = _conform(f"set_param({name!r})", node, arr)
        self._check_static(f"set_param({name!r})", node, arr.shape)
        self._params[name] = arr

    def set_param_typed(self, name: str, data: bytes, dtype: str) -> None:
        """Upload parameter ``name`` from raw bytes of ``dtype`` (it must be the
        declared dtype, e.g. "f64")."""
        node = self._param_node(name)
        self._params[name] = self._decode(f"set_param_typed({name!r})", node, data, dtype)

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
            out[name] = _conform(f"input {name!r}", node, arr)
        return out

    def _call(self, inputs: dict) -> list:
        inputs = self._prepare(inputs)
        if self._x64:  # f64 / i64 tensors stay 64-bit (scoped; the global flag is untouched)
            with jax.enable_x64(True):
                return self._execute(inputs)
        return self._execute(inputs)

    def _execute(self, inputs: dict) -> list:
        dev = self._session._device
        outs = self._fn(jax.device_put(self._params, dev), jax.device_put(inputs, dev))
        result = []
        for o, oid in zip(outs, self._graph.outputs):
            arr = np.asarray(o)
            want = np.dtype(jnp_dtype(self._graph.node(oid).shape.dtype))
            if arr.dtype != want:
                arr = arr.astype(want)
            result.append(arr)
        return result

    def run(self, inputs: dict) -> list:
        """``run({name: array}) -> list[np.ndarray]`` (one per graph output)."""
        return self._call(inputs)

    def run_flat(self, inputs: dict) -> list:
        """Like ``run`` with each output flattened to 1-D (pyrlx's flat-vector run)."""
        return [o.reshape(-1) for o in self._call(inputs)]

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
