"""The Triton kernel of edge_kernels.paged_decode, in a module of its own so that `triton` and
`tl` are module globals: Triton's interpreter (TRITON_INTERPRET=1) remaps the language
functions a kernel finds in its globals, and a kernel defined in a closure calls the real
jitted `tl.cdiv` instead ("Cannot call @triton.jit'd outside of the scope of a kernel").
Imported lazily, by paged_decode._kernel: triton picks the interpreter when this is imported.
"""
import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(Q, K, V, BT, SL, VALID, O, LSE, scale,
                        sq_b, sq_h, sq_d,
                        sk_n, sk_s, sk_h, sk_d,
                        sv_n, sv_s, sv_h, sv_d,
                        sbt_b, sbt_n, svl_n, svl_s,
                        G, HD, BS,
                        HAS_VALID: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(SL + b).to(tl.int32)
    # this split's share of the row's live tiles: the loop bound follows seq_len
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.cdiv(n_tiles, SPLITS)
    t0 = sp * per
    t1 = tl.minimum(t0 + per, n_tiles)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gm = g < G
    dm = d < HD
    heads = kv * G + g                                            # (BG,) query heads of kv
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
                mask=gm[:, None] & dm[None, :], other=0.0)        # (BG, BD) in q's dtype
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(t0, t1):
        s = t * BLOCK_N + n                                       # (BN,) key slots
        live = s < seq_len
        blk = tl.load(BT + b * sbt_b + (s // BS) * sbt_n, mask=live, other=0).to(tl.int64)
        off = s % BS
        if HAS_VALID:   # memory-region holes: never read, never weighted
            live = live & (tl.load(VALID + blk * svl_n + off * svl_s, mask=live, other=0) != 0)
        km = live[:, None] & dm[None, :]
        # cast on read to q's dtype, as paged_attention does (fp16 pool under fp32 q)
        k = tl.load(K + blk[:, None] * sk_n + off[:, None] * sk_s + kv * sk_h + d[None, :] * sk_d,
                    mask=km, other=0.0).to(q.dtype)               # (BN, BD)
        v = tl.load(V + blk[:, None] * sv_n + off[:, None] * sv_s + kv * sv_h + d[None, :] * sv_d,
                    mask=km, other=0.0).to(q.dtype)
        # ieee: no TF32 for fp32 q (the 1e-5 parity); fp16 inputs accumulate in fp32
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BG, BN)
        qk = tl.where(live[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # a tile of holes: no NaN
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0                                            # no readable key in this split
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    row = (b * G * tl.num_programs(1) + heads) * SPLITS + sp      # O: (B, H, SPLITS, BD) fp32
    tl.store(O + row[:, None] * BLOCK_D + d[None, :], out, mask=gm[:, None])
    tl.store(LSE + row, lse, mask=gm)                             # LSE: (B, H, SPLITS)

