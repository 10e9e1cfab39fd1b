"""Tiny graphs, one per differentiable op (and per interesting attribute), shared by
the graph-autodiff tests. Each case builds the op on Params (float leaves, the wrt
set) and Inputs (integer / boolean leaves) and returns the op's node; ``feeds`` draws
values (leaves named ``pos*`` are positive; integer leaves need an explicit feed)."""

from __future__ import annotations

import numpy as np

from rlx_jax.ir import Graph

CASES = {}


def case(name, **feeds):
    def deco(fn):
        CASES[name] = (fn, feeds)
        return fn
    return deco


def feeds_for(g, explicit, rng):
    params, inputs = {}, {}
    for n in g.nodes:
        kind = type(n.op).__name__
        if kind not in ("Param", "Input"):
            continue
        name = n.op.name
        dt = n.shape.dtype.to_numpy()
        shape = tuple(n.shape.dims)
        if name in explicit:
            v = np.asarray(explicit[name](rng) if callable(explicit[name]) else explicit[name]).astype(dt)
        elif n.shape.dtype.short == "c64":
            v = (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(dt)
        elif name.startswith("pos"):
            v = rng.uniform(0.5, 2.0, shape).astype(dt)
        else:
            v = rng.randn(*shape).astype(dt)
        (params if kind == "Param" else inputs)[name] = v
    return params, inputs


ACTS = ["gelu", "gelu_approx", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt",
        "neg", "abs", "sin", "cos", "tan", "atan", "round"]

for _k in ACTS:
    def _mk(k):
        def build(g):
            x = g.param("pos_x" if k in ("log", "sqrt", "rsqrt") else "x", [3, 4])
            return g.activation(k, x)
        return build
    case(f"act_{_k}")(_mk(_k))

for _op in ["add", "sub", "mul", "div", "max", "min", "pow"]:
    def _mk(op):
        def build(g):
            a = g.param("pos_a" if op == "pow" else "a", [3, 4])
            b = g.param("pos_b" if op == "div" else "b", [4])
            return g.binary(op, a, b)
        return build
    case(f"binary_{_op}")(_mk(_op))


@case("where_compare")
def _(g):
    a, b = g.param("a", [3, 4]), g.param("b", [3, 4])
    return g.where_(g.gt_(a, b), a, g.mul(b, b))


@case("cast_roundtrip")
def _(g):
    x = g.param("x", [3, 4])
    return g.cast(g.mul(g.cast(x, "f16"), g.cast(x, "f16")), "f32")


@case("stop_gradient")
def _(g):
    x = g.param("x", [3, 4])
    return g.mul(x, g.stop_gradient(g.exp(x)))


@case("reshape_transpose")
def _(g):
    x = g.param("x", [2, 3, 4])
    return g.transpose(g.reshape(x, [6, 4]), [1, 0])


@case("narrow")
def _(g):
    return g.narrow(g.param("x", [3, 7]), 1, 2, 3)


@case("concat")
def _(g):
    return g.concat([g.param("a", [2, 3]), g.param("b", [2, 1]), g.param("c", [2, 2])], 1)


@case("expand")
def _(g):
    return g.expand(g.param("x", [3, 1]), [2, 3, 4])


@case("gather_axis0", idx=lambda r: r.randint(0, 5, (6,)))
def _(g):
    return g.gather(g.param("t", [5, 3]), g.input("idx", [6], "i32"), 0)


@case("gather_axis1", idx=lambda r: r.randint(0, 5, (2, 3)))
def _(g):
    return g.gather(g.param("t", [2, 5, 3]), g.input("idx", [2, 3], "i32"), 1)


@case("resize_nearest_2x")
def _(g):
    return g.resize_nearest_2x(g.param("x", [1, 2, 3, 2]))


for _r in ["sum", "mean", "max", "min", "prod"]:
    def _mk(r):
        def build(g):
            return g.reduce(g.param("x", [3, 4, 5]), r, [0, 2], keep_dim=(r == "mean"))
        return build
    case(f"reduce_{_r}")(_mk(_r))


@case("softmax")
def _(g):
    return g.softmax(g.param("x", [3, 5]), -1)


@case("cumsum")
def _(g):
    return g.cumsum(g.param("x", [3, 5]), 1)


@case("cumsum_exclusive")
def _(g):
    return g.cumsum(g.param("x", [3, 5]), 0, exclusive=True)


@case("matmul_batched")
def _(g):
    return g.matmul(g.param("a", [2, 3, 4]), g.param("b", [4, 5]))


@case("dot_general")
def _(g):
    return g.dot_general(g.param("a", [2, 4, 3]), g.param("b", [3, 2, 5]), [2], [0], [0], [1])


@case("dense_solve")
def _(g):
    a = g.add(g.param("a", [3, 3]), g.constant(np.eye(3, dtype=np.float32) * 4))
    return g.dense_solve(a, g.param("b", [3, 2]))


@case("batched_dense_solve")
def _(g):
    a = g.add(g.param("a", [2, 3, 3]), g.constant(np.eye(3, dtype=np.float32) * 4))
    return g.batched_dense_solve(a, g.param("b", [2, 3]))


@case("lora_matmul")
def _(g):
    return g.lora_matmul(g.param("x", [2, 3, 4]), g.param("w", [4, 5]), g.param("a", [4, 2]),
                         g.param("b", [2, 5]), 0.5)


@case("grouped_matmul", e=lambda r: r.randint(0, 3, (5,)))
def _(g):
    return g.grouped_matmul(g.param("x", [5, 4]), g.param("w", [3, 4, 2]), g.input("e", [5], "i32"))


@case("scatter_add", idx=lambda r: r.randint(0, 4, (6,)))
def _(g):
    return g.scatter_add(g.param("u", [6, 3]), g.input("idx", [6], "i32"), [4, 3])


@case("layer_norm")
def _(g):
    return g.layer_norm(g.param("x", [3, 8]), g.param("gamma", [8]), g.param("beta", [8]))


@case("layer_norm_axis1")
def _(g):
    return g.layer_norm(g.param("x", [2, 3, 4]), g.param("gamma", [3]), g.param("beta", [3]), axis=1)


@case("rms_norm")
def _(g):
    return g.rms_norm(g.param("x", [3, 8]), g.param("gamma", [8]), g.param("beta", [8]))


@case("rms_norm_axis1")
def _(g):
    return g.rms_norm(g.param("x", [2, 3, 4]), g.param("gamma", [3]), g.param("beta", [3]), axis=1)


@case("group_norm")
def _(g):
    return g.group_norm(g.param("x", [2, 4, 3, 3]), g.param("gamma", [4]), g.param("beta", [4]), 2)


@case("batch_norm_inference")
def _(g):
    return g.batch_norm_inference(g.param("x", [2, 3, 2, 2]), g.param("gamma", [3]), g.param("beta", [3]),
                                  g.param("mean", [3]), g.param("pos_var", [3]))


@case("layer_norm2d")
def _(g):
    return g.layer_norm2d(g.param("x", [2, 4, 2, 3]), g.param("gamma", [4]), g.param("beta", [4]))


def _attn(kind="none", mask=None, score_scale=None, softcap=None, layout="bshd", gqa=False):
    def build(g):
        b, s, h, d = 2, 4, 2, 4
        hk = 1 if gqa else h
        shp = {"bshd": ([b, s, h, d], [b, s, hk, d]), "flat": ([b, s, h * d], [b, s, hk * d]),
               "bhsd": ([b, h, s, d], [b, h, s, d])}[layout]
        q, k, v = g.param("q", shp[0]), g.param("k", shp[1]), g.param("v", shp[1])
        m = None
        if kind == "custom":
            m = g.input("mask", [b, s], "f32")
        elif kind == "bias":
            m = g.param("bias", [b, h, s, s])
        return g.attention_opts(q, k, v, h, d, kind, m, score_scale=score_scale, softcap=softcap)
    return build


_keep = {"mask": lambda r: np.array([[1, 1, 0, 1], [1, 0, 1, 1]], np.float32)}
case("attention_none")(_attn())
case("attention_causal")(_attn("causal"))
case("attention_sliding")(_attn("sliding:1"))
case("attention_custom", **_keep)(_attn("custom"))
case("attention_bias")(_attn("bias"))
case("attention_score_scale")(_attn(score_scale=0.7))
case("attention_softcap")(_attn("causal", softcap=2.0))
case("attention_flat_gqa")(_attn(layout="flat", gqa=True))
case("attention_scale_causal")(_attn("causal", score_scale=0.3))


@case("rope")
def _(g):
    x = g.param("x", [1, 2, 3, 4])
    cos = g.input("cos", [3, 2], "f32")
    sin = g.input("sin", [3, 2], "f32")
    return g.rope(x, cos, sin, 4)


@case("conv2d")
def _(g):
    return g.conv2d(g.param("x", [2, 2, 6, 5]), g.param("w", [3, 2, 3, 2]))


@case("conv2d_stride_pad_dil_groups")
def _(g):
    return g.conv2d(g.param("x", [1, 4, 7, 7]), g.param("w", [2, 2, 3, 3]), stride=(2, 1), padding=(1, 2),
                    dilation=(1, 2), groups=2)


@case("conv_transpose2d")
def _(g):
    return g.conv_transpose2d(g.param("x", [1, 2, 3, 3]), g.param("w", [2, 3, 2, 2]), stride=(2, 2), padding=(0, 1))


@case("max_pool2d")
def _(g):
    return g.max_pool2d(g.param("x", [1, 2, 4, 6]), 2)


@case("max_pool2d_overlap")
def _(g):
    return g.max_pool2d(g.param("x", [1, 2, 5, 5]), 3, stride=1, padding=(1, 1))


@case("avg_pool2d")
def _(g):
    return g.avg_pool2d(g.param("x", [1, 2, 5, 5]), 2, stride=2, padding=(1, 1))


@case("softmax_cross_entropy", labels=lambda r: r.randint(0, 5, (4,)).astype(np.float32))
def _(g):
    return g.softmax_cross_entropy_with_logits(g.param("logits", [4, 5]), g.input("labels", [4], "f32"))


for _ste in ["identity", "clipped_identity", "tanh", "hard_tanh"]:
    def _mk(ste):
        def build(g):
            return g.fake_quantize(g.param("x", [3, 8]), 4, None, ste)
        return build
    case(f"fake_quantize_{_ste}")(_mk(_ste))


@case("fake_quantize_lsq")
def _(g):
    return g.fake_quantize_lsq(g.param("x", [3, 8]), g.param("pos_s", [1]), 4)


@case("complex_norm_sq")
def _(g):
    return g.complex_norm_sq(g.param("z", [3, 4], "c64"))


@case("fft")
def _(g):
    z = g.param("z", [2, 8], "c64")
    return g.complex_norm_sq(g.fft(g.mul(z, z)))


@case("log_mel")
def _(g):
    return g.log_mel(g.param("pos_spec", [2, 3, 6]), g.param("pos_fb", [6, 4]))


@case("fused_matmul_bias_act")
def _(g):
    return g.fused_matmul_bias_act(g.param("x", [3, 4]), g.param("w", [4, 5]), g.param("b", [5]),
                                   activation="gelu")


@case("fused_residual_ln")
def _(g):
    return g.fused_residual_ln(g.param("x", [3, 8]), g.param("r", [3, 8]), g.param("gamma", [8]),
                               g.param("beta", [8]))


@case("fused_residual_rms_norm")
def _(g):
    return g.fused_residual_rms_norm(g.param("x", [3, 8]), g.param("r", [3, 8]), g.param("gamma", [8]),
                                     g.param("beta", [8]), bias=g.param("bias", [8]))


@case("fused_swiglu")
def _(g):
    return g.fused_swiglu(g.param("x", [3, 8]))


@case("fused_attention_block", mask=lambda r: np.ones((2, 3), np.float32))
def _(g):
    return g.fused_attention_block([g.param("h", [2, 3, 8]), g.param("qkv_w", [8, 24]), g.param("out_w", [8, 8]),
                                    g.input("mask", [2, 3], "f32")], 2, 4)


@case("fused_transformer_layer", mask=lambda r: np.ones((2, 3), np.float32))
def _(g):
    ins = [g.param("h", [2, 3, 8]), g.param("qkv_w", [8, 24]), g.param("qkv_b", [24]), g.param("out_w", [8, 8]),
           g.param("out_b", [8]), g.param("ln1_g", [8]), g.param("ln1_b", [8]), g.param("fc1_w", [8, 16]),
           g.param("fc1_b", [16]), g.param("fc2_w", [16, 8]), g.param("fc2_b", [8]), g.param("ln2_g", [8]),
           g.param("ln2_b", [8]), g.input("mask", [2, 3], "f32")]
    return g.fused_transformer_layer(ins, 2, 4, 16)


def body(name, shapes, fn):
    b = Graph(name)
    ins = [b.input(f"i{k}", s) for k, s in enumerate(shapes)]
    out = fn(b, *ins)
    b.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return b


@case("if_where")
def _(g):
    x, y = g.param("x", [3]), g.param("y", [3])
    pred = g.gt_(g.sum(x, [0]), g.sum(y, [0]))
    return g.if_(pred, body("then", [[3], [3]], lambda b, a, c: b.mul(a, c)),
                 body("else", [[3], [3]], lambda b, a, c: b.sin(a)), [x, y])


@case("while_unrolled")
def _(g):
    x = g.param("pos_x", [3])
    cond = body("cond", [[3]], lambda b, a: b.lt_(b.sum(a, [0]), b.scalar(20.0)))
    step = body("step", [[3]], lambda b, a: b.mul(a, b.scalar(1.7)))
    return g.while_([x], cond, step, max_iterations=8)


@case("if_untaken_branch_singular", x=lambda r: np.array([0.0, 2.0, -1.0], np.float32))
def _(g):
    # the else branch is taken (sum x = 1 < 5); the then branch's sqrt is singular at 0 and
    # NaN at -1, and must not reach the gradient
    x = g.param("x", [3])
    pred = g.gt_(g.sum(x, [0]), g.scalar(5.0))
    return g.if_(pred, body("then", [[3]], lambda b, a: b.sqrt(a)), body("else", [[3]], lambda b, a: b.mul(a, a)),
                 [x])


@case("while_exits_outside_the_body_domain", x=lambda r: (2.25 + 0.5 * r.rand(1)).astype(np.float32))
def _(g):
    # while c > 0: c = sqrt(c) - 1 stops at a c < 0, where sqrt has no derivative: the
    # masked steps after the exit must not differentiate the body there (NaN otherwise)
    x = g.param("x", [1])
    cond = body("cond", [[1]], lambda b, a: b.gt_(a, b.scalar(0.0)))
    step = body("step", [[1]], lambda b, a: b.sub(b.sqrt(a), b.scalar(1.0)))
    return g.while_([x], cond, step, max_iterations=5)


@case("custom_fn_inlined")
def _(g):
    x = g.param("x", [3, 4])
    return g.custom_fn([x], body("f", [[3, 4]], lambda b, a: b.tanh(b.mul(a, a))))


@case("custom_fn_vjp_body")
def _(g):
    x = g.param("x", [3, 4])
    fwd = body("f", [[3, 4]], lambda b, a: b.sin(a))
    vjp = Graph("f_vjp")
    a = vjp.input("i0", [3, 4])
    vjp.input("primal_output", [3, 4])
    d = vjp.input("d_output", [3, 4])
    vjp.set_outputs([vjp.mul(d, vjp.cos(a))])
    return g.custom_fn([x], fwd, vjp)


@case("scan_final_carry")
def _(g):
    c0 = g.param("c0", [3])
    xs = g.param("xs", [4, 3])
    return g.scan(c0, body("step", [[3], [3]], lambda b, c, x: b.tanh(b.add(b.mul(c, x), x))), 4, xs=[xs])


@case("scan_trajectory")
def _(g):
    c0 = g.param("c0", [3])
    xs = g.param("xs", [4, 3])
    return g.scan(c0, body("step", [[3], [3]], lambda b, c, x: b.sin(b.mul(c, x))), 4, xs=[xs],
                  save_trajectory=True)


@case("scan_body_param")
def _(g):
    # the body reads Param "w" (bound to the outer graph's "w", which the loss also reads
    # outside the scan) beside a broadcast operand: both need the gradient summed over steps
    c0, u, xs, w = g.param("c0", [3]), g.param("u", [3]), g.param("xs", [4, 3]), g.param("w", [3])
    step = body("step", [[3], [3], [3]], lambda b, c, uu, x: b.tanh(b.add(b.mul(c, b.param("w", [3])), b.mul(x, uu))))
    return g.add(g.scan(c0, step, 4, bcasts=[u], xs=[xs]), g.mul(w, w))


@case("scan_body_if_param")
def _(g):
    # the Param is read two levels down, in an If branch inside the scan's body, and the
    # outer graph declares it only after the scan: its gradient still sums over the steps
    c0, xs = g.param("c0", [3]), g.param("xs", [4, 3])

    def step(b, c, x):
        taken = b.gt_(b.sum(x, [0]), b.scalar(-100.0))
        scaled = b.if_(taken, body("then", [[3]], lambda bb, a: bb.mul(a, bb.param("w", [3]))),
                       body("else", [[3]], lambda bb, a: bb.add(a, a)), [c])
        return b.tanh(b.add(scaled, x))

    out = g.scan(c0, body("step", [[3], [3]], step), 4, xs=[xs])
    w = g.param("w", [3])
    return g.add(out, g.mul(w, w))


@case("scan_in_scan_param")
def _(g):
    # a scan inside a scan's body reading Param "w": the inner scan is prepared with the
    # outer body, so both the nesting and the Param's gradient work
    c0, xs, w = g.param("c0", [3]), g.param("xs", [4, 3]), g.param("w", [3])

    def step(b, c, x):
        inner = body("inner", [[3], [3]], lambda bb, cc, xx: bb.tanh(bb.add(bb.mul(cc, bb.param("w", [3])), xx)))
        return b.add(b.scan(c, inner, 2, xs=[b.expand(b.reshape(x, [1, 3]), [2, 3])]), x)

    return g.add(g.scan(c0, body("step", [[3], [3]], step), 4, xs=[xs]), w)


@case("if_scan_param")
def _(g):
    # a scan inside the taken If branch reads Param "w"
    c0, xs, w = g.param("c0", [3]), g.param("xs", [4, 3]), g.param("w", [3])
    pred = g.gt_(g.sum(c0, [0]), g.scalar(-100.0))
    inner = body("inner", [[3], [3]], lambda bb, cc, xx: bb.tanh(bb.add(bb.mul(cc, bb.param("w", [3])), xx)))
    then = body("then", [[3], [4, 3]], lambda b, c, x: b.scan(c, inner, 4, xs=[x]))
    other = body("else", [[3], [4, 3]], lambda b, c, x: b.add(c, c))
    return g.add(g.if_(pred, then, other, [c0, xs]), w)


@case("scan_body_while_param")
def _(g):
    # a While (unrolled by prepare) inside a scan's body reads Param "w"
    c0, xs, w = g.param("c0", [3]), g.param("xs", [4, 3]), g.param("w", [3])

    def step(b, c, x):
        cond = body("cond", [[3]], lambda bb, a: bb.lt_(bb.sum(bb.abs(a), [0]), bb.scalar(1e9)))
        grow = body("grow", [[3]], lambda bb, a: bb.tanh(bb.mul(a, bb.param("w", [3]))))
        return b.add(b.while_([c], cond, grow, max_iterations=2), x)

    return g.add(g.scan(c0, body("step", [[3], [3]], step), 4, xs=[xs]), w)


@case("elementwise_region")
def _(g):
    from rlx_jax.ir import ChainOperand as O, ChainStep as S

    a, b = g.param("a", [3, 4]), g.param("b", [3, 4])
    chain = [S("Binary", "Mul", (O("Input", 0), O("Input", 1))), S("Activation", "Tanh", (O("Step", 0),)),
             S("Binary", "Add", (O("Step", 1), O("Input", 0)))]
    return g.elementwise_region([a, b], chain, [3, 4], "f32")


@case("lora_matmul_vector")
def _(g):
    return g.lora_matmul(g.param("x", [4]), g.param("w", [4, 5]), g.param("a", [4, 2]), g.param("b", [2, 5]), 2.0)


@case("selective_scan")
def _(g):
    return g.selective_scan(g.param("x", [2, 3, 4]), g.param("pos_delta", [2, 3, 4]), g.param("a", [4, 2]),
                            g.param("b", [2, 3, 2]), g.param("c", [2, 3, 2]))


@case("gated_delta_net")
def _(g):
    ins = [g.param(n, [1, 3, 2, 4]) for n in ("q", "k", "v")]
    return g.gated_delta_net(*ins, g.param("g", [1, 3, 2]), g.param("beta", [1, 3, 2]))


@case("gated_delta_net_state")
def _(g):
    ins = [g.param(n, [1, 3, 2, 4]) for n in ("q", "k", "v")]
    return g.gated_delta_net(*ins, g.param("g", [1, 3, 2]), g.param("beta", [1, 3, 2]),
                             state=g.param("s0", [1, 2, 4, 4]))


@case("axial_rope2d")
def _(g):
    return g.axial_rope2d(g.param("x", [2, 6, 16]), 3, 2, 8, 2)


@case("rope_tables_partial")
def _(g):
    x = g.param("x", [2, 3, 8])
    return g.rope_n(x, g.param("cos", [3, 4]), g.param("sin", [3, 4]), 8, 4)


@case("scan_bcast")
def _(g):
    c0, w, xs = g.param("c0", [3]), g.param("w", [3]), g.param("xs", [4, 3])
    step = body("step", [[3], [3], [3]], lambda b, c, ww, x: b.tanh(b.add(b.mul(c, ww), x)))
    return g.scan(c0, step, 4, bcasts=[w], xs=[xs])


# -- max pooling: overlapping windows, padding, ties ---------------------------------------

@case("max_pool2d_ties", x=lambda r: r.randint(-2, 3, (1, 2, 6, 5)))
def _(g):
    # integer values: many windows hold their maximum twice (the first one wins); squared
    # so that the second derivative runs through MaxPool2dBackward's own VJP
    y = g.max_pool2d(g.param("x", [1, 2, 6, 5]), 3, stride=2, padding=(1, 1))
    return g.mul(y, y)


@case("max_pool2d_rect_overlap")
def _(g):
    y = g.max_pool2d(g.param("x", [2, 1, 7, 6]), (3, 2), stride=(1, 2), padding=(1, 1))
    return g.mul(y, y)


# -- weight-only quantised matmuls (d x only) ---------------------------------------------

_i8 = lambda r: r.randint(-128, 128, (8, 5))                       # noqa: E731


@case("dequant_matmul_int8_asym", w=_i8, s=lambda r: r.uniform(0.05, 0.2, (2, 5)), z=lambda r: r.randn(2, 5))
def _(g):
    return g.dequant_matmul([g.param("x", [2, 3, 8]), g.input("w", [8, 5], "i8"), g.input("s", [2, 5], "f32"),
                             g.input("z", [2, 5], "f32")], "Int8BlockAsym:4", [2, 3, 5])


@case("dequant_matmul_int4", w=lambda r: r.randint(0, 256, (20,)), s=lambda r: r.uniform(0.05, 0.2, (2, 5)),
      z=lambda r: np.zeros((2, 5)))
def _(g):
    return g.dequant_matmul([g.param("x", [3, 8]), g.input("w", [20], "u8"), g.input("s", [2, 5], "f32"),
                             g.input("z", [2, 5], "f32")], "Int4Block:4", [3, 5])


def _gguf_q8_0(r, nblocks):
    """GGUF Q8_0 blocks: f16 scale, then 32 int8 values."""
    raw = r.randint(0, 256, (nblocks, 34)).astype(np.uint8)
    for blk in raw:
        blk[0:2] = np.frombuffer(np.float16(r.uniform(0.01, 0.05)).tobytes(), np.uint8)
    return raw.reshape(-1)


@case("dequant_matmul_gguf", w=lambda r: _gguf_q8_0(r, 2))
def _(g):
    return g.dequant_matmul([g.param("x", [3, 32]), g.input("w", [68], "u8")], "GgufQ8_0", [3, 2])


@case("dequant_grouped_matmul_gguf", w=lambda r: _gguf_q8_0(r, 6), e=lambda r: r.randint(0, 3, (5,)))
def _(g):
    return g.dequant_grouped_matmul(g.param("x", [5, 32]), g.input("w", [204], "u8"), g.input("e", [5], "i32"),
                                    "GgufQ8_0", [5, 2])


# -- Gaussian splatting --------------------------------------------------------------------

_SPLAT_N, _SPLAT_K, _SPLAT_W, _SPLAT_H = 12, 4, 12, 8
_SPLAT_KW = dict(width=_SPLAT_W, height=_SPLAT_H, tile_size=4, max_list_entries=4096)


def _splat_meta(r):
    from rlx_jax.ops import gaussian_splat_render_meta

    return np.asarray(gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0,
                                                 [0.1, 0.2, 0.3]), np.float32)


