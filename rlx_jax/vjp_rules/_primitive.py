"""``FusedPrimitive``: a JAX primitive whose value is defined by a pure-JAX reference
and whose lowering calls a compiled FFI kernel where one is registered.

Every rule a JAX primitive needs is given a sound default derived from the reference:

- abstract evaluation: ``jax.eval_shape`` of the reference;
- lowering: per platform ("cpu", "cuda"), the kernel when ``has_kernel`` says its target
  is registered and the operand dtypes are ones the kernel takes, else the reference;
- JVP: ``jax.jvp`` of the reference (used for forward mode and second order);
- batching: ``jax.vmap`` of the reference.

Families override the JVP (to route tangents through a linear primitive), the batching
rule (to keep the kernel under vmap) and, for linear primitives, give a transpose rule
(whose body calls the backward kernel). That is how one op gets forward mode, reverse
mode through the fused backward, and higher orders, from one definition.
"""

from __future__ import annotations

import contextlib
import threading
import math
from functools import partial
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax._src.sharding_impls import parse_flatten_op_sharding  # no public API reads an HLO sharding
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from rlx_jax._kernels import has_kernel

#: how a batching rule marks an operand without a batch axis
NOT_MAPPED = None

#: dtypes the compiled kernels take, per platform
KERNEL_DTYPES = {
    "cpu": (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16),
    "cuda": (jnp.float32, jnp.bfloat16, jnp.float16),
}


_FUSED = threading.local()


def fused_ops_enabled() -> bool:
    return getattr(_FUSED, "enabled", True)


@contextlib.contextmanager
def fused_ops(enabled: bool):
    """Within this context (per thread, at trace time), fused ops bind their primitives
    (``enabled=True``, the default) or run their pure-JAX references directly, so JAX
    differentiates the reference maths itself (``enabled=False``: plain XLA autodiff, the
    baseline the fused kernels are compared with). jit caches do not see this switch:
    trace a function under the setting it should keep."""
    previous = fused_ops_enabled()
    _FUSED.enabled = bool(enabled)
    try:
        yield
    finally:
        _FUSED.enabled = previous


def instantiate(tangents: Iterable, primals: Iterable) -> list:
    """Symbolic-zero tangents -> explicit zeros shaped like their primals."""
    out = []
    for t, p in zip(tangents, primals):
        if type(t) is ad.Zero:
            t = jnp.zeros(jnp.shape(p), dtype=jax.dtypes.float0 if not _is_float(p) else jnp.result_type(p))
        out.append(t)
    return out


# ---- shard_map's varying manual axes ----------------------------------------------------
# Inside jax.shard_map (check_vma=True, its default) every value's type records the manual
# mesh axes it varies over. JAX's own primitives take operands varying alike (it inserts a
# no-op cast, ``pcast(..., to="varying")``, on the others) and give results varying over
# them; differentiating that cast sums its operand's cotangent over those axes. A fused op
# must do the same: results typed as not varying would make JAX skip that sum, so a
# replicated parameter's gradient would hold one device's share.


