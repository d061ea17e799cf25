"""The C structures the CPU step and products take (kernels/cpu/step.c), as ctypes structures.

Pointers are raw addresses of tensors owned by Python: whoever builds a structure keeps the tensors
alive while the C side may use it."""
from __future__ import annotations

import ctypes

KIND_F32, KIND_Q4, KIND_Q8, KIND_QT = 0, 4, 8, 16
Q4_K6 = 2   # SSMat.qtype of a q4 matrix whose scales are a Q4_K matrix's 6-bit ones (step.c)
_P = ctypes.c_void_p
_I = ctypes.c_int32
_F = ctypes.c_float


class SSMat(ctypes.Structure):
    """A weight matrix: codes (or fp32 values, or ggml blocks), per-group scales and mins, optional
    bias; `qtype` is the ggml type of KIND_QT blocks; `next` continues the matrix's rows in another
    matrix (a chain of parts of different kinds)."""


SSMat._fields_ = [("q", _P), ("scale", _P), ("min", _P), ("bias", _P), ("kind", _I), ("n", _I), ("k", _I),
                  ("qtype", _I), ("next", ctypes.POINTER(SSMat)), ("scale_t", _P), ("min_t", _P), ("tile_k", _I),
                  ("pad", _I), ("kdm", _P)]


class SSMoe(ctypes.Structure):
    """A mixture-of-experts FFN: router, the shared expert (n == 0: none) and its gate, arrays of the E
    experts' fused gate/up and down matrices; sizes and whether the top-k weights are renormalised."""
    _fields_ = [("router", SSMat), ("shared_gate_up", SSMat), ("shared_down", SSMat), ("shared_gate", SSMat),
                ("gate_up", ctypes.POINTER(SSMat)), ("down", ctypes.POINTER(SSMat)), ("experts", _I), ("topk", _I),
                ("ffn", _I), ("shared_ffn", _I), ("norm_topk", _I), ("pad", _I)]


class SSLayer(ctypes.Structure):
    _fields_ = [("qkv", SSMat), ("o", SSMat), ("gate_up", SSMat), ("down", SSMat), ("attn_norm", _P),
                ("ffn_norm", _P), ("q_norm", _P), ("k_norm", _P), ("kcache", _P), ("vcache", _P),
                ("post_attn_norm", _P), ("post_ffn_norm", _P), ("window", _I), ("rope_local", _I),
                ("kv_type", _I), ("local_slots", _I), ("moe", ctypes.POINTER(SSMoe)), ("kscale", _P),
                ("vscale", _P)]


class SSModel(ctypes.Structure):
    _fields_ = [("n_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("ffn", _I), ("vocab", _I), ("act", _I), ("eps", _F), ("attn_scale", _F),
                ("layers", ctypes.POINTER(SSLayer)), ("embed", SSMat), ("lm_head", SSMat), ("norm", _P),
                ("embed_scale", _F), ("rotary", _I), ("attn_softcap", _F), ("final_softcap", _F), ("pad", _I)]


ACT_SILU, ACT_GELU_TANH = 0, 1


class SSAct(ctypes.Structure):
    """An activation: fp32 rows, and for the fast path their int8 codes, group scales and sums."""
    # p, e: simd.h ss_pair_groups; h: per-16 code sums (step.c makes them where a Q6_K product needs them)
    _fields_ = [("f", _P), ("q", _P), ("d", _P), ("s", _P), ("p", _P), ("e", _P), ("h", _P)]


class SSStep(ctypes.Structure):
    _fields_ = [("rows", _I), ("pad", _I), ("tokens", _P), ("write_slots", _P), ("read_slots", _P),
                ("starts", _P), ("cos", _P), ("sin", _P), ("x", _P), ("h", SSAct), ("qkv", _P),
                ("attn", SSAct), ("act", SSAct), ("logits", _P), ("next_tokens", _P),
                ("n_out", _I), ("pad2", _I), ("out_rows", _P), ("cos_local", _P), ("sin_local", _P), ("tmp", _P),
                ("router", _P), ("sgate", _P), ("moe_idx", _P), ("pair_w", _P), ("hx", SSAct), ("eact", SSAct),
                ("sact", SSAct), ("write_slots_local", _P), ("read_slots_local", _P)]