def _splat_feeds():
    n, k = _SPLAT_N, _SPLAT_K

    def pos(r):
        p = r.uniform(-1, 1, (n, 3))
        p[:, 2] *= 0.5
        return p.reshape(-1)

    return dict(positions=pos, scales=lambda r: np.log(r.uniform(0.1, 0.4, 3 * n)),
                rotations=lambda r: r.randn(4 * n), opacities=lambda r: r.randn(n),
                colors=lambda r: r.uniform(0, 1, 3 * n), sh=lambda r: 0.2 * r.randn(n * k * 3), meta=_splat_meta)


def _splat_scene(g):
    n, k = _SPLAT_N, _SPLAT_K
    return [g.param("positions", [3 * n]), g.param("scales", [3 * n]), g.param("rotations", [4 * n]),
            g.param("opacities", [n]), g.param("colors", [3 * n]), g.param("sh", [n * k * 3]),
            g.input("meta", [23], "f32")]


@case("gaussian_splat_render", **_splat_feeds())
def _(g):
    return g.gaussian_splat_render(*_splat_scene(g), **_SPLAT_KW)


@case("gaussian_splat_prepare_rasterize", **_splat_feeds())
def _(g):
    from rlx_jax.lowering.splat import prep_len

    ids = _splat_scene(g)
    prep = g.gaussian_splat_prepare(ids, [prep_len(_SPLAT_N, _SPLAT_W, _SPLAT_H, 4, 4096)], **_SPLAT_KW)
    return g.gaussian_splat_rasterize(prep, ids[6], **_SPLAT_KW)


