"""RLX serde JSON: ``graph.to_json()`` / ``Graph.from_json(text)``.

The layout is what ``serde_json`` makes of ``rlx_ir::Graph`` (externally tagged
enums)::

    {"name": "g",
     "nodes": [{"id": 0, "op": {"Input": {"name": "x"}}, "inputs": [],
                "shape": {"dims": [{"Static": 4}, {"Dynamic": 0}], "dtype": "F32"},
                "name": "x", "origin": null}, ...],
     "outputs": [3]}

Unit variants are bare strings (``"MatMul"``), newtype variants ``{"Activation":
"Gelu"}``, struct variants ``{"Reduce": {"op": "Sum", "axes": [1], "keep_dim":
false}}``; ``Vec<u8>`` (Constant data, Custom attrs) is an array of byte values; bodies
nest as graphs. Dynamic dims whose names are not the well-known ones are listed in an
extra top-level ``"dim_names"`` object (serde ignores unknown fields, so Rust still
loads the file). Loading validates everything and raises GraphError, never a
KeyError or a half-built graph.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import threading
import types
import typing

from .dtypes import DType
from .errors import GraphError, OpFault
from .op import (
    OP_CLASSES, ChainOperand, ChainStep, MaskKind, QuantScheme, ScaleMode, op_hints,
)
from .shape import MAX_DIM, WELL_KNOWN, Dynamic, Shape, symbol_for

#: refuse constants / attribute blobs beyond this many bytes
MAX_BYTES = 1 << 32
#: refuse bodies nested deeper than this
MAX_DEPTH = 64


class _Local(threading.local):
    def __init__(self):
        #: file symbol -> local symbol for the graph being loaded (from "dim_names")
        self.remap: dict = {}


_STATE = _Local()


class _Bad(Exception):
    """Internal: a malformed value (message says what and where)."""


# ---------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------

def _enc(value, names: dict):
    from .graph import Graph

    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, tuple):
        return [_enc(v, names) for v in value]
    if isinstance(value, Graph):
        return _graph_dict(value, names)
    if isinstance(value, MaskKind):
        return {"SlidingWindow": value.window} if value.kind == "SlidingWindow" else value.kind
    if isinstance(value, ScaleMode):
        return {"EMA": {"decay": value.decay}} if value.kind == "EMA" else value.kind
    if isinstance(value, QuantScheme):
        if value.block_size is not None:
            return {value.kind: {"block_size": value.block_size}}
        return value.kind
    if isinstance(value, ChainOperand):
        return {value.kind: value.index}
    if isinstance(value, ChainStep):
        ops = [_enc(o, names) for o in value.operands]
        if value.kind == "Where":
            return {"Where": ops}
        return {value.kind: [_enc(value.attr, names)] + ops}
    raise TypeError(f"cannot serialise {type(value).__name__}")


def op_to_json_value(op, names: dict | None = None):
    """The serde value of one op (a string or a one-key dict)."""
    names = {} if names is None else names
    cls = type(op)
    fields = dataclasses.fields(op)
    if cls._serde == "unit":
        return cls.__name__
    if cls._serde == "newtype":
        return {cls.__name__: _enc(getattr(op, fields[0].name), names)}
    omit = getattr(cls, "_omit_if_none", ())
    return {cls.__name__: {f.name: _enc(getattr(op, f.name), names) for f in fields
                           if not (f.name in omit and getattr(op, f.name) is None)}}


def _shape_dict(s: Shape, names: dict) -> dict:
    dims = []
    for d in s.dims:
        if isinstance(d, int):
            dims.append({"Static": d})
        else:
            dims.append({"Dynamic": d.symbol})
            if WELL_KNOWN.get(d.name) != d.symbol:
                names[str(d.symbol)] = d.name
    return {"dims": dims, "dtype": s.dtype.value}


def _graph_dict(g, names: dict) -> dict:
    nodes = []
    for n in g.nodes:
        nodes.append({
            "id": n.id,
            "op": op_to_json_value(n.op, names),
            "inputs": list(n.inputs),
            "shape": _shape_dict(n.shape, names),
            "name": n.name,
            "origin": n.origin,
        })
    return {"name": g.name, "nodes": nodes, "outputs": list(g.outputs)}


def graph_to_json(g, indent=None) -> str:
    names: dict = {}
    d = _graph_dict(g, names)
    if names:
        d["dim_names"] = names
    return json.dumps(d, indent=indent)


# ---------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tagged(v, where: str):
    """Split an externally tagged enum value into (variant, payload or None)."""
    if isinstance(v, str):
        return v, None
    if isinstance(v, dict) and len(v) == 1:
        (k, p), = v.items()
        return k, p
    raise _Bad(f"{where}: expected an enum variant (a string or a one-key object), got {_short(v)}")


def _short(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _dec(hint, v, where: str, depth: int):
    from .graph import Graph

    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if v is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _dec(inner, v, where, depth)
    if hint is int:
        if not _is_int(v):
            raise _Bad(f"{where}: expected an integer, got {_short(v)}")
        return v
    if hint is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"{where}: expected a number, got {_short(v)}")
        return float(v)
    if hint is bool:
        if not isinstance(v, bool):
            raise _Bad(f"{where}: expected true/false, got {_short(v)}")
        return v
    if hint is str:
        if not isinstance(v, str):
            raise _Bad(f"{where}: expected a string, got {_short(v)}")
        return v
    if hint is bytes:
        if not isinstance(v, list):
            raise _Bad(f"{where}: expected an array of bytes, got {_short(v)}")
        if len(v) > MAX_BYTES:
            raise _Bad(f"{where}: {len(v)} bytes exceeds the limit {MAX_BYTES}")
        if not all(_is_int(b) and 0 <= b <= 255 for b in v):
            raise _Bad(f"{where}: byte array holds a value outside 0..255")
        return bytes(v)
    if origin is tuple:
        if not isinstance(v, list):
            raise _Bad(f"{where}: expected an array, got {_short(v)}")
        return tuple(_dec(args[0], x, f"{where}[{i}]", depth) for i, x in enumerate(v))
    if hint is DType:
        if not isinstance(v, str) or v not in DType.__members__.values() and v not in [d.value for d in DType]:
            raise _Bad(f"{where}: unknown dtype {_short(v)}")
        return DType(v)
    if hint is Graph:
        return _graph_from(v, where, depth + 1)
    if hint is MaskKind:
        k, p = _tagged(v, where)
        if k not in ("None", "Causal", "SlidingWindow", "Custom", "Bias"):
            raise _Bad(f"{where}: unknown mask kind {k!r} (None, Causal, SlidingWindow, Custom, Bias)")
        if k == "SlidingWindow":
            if not _is_int(p):
                raise _Bad(f"{where}: SlidingWindow needs an integer window")
            return MaskKind("SlidingWindow", p)
        if p is not None:
            raise _Bad(f"{where}: mask kind {k!r} takes no payload")
        return MaskKind(k)
    if hint is ScaleMode:
        k, p = _tagged(v, where)
        if k == "EMA":
            if not isinstance(p, dict) or set(p) != {"decay"}:
                raise _Bad(f"{where}: EMA needs {{\"decay\": <float>}}")
            return ScaleMode("EMA", _dec(float, p["decay"], where + ".decay", depth))
        if p is not None:
            raise _Bad(f"{where}: scale mode {k!r} takes no payload")
        return ScaleMode(k)
    if hint is QuantScheme:
        k, p = _tagged(v, where)
        if p is None:
            return QuantScheme(k)
        if not isinstance(p, dict) or set(p) != {"block_size"}:
            raise _Bad(f"{where}: quant scheme {k!r} needs {{\"block_size\": <int>}}")
        return QuantScheme(k, _dec(int, p["block_size"], where + ".block_size", depth))
    if hint is ChainStep:
        k, p = _tagged(v, where)
        if not isinstance(p, list):
            raise _Bad(f"{where}: chain step {k!r} needs an array payload")
        if k == "Where":
            return ChainStep("Where", None, tuple(_dec(ChainOperand, o, where, depth) for o in p))
        if not p:
            raise _Bad(f"{where}: chain step {k!r} has an empty payload")
        return ChainStep(k, p[0], tuple(_dec(ChainOperand, o, where, depth) for o in p[1:]))
    if hint is ChainOperand:
        k, p = _tagged(v, where)
        if not _is_int(p):
            raise _Bad(f"{where}: chain operand needs an integer index")
        return ChainOperand(k, p)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if not isinstance(v, str):
            raise _Bad(f"{where}: expected a {hint.__name__} variant name, got {_short(v)}")
        try:
            return hint(v)
        except ValueError:
            raise _Bad(
                f"{where}: unknown {hint.__name__} {v!r} (expected one of "
                + ", ".join(m.value for m in hint) + ")"
            ) from None
    raise _Bad(f"{where}: unsupported field type {hint!r}")


def op_from_json_value(v, where: str = "op", depth: int = 0):
    """Decode one op value (raises GraphError)."""
    try:
        return _op_from(v, where, depth)
    except _Bad as exc:
        raise GraphError(str(exc)) from None


def _op_from(v, where: str, depth: int):
    try:
        return _op_from_inner(v, where, depth)
    except OpFault as exc:  # a bad enum payload (mask kind, scheme, chain step, ...)
        raise _Bad(f"{where}: {exc}") from None


def _op_from_inner(v, where: str, depth: int):
    variant, payload = _tagged(v, where)
    cls = OP_CLASSES.get(variant)
    if cls is None:
        raise _Bad(f"{where}: unknown op variant {variant!r}")
    hints = op_hints(cls)
    fields = dataclasses.fields(cls)
    kwargs = {}
    if cls._serde == "unit":
        if payload is not None:
            raise _Bad(f"{where}: op {variant} takes no attributes, got {_short(payload)}")
    elif cls._serde == "newtype":
        if payload is None:
            raise _Bad(f"{where}: op {variant} needs a value")
        f = fields[0]
        kwargs[f.name] = _dec(hints[f.name], payload, f"{where}.{variant}", depth)
    else:
        if not isinstance(payload, dict):
            raise _Bad(f"{where}: op {variant} needs an object of attributes, got {_short(payload)}")
        known = {f.name for f in fields}
        extra = set(payload) - known
        if extra:
            raise _Bad(f"{where}: op {variant} has unknown attribute(s) {sorted(extra)}")
        for f in fields:
            hint = hints[f.name]
            optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
            if f.name not in payload:
                if optional:
                    kwargs[f.name] = None
                    continue
                raise _Bad(f"{where}: op {variant} is missing attribute {f.name!r}")
            kwargs[f.name] = _dec(hint, payload[f.name], f"{where}.{f.name}", depth)
    try:
        return cls(**kwargs)
    except OpFault as exc:
        raise _Bad(f"{where}: bad {variant} attributes: {exc}") from None


def _shape_from(v, where: str) -> Shape:
    if not isinstance(v, dict) or set(v) != {"dims", "dtype"}:
        raise _Bad(f"{where}: shape must be {{\"dims\": [...], \"dtype\": ...}}, got {_short(v)}")
    dims_v = v["dims"]
    if not isinstance(dims_v, list):
        raise _Bad(f"{where}: dims must be an array")
    if len(dims_v) > 64:
        raise _Bad(f"{where}: rank {len(dims_v)} exceeds 64")
    dims = []
    total = 1
    for i, d in enumerate(dims_v):
        k, p = _tagged(d, f"{where}.dims[{i}]")
        if k == "Static":
            if not _is_int(p) or not 0 <= p <= MAX_DIM:
                raise _Bad(f"{where}.dims[{i}]: static dim must be an integer in 0..{MAX_DIM}")
            total *= p
            if total > MAX_DIM:
                raise _Bad(f"{where}: shape declares more than {MAX_DIM} elements")
            dims.append(p)
        elif k == "Dynamic":
            if not _is_int(p) or not 0 <= p < 2**32:
                raise _Bad(f"{where}.dims[{i}]: dynamic symbol must be a u32")
            dims.append(Dynamic(_STATE.remap.get(p, p)))
        else:
            raise _Bad(f"{where}.dims[{i}]: unknown dim variant {k!r} (Static or Dynamic)")
    dt = v["dtype"]
    if not isinstance(dt, str) or dt not in [d.value for d in DType]:
        raise _Bad(f"{where}: unknown dtype {_short(dt)}")
    return Shape(tuple(dims), DType(dt))


_NODE_KEYS = {"id", "op", "inputs", "shape", "name", "origin"}


def _graph_from(v, where: str, depth: int):
    from .graph import Graph

    if depth > MAX_DEPTH:
        raise _Bad(f"{where}: bodies nested deeper than {MAX_DEPTH}")
    if not isinstance(v, dict):
        raise _Bad(f"{where}: a graph must be an object, got {_short(v)}")
    for key in ("name", "nodes", "outputs"):
        if key not in v:
            raise _Bad(f"{where}: graph is missing {key!r}")
    if not isinstance(v["name"], str):
        raise _Bad(f"{where}: graph name must be a string")
    if not isinstance(v["nodes"], list) or not isinstance(v["outputs"], list):
        raise _Bad(f"{where}: graph nodes and outputs must be arrays")
    g = Graph(v["name"])
    gw = f"{where} (graph {v['name']!r})"
    for pos, nv in enumerate(v["nodes"]):
        nw = f"{gw} node #{pos}"
        if not isinstance(nv, dict):
            raise _Bad(f"{nw}: a node must be an object")
        missing = {"id", "op", "inputs", "shape"} - set(nv)
        if missing:
            raise _Bad(f"{nw}: missing {sorted(missing)}")
        extra = set(nv) - _NODE_KEYS
        if extra:
            raise _Bad(f"{nw}: unknown node field(s) {sorted(extra)}")
        if nv["id"] != pos or not _is_int(nv["id"]):
            raise _Bad(f"{nw}: id {_short(nv['id'])} does not match its position {pos}")
        name = nv.get("name")
        if name is not None and not isinstance(name, str):
            raise _Bad(f"{nw}: name must be a string or null")
        origin = nv.get("origin")
        if origin is not None and not isinstance(origin, dict):
            raise _Bad(f"{nw}: origin must be an object or null")
        ins = nv["inputs"]
        if not isinstance(ins, list) or not all(_is_int(i) for i in ins):
            raise _Bad(f"{nw}: inputs must be an array of node ids")
        op = _op_from(nv["op"], f"{gw} node %{pos} op", depth)
        shape = _shape_from(nv["shape"], f"{gw} node %{pos} shape")
        try:
            g.add_node(op, tuple(ins), shape, name, origin)
        except GraphError as exc:
            raise _Bad(f"{gw}: {exc}") from None
    outs = v["outputs"]
    if not all(_is_int(o) and 0 <= o < len(g.nodes) for o in outs):
        raise _Bad(f"{gw}: outputs {_short(outs)} name nodes that do not exist")
    g.outputs = list(outs)
    return g


def graph_from_json(text):
    """Parse RLX serde JSON text (str/bytes) or an already parsed dict."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GraphError(f"graph JSON is not UTF-8: {exc}") from None
    if isinstance(text, str):
        try:
            v = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GraphError(f"graph JSON does not parse: {exc}") from None
    elif isinstance(text, dict):
        v = text
    else:
        raise GraphError(f"from_json expects a JSON string, got {type(text).__name__}")
    if isinstance(v, dict) and "dim_names" in v:
        names = v["dim_names"]
        if not isinstance(names, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(n, str) and n for k, n in names.items()
        ):
            raise GraphError("graph JSON: dim_names must map symbol strings to names")
        _STATE.remap = {int(k): symbol_for(n) for k, n in names.items()}
        v = {k: x for k, x in v.items() if k != "dim_names"}
    else:
        _STATE.remap = {}
    try:
        return _graph_from(v, "graph JSON", 0)
    except _Bad as exc:
        raise GraphError(str(exc)) from None
    except RecursionError:
        raise GraphError("graph JSON nests too deeply") from None