def varying_axes(aval) -> frozenset:
    """The manual mesh axes ``aval`` varies over (empty outside shard_map)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def vary_alike(args: Sequence) -> list:
    """``args`` with each one varying over every manual axis any of them varies over."""
    axes = [varying_axes(jax.typeof(a)) if isinstance(a, jax.Array) else frozenset() for a in args]
    union = frozenset().union(*axes)
    if not union:
        return list(args)
    return [a if mine == union else jax.lax.pcast(a, tuple(sorted(union - mine)), to="varying")
            for a, mine in zip(args, axes)]


def varying_like(avals: Sequence, shape, dtype) -> ShapedArray:
    """A result aval of ``shape`` / ``dtype`` varying as the operands (after
    :func:`vary_alike`, all alike) vary."""
    source = next((a for a in avals if varying_axes(a)), None)
    if source is None:
        return ShapedArray(shape, dtype)
    return source.update(shape=tuple(shape), dtype=dtype, weak_type=False)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class FusedPrimitive:
    """A multiple-results primitive named ``name`` computing ``reference(*args, **params)``.

    ``kernel(*args, **params)`` (optional) emits the ``jax.ffi.ffi_call`` of FFI target
    ``target``; it may also be a dict ``{platform: kernel}`` when a platform's call
    differs (the CUDA backward kernels request an extra scratch result, say); a platform
    missing from the dict lowers the reference. A kernel is used on a platform when the
    target is registered there and
    ``kernel_ok(*avals, **params)`` (default: every floating operand has a dtype in
    ``KERNEL_DTYPES[platform]``) accepts the operands. On the platforms in
    ``static_only`` the kernel also needs every dim known (``static_shape``): its
    scratch result's size is not a polynomial in jax.export's symbolic dims.
    """

    def __init__(
        self,
        name: str,
        reference: Callable,
        *,
        target: str | None = None,
        kernel: Callable | dict[str, Callable] | None = None,
        kernel_ok: Callable | None = None,
        platforms: Sequence[str] = ("cpu", "cuda"),
        partition: "Partition | None" = None,
        static_only: Sequence[str] = (),
    ):
        self.name = name
        self.static_only = tuple(static_only)
        self.partition = partition
        self.reference = reference
        self.target = target
        self.kernel = kernel
        self.kernel_ok = kernel_ok
        p = Primitive(name)
        p.multiple_results = True
        p.def_impl(partial(dispatch.apply_primitive, p))
        p.def_abstract_eval(self._abstract_eval)
        mlir.register_lowering(p, self._lowering(None))
        if kernel is not None:
            for platform in platforms:
                if self._kernel_for(platform) is not None:
                    mlir.register_lowering(p, self._lowering(platform), platform=platform)
        if partition is not None:
            # custom_partitioning inside our lowering needs the device assignment
            dispatch.prim_requires_devices_during_lowering.add(p)
        ad.primitive_jvps[p] = self._reference_jvp
        batching.primitive_batchers[p] = self._reference_batch
        self.p = p

    # -- binding ------------------------------------------------------------------
    def __call__(self, *args, **params):
        if not fused_ops_enabled():
            return self.reference(*args, **params)
        return self.p.bind(*vary_alike(args), **params)

    # -- default rules ------------------------------------------------------------
    def _abstract_eval(self, *avals, **params):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        out = jax.eval_shape(partial(self.reference, **params), *specs)
        return [varying_like(avals, o.shape, o.dtype) for o in out]

    def _kernel_for(self, platform: str | None) -> Callable | None:
        if isinstance(self.kernel, dict):
            return self.kernel.get(platform)
        return self.kernel

    def _use_kernel(self, platform: str | None, avals, params) -> bool:
        if platform is None or self._kernel_for(platform) is None or not has_kernel(platform, self.target):
            return False
        if platform in self.static_only and not static_shape(*(a.shape for a in avals)):
            return False
        if self.kernel_ok is not None:
            return bool(self.kernel_ok(*avals, **params))
        allowed = KERNEL_DTYPES.get(platform, ())
        return all(a.dtype in allowed for a in avals if jnp.issubdtype(a.dtype, jnp.inexact))

    def _lowering(self, platform: str | None):
        def lower(ctx, *args, **params):
            use = self._use_kernel(platform, ctx.avals_in, params)
            fn = partial(self._kernel_for(platform) if use else self.reference, **params)
            if use and self.partition is not None:
                # an opaque kernel call would be replicated under SPMD: say how it splits
                fn = self.partition.wrap(fn, ctx.avals_in, ctx.avals_out, params)
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

        return lower

    def _reference_jvp(self, primals, tangents, **params):
        tangents = instantiate(tangents, primals)
        out, t_out = jax.jvp(partial(self.reference, **params), tuple(primals), tuple(tangents))
        return list(out), list(t_out)

    def _reference_batch(self, args, dims, **params):
        in_axes = tuple(None if d is NOT_MAPPED else d for d in dims)
        out = jax.vmap(partial(self.reference, **params), in_axes=in_axes)(*args)
        return list(out), [0] * len(out)

    # -- overrides ----------------------------------------------------------------
    def def_jvp(self, rule: Callable) -> Callable:
        """``rule(primals, tangents, **params) -> (outs, tangent_outs)``."""
        ad.primitive_jvps[self.p] = rule
        return rule

    def def_batching(self, rule: Callable) -> Callable:
        """``rule(args, dims, **params) -> (outs, out_dims)``."""
        batching.primitive_batchers[self.p] = rule
        return rule

    def def_transpose(self, rule: Callable) -> Callable:
        """For a primitive linear in some operands: ``rule(cts, *args, **params)`` with
        the linear operands given as ``ad.UndefinedPrimal``; returns one cotangent (or
        None) per operand."""
        ad.primitive_transposes[self.p] = rule
        return rule


def rowwise_batching(prim: FusedPrimitive, row_args: Sequence[int]) -> Callable:
    """Batching rule for a kernel over rows of its last axis whose outputs are all
    shaped like its row operands (a forward or a tangent, not a backward that reduces
    over rows). When only the operands in ``row_args`` are batched, the batch axis is
    moved to the front of each of them (unbatched row operands are broadcast) and the
    kernel runs on the enlarged row set. Any other batched operand (a batched gamma,
    say) falls back to ``vmap`` of the reference."""
    row_args = tuple(row_args)

    def rule(args, dims, **params):
        if any(d is not NOT_MAPPED for i, d in enumerate(dims) if i not in row_args):
            return prim._reference_batch(args, dims, **params)
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
        moved = list(args)
        for i in row_args:
            a, d = args[i], dims[i]
            if d is NOT_MAPPED:
                moved[i] = jnp.broadcast_to(a, (size, *jnp.shape(a)))
            else:
                moved[i] = jnp.moveaxis(a, d, 0)
        outs = prim(*moved, **params)
        return outs, [0] * len(outs)

    return rule


def sequential_batching(prim: FusedPrimitive) -> Callable:
    """Batching rule that runs the primitive once per element of the vmapped axis
    (``lax.map`` over the batched operands, the unbatched ones shared): the kernel keeps
    running under vmap and the temporaries stay those of one element, where ``vmap`` of
    the reference would run XLA's code on every element at once. For primitives whose
    memory bound is the point (the fused linear + cross-entropy: one logits block at a
    time) and whose operands do not fold into a larger call of the same primitive (a
    reduced loss's mean is per element)."""

    def rule(args, dims, **params):
        batched = tuple(jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not NOT_MAPPED)

        def one(xs):
            it = iter(xs)
            return tuple(prim(*(next(it) if d is not NOT_MAPPED else a for a, d in zip(args, dims)), **params))

        outs = jax.lax.map(one, batched)
        return list(outs), [0] * len(outs)

    return rule


class Partition:
    """How a kernel call splits under SPMD sharding (``custom_partitioning``), so that
    a sharded ``jit`` runs it on each shard instead of gathering its operands.

    ``factors(avals_in, avals_out, **params)`` names the axes of every operand and
    result (einsum style, e.g. q = ("b", "s", "h", "d")) and may return a third item,
    ``{factor: size}``, for compound axes: an axis named by a tuple of factors, major
    first (("h", "g"): an axis of H = Hkv * G query heads, h the kv head, g the member of
    its group), is sharded through its major factor only, and the sizes of its minor
    factors must be given. Factors in ``shardable`` keep the mesh axes they have on the
    first operand that carries them (on a compound axis: when the mesh axes divide its
    major factor); every other axis is replicated, and a factor whose dims the mesh axes
    do not divide is replicated too. A result lacking a sharded factor is a sum over
    that factor (a parameter gradient summed over rows): each shard computes its partial
    sum and they are added with a psum over the factor's mesh axes.
    """

    #: factors that claim their mesh axes before the others when two factors arrive sharded
    #: over one mesh axis (else the first factor met, in operand order, keeps it)
    priority: frozenset = frozenset()

    def __init__(self, factors: Callable, shardable: Iterable[str]):
        self.factors = factors
        self.shardable = frozenset(shardable)

    def _factors(self, avals_in, avals_out, params):
        """(f_in, f_out, sizes) with every axis a tuple of factors (major first)."""
        got = self.factors(avals_in, avals_out, **params)
        f_in, f_out = got[0], got[1]
        sizes = dict(got[2]) if len(got) > 2 else {}
        norm = lambda fss: [tuple(f if isinstance(f, tuple) else (f,) for f in fs) for fs in fss]
        return norm(f_in), norm(f_out), sizes

    @staticmethod
    def _carriers(fss, avals, sizes):
        """Per axis, (the factor a sharding of the axis falls on, its size): a plain axis'
        own factor; a compound axis' major factor (a contiguous split of the axis into
        shards that the major factor's size divides is a split of that factor)."""
        out = []
        for fs, a in zip(fss, avals):
            row = []
            for axis, d in zip(fs, a.shape):
                minor = math.prod(sizes[f] for f in axis[1:])
                row.append((axis[0], d // minor if minor else 0))
            out.append(tuple(row))
        return out

    @staticmethod
    def _mesh_spec(sharding, mesh, ndim) -> tuple:
        """An operand's sharding as mesh axes per dim (PartitionSpec entries). The partition
        gets the HLO sharding undecoded (``decode_shardings=False``): a dim split over part
        of a mesh axis has no PartitionSpec over the mesh (Shardy makes such sub-axes, e.g.
        4 devices on [32] reshaped to [2, 16] put 2 on each dim), and JAX's own decoding
        raises on it before the partition runs. Such an operand reads as unsharded here: the
        partition asks for a sharding it can use, and XLA reshards the operand to it."""
        if sharding is None:
            return ()
        if hasattr(sharding, "spec"):
            return tuple(sharding.spec)
        if mesh.empty:
            return ()
        try:
            return tuple(parse_flatten_op_sharding(sharding._to_xla_hlo_sharding(ndim), mesh)[0])
        except (ValueError, NotImplementedError):  # IndivisibleError is a ValueError
            return ()

    def _assign(self, mesh, arg_shapes, c_in) -> dict:
        """factor -> tuple of mesh axis names (only sharded, divisible factors)."""
        assign: dict = {}
        for a, cs in zip(arg_shapes, c_in):
            spec = self._mesh_spec(a.sharding, mesh, len(cs))
            spec = spec + (None,) * (len(cs) - len(spec))
            for (f, _), entry in zip(cs, spec):
                if f in self.shardable and f not in assign and entry is not None:
                    assign[f] = entry if isinstance(entry, tuple) else (entry,)
        mesh_sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        dims: dict = {}
        for cs in c_in:
            for f, size in cs:
                dims.setdefault(f, set()).add(size)
        ok, used = {}, set()
        for f, axes in sorted(assign.items(), key=lambda item: item[0] not in self.priority):
            n = math.prod(mesh_sizes[ax] for ax in axes)
            # a mesh axis splits one factor only: operands sharded over one mesh axis on
            # different factors (x on its rows, dy on its columns) keep the first such factor
            # (a ``priority`` factor first), and the other operand is resharded to match
            if all(d % n == 0 for d in dims.get(f, ())) and used.isdisjoint(axes):
                ok[f] = axes
                used.update(axes)
        return ok

    @staticmethod
    def _spec(cs, assign):
        return PartitionSpec(*[assign.get(f) for f, _ in cs])

    @staticmethod
    def sharding_rule(f_in, f_out) -> str:
        """The einsum-style rule Shardy propagates shardings with. A compound axis is one
        factor of its own there (("h", "g") -> "hg"), not "(h g)": given "(h g)", Shardy splits
        a mesh axis that the major factor's size does not divide over both factors (4 devices
        on H = 2 * 2 heads: a 2-device sub-axis on h, another on g), and custom_partitioning
        cannot decode such sub-axis shardings into the mesh (IndivisibleError before the
        partition callback runs). The callback still maps the axis to its major factor."""
        name = lambda axis: "".join(axis)
        side = lambda fss: ", ".join(" ".join(name(ax) for ax in fs) for fs in fss)
        return side(f_in) + " -> " + side(f_out)

    def _local_body(self, fn: Callable, mesh, assign: dict, c_out, avals_in, params: dict) -> Callable:
        """The per-shard computation: ``fn`` on the local blocks, then a psum of each
        result lacking a sharded factor (a parameter gradient summed over rows, or a kv
        head's gradient summed over its group) over that factor's mesh axes. Subclasses
        whose shards need other collectives override this."""
        present = [{f for f, _ in cs} for cs in c_out]
        reduce_axes = [tuple(ax for f, axes in assign.items() if f not in have for ax in axes)
                       for have in present]

        def local(*xs):
            results = list(fn(*xs))
            for j, axes in enumerate(reduce_axes):
                if axes:
                    results[j] = jax.lax.psum(results[j], axes)
            return tuple(results)

        return local

    def wrap(self, fn: Callable, avals_in, avals_out, params: dict) -> Callable:
        f_in, f_out, sizes = self._factors(avals_in, avals_out, params)
        c_in, c_out = self._carriers(f_in, avals_in, sizes), self._carriers(f_out, avals_out, sizes)

        def kernel_call(*xs):  # custom_partitioning wants a plain positional function
            return tuple(fn(*xs))

        wrapped = custom_partitioning(kernel_call)

        def infer(mesh, arg_shapes, result_shape):
            assign = self._assign(mesh, arg_shapes, c_in)
            return tuple(NamedSharding(mesh, self._spec(cs, assign)) for cs in c_out)

        def partition(mesh, arg_shapes, result_shape):
            assign = self._assign(mesh, arg_shapes, c_in)
            args = tuple(NamedSharding(mesh, self._spec(cs, assign)) for cs in c_in)
            outs = tuple(NamedSharding(mesh, self._spec(cs, assign)) for cs in c_out)
            return mesh, self._local_body(fn, mesh, assign, c_out, avals_in, params), outs, args

        wrapped.def_partition(infer_sharding_from_operands=infer, partition=partition,
                              sharding_rule=self.sharding_rule(f_in, f_out), decode_shardings=False)
        return wrapped


def RowPartition(row_args: Sequence[int], stat_args=(), row_outputs=(0,), stat_outputs=()) -> Partition:
    """The partition of a kernel over rows of its last axis: operands in ``row_args``
    are [rows..., H] (rows may be sharded any way, H is kept whole), ``stat_args`` and
    ``stat_outputs`` are [rows...], ``row_outputs`` are [rows..., H]; other operands are
    replicated and other results are sums over the rows (parameter gradients)."""
    row_args, stat_args = tuple(row_args), tuple(stat_args)
    row_outputs, stat_outputs = tuple(row_outputs), tuple(stat_outputs)

    def factors(avals_in, avals_out, **params):
        lead = len(avals_in[row_args[0]].shape) - 1
        rows = tuple(f"r{i}" for i in range(lead))
        counter = iter(range(10**6))

        def own(rank):
            return tuple(f"u{next(counter)}" for _ in range(rank))

        f_in = [rows + ("h",) if i in row_args else rows if i in stat_args else own(len(a.shape))
                for i, a in enumerate(avals_in)]
        f_out = [rows + ("h",) if j in row_outputs else rows if j in stat_outputs else own(len(a.shape))
                 for j, a in enumerate(avals_out)]
        return f_in, f_out

    return Partition(factors, shardable=[f"r{i}" for i in range(32)])


def static_shape(*shapes) -> bool:
    """Whether every dim of ``shapes`` is known: jax.export's symbolic dims (a batch size
    fixed only at run time) cannot size a CUDA kernel's scratch where that size is not a
    polynomial in them; such calls lower the reference."""
    return all(isinstance(d, (int, np.integer)) for s in shapes for d in s)


def np_scalar(value: float, dtype=np.float32):
    """FFI attributes are typed: pass scalars as numpy scalars of the declared type."""
    return np.dtype(dtype).type(value)