# -- attention: every mask kind with a score scale and a logit softcap ----------------------

case("attention_none_scale_softcap")(_attn(score_scale=0.6, softcap=1.5))
case("attention_causal_scale_softcap")(_attn("causal", score_scale=0.6, softcap=1.5))
case("attention_sliding_scale_softcap")(_attn("sliding:1", score_scale=0.6, softcap=1.5))
case("attention_custom_scale_softcap", **_keep)(_attn("custom", score_scale=0.6, softcap=1.5))
case("attention_bias_scale_softcap")(_attn("bias", score_scale=0.6, softcap=1.5))
case("attention_bhsd_softcap")(_attn("causal", softcap=3.0, layout="bhsd"))
case("attention_flat_gqa_softcap")(_attn("sliding:2", score_scale=0.4, softcap=1.0, layout="flat", gqa=True))


# -- LSQ per channel -----------------------------------------------------------------------

@case("fake_quantize_lsq_per_channel")
def _(g):
    return g.fake_quantize_lsq(g.param("x", [3, 4, 5]), g.param("pos_s", [4]), 3, axis=1)



@case("dequant_matmul_fp8_e4m3", w=lambda r: r.randint(0, 0x78, (8, 5)) | (r.randint(0, 2, (8, 5)) << 7),
      s=lambda r: r.uniform(0.5, 2.0, (5,)), z=lambda r: np.zeros((5,)))
def _(g):
    # bytes with exponent < 15 (finite values), random signs; per-column scale
    return g.dequant_matmul([g.param("x", [3, 8]), g.input("w", [8, 5], "u8"), g.input("s", [5], "f32"),
                             g.input("z", [5], "f32")], "Fp8E4m3", [3, 5])
